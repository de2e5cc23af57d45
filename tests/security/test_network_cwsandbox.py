"""CoreWeave Sandbox's egress rules with the real cwsandbox client, and TLS through the
proxy: ``EgressRule(dns_name=...)`` grants that name's HTTPS (the proxy reads the SNI
and dials the name itself; a forged address gains nothing); other names get nothing."""

from __future__ import annotations

import json

import pytest

from tests.security.net_helpers import no_host_proxy, self_signed, server_ns  # noqa: F401  (a fixture)

cwsandbox = pytest.importorskip("cwsandbox")
from cwsandbox import EgressRule, NetworkOptions, Sandbox  # noqa: E402

from tests.server.test_compat_cwsandbox import SMALL, serving  # noqa: E402

TLS_GET = r"""
import json, socket, ssl, sys
out = {}
for key, name, ip in json.loads(sys.argv[1]):
    ctx = ssl.create_default_context()
    ctx.check_hostname, ctx.verify_mode = False, ssl.CERT_NONE  # a self-signed test server
    try:
        raw = socket.create_connection((ip or name, 443), timeout=10)
        s = ctx.wrap_socket(raw, server_hostname=name)
        s.sendall(b"GET / HTTP/1.0\r\nHost: " + name.encode() + b"\r\n\r\n")
        data = b""
        while chunk := s.recv(4096):
            data += chunk
        out[key] = data.split(b"\r\n\r\n", 1)[-1].decode()
    except Exception as e:
        out[key] = type(e).__name__
print(json.dumps(out))
"""


@pytest.fixture(scope="module")
def cw_net(tmp_path_factory):
    certs = self_signed(str(tmp_path_factory.mktemp("tls")), "good.test")
    with server_ns(30, "GOOD", tls=certs) as good, server_ns(34, "BAD", tls=certs) as bad, \
            pytest.MonkeyPatch.context() as mp:
        mp.setenv("CORRAL_NETWORK_HOSTS", f"good.test={good},bad.test={bad}")
        with serving() as (daemon, _):
            yield daemon, good, bad


def test_dns_name_egress_rule_grants_https_to_that_name(cw_net):
    _, good, bad = cw_net
    sb = Sandbox.run(resources=SMALL, network=NetworkOptions(
        egress=[EgressRule(dns_name="good.test")]))
    try:
        sb.wait()
        probes = [["good", "good.test", None], ["bad", "bad.test", None],
                  ["forged", "good.test", bad], ["sni_bad", "bad.test", good]]
        r = sb.exec(["python3", "-c", TLS_GET, json.dumps(probes)]).result()
        assert r.returncode == 0, (r.stdout, r.stderr)
        got = json.loads(r.stdout)
        assert got["good"] == "GOOD GET / HTTP/1.0"
        assert got["bad"] == "gaierror"  # NXDOMAIN
        assert got["forged"] == "GOOD GET / HTTP/1.0"  # dialled by name, not at BAD
        assert got["sni_bad"] in ("ConnectionResetError", "SSLEOFError", "SSLError")
    finally:
        Sandbox.delete(sb.sandbox_id, missing_ok=True).result()


def test_unmappable_rules_are_refused(cw_net):
    from cwsandbox.exceptions import SandboxError

    with pytest.raises(SandboxError):
        Sandbox.run(resources=SMALL, network=NetworkOptions(
            egress=[EgressRule(cidr="10.0.0.0/8", ports=[{"port": 53, "protocol": "UDP"}])]))
