"""E2B's egress options with the unmodified e2b client: ``network={allow_out,
deny_out}`` becomes a corral policy (an allowed name reached, a denied one refused),
``allow_internet_access=True`` the public internet through the filter (never the
host's private services)."""

from __future__ import annotations

import pytest

from tests.security.net_helpers import no_host_proxy, server_ns  # noqa: F401  (a fixture)
from tests.server.test_compat_e2b import checked, run_script, serving


@pytest.fixture(scope="module")
def e2b_net():
    with server_ns(14, "GOOD") as good, server_ns(18, "BAD") as bad, \
            pytest.MonkeyPatch.context() as mp:
        mp.setenv("CORRAL_NETWORK_HOSTS", f"good.test={good},bad.test={bad}")
        with serving() as d:
            yield d


def test_allow_out_deny_out(e2b_net):
    with checked(e2b_net) as d:
        out = run_script(d, """
            fetch = ("import socket, sys\\n"
                     "try:\\n"
                     "    s = socket.create_connection((sys.argv[1], 80), timeout=10)\\n"
                     "    s.sendall(b'GET / HTTP/1.0\\\\r\\\\nHost: ' + sys.argv[1].encode() + b'\\\\r\\\\n\\\\r\\\\n')\\n"
                     "    print(s.recv(4096).split(b'\\\\r\\\\n\\\\r\\\\n', 1)[-1].decode())\\n"
                     "except Exception as e:\\n"
                     "    print(type(e).__name__)\\n")
            with Sandbox.create(network={"allow_out": ["good.test"],
                                         "deny_out": [ALL_TRAFFIC]}) as sb:
                sb.files.write("/tmp/fetch.py", fetch)
                out["good"] = sb.commands.run("python3 /tmp/fetch.py good.test").stdout.strip()
                out["bad"] = sb.commands.run("python3 /tmp/fetch.py bad.test").stdout.strip()
            with Sandbox.create(allow_internet_access=True) as sb:
                sb.files.write("/tmp/fetch.py", fetch)
                out["open"] = sb.commands.run("python3 /tmp/fetch.py bad.test").stdout.strip()
                out["host"] = sb.commands.run("python3 /tmp/fetch.py 127.0.0.53").stdout.strip()
                sb.update_network({"allow_out": ["good.test"], "deny_out": ["0.0.0.0/0"]})
                out["locked"] = sb.commands.run("python3 /tmp/fetch.py bad.test").stdout.strip()
                out["still"] = sb.commands.run("python3 /tmp/fetch.py good.test").stdout.strip()
            try:
                Sandbox.create(network={"allow_out": ["10.0.0.0/33"],
                                        "deny_out": [ALL_TRAFFIC]})
                out["malformed"] = "created"
            except SandboxException as e:
                out["malformed"] = str(e)[:3]
        """.replace("ALL_TRAFFIC", '"0.0.0.0/0"'))
    assert out["good"] == "GOOD GET / HTTP/1.0"
    assert out["bad"] == "gaierror"
    assert out["open"] == "BAD GET / HTTP/1.0"  # deny nothing: the public internet
    assert out["host"] in ("ConnectionRefusedError", "ConnectionResetError")
    assert out["locked"] == "gaierror" and out["still"] == "GOOD GET / HTTP/1.0"
    assert out["malformed"] == "400"


def test_get_host_reaches_a_port_with_the_traffic_token(e2b_net):
    """``get_host(port)`` of the unmodified client names ``PORT-ID.domain``: the daemon
    serves that Host (a wildcard DNS name would point at it) to whoever brings the
    sandbox's traffic access token, and to nobody else."""
    with checked(e2b_net) as d:
        out = run_script(d, """
            import time, httpx
            with Sandbox.create() as sb:
                sb.files.write("/workspace/index.html", "served from e2b")
                sb.commands.run("python3 -m http.server 8000 --bind 127.0.0.1 -d /workspace",
                                background=True)
                host = sb.get_host(8000)
                out["host"] = host.startswith("8000-" + sb.sandbox_id + ".")
                token = sb.traffic_access_token
                for _ in range(100):
                    r = httpx.get(ENDPOINT,
                                  headers={"Host": host, "e2b-traffic-access-token": token})
                    if r.status_code != 502:
                        break
                    time.sleep(0.1)
                out["got"] = [r.status_code, r.text]
                r = httpx.get(ENDPOINT, headers={"Host": host,
                                                 "e2b-traffic-access-token": "0" * 64})
                out["forged"] = r.status_code
                r = httpx.get(ENDPOINT, headers={"Host": host})
                out["none"] = r.status_code
        """.replace("ENDPOINT", repr(d.endpoint + "/index.html")))
    assert out["host"] is True
    assert out["got"] == [200, "served from e2b"]
    assert out["forged"] == 401 and out["none"] == 401
