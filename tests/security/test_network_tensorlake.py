"""Tensorlake's ``allow_out`` / ``deny_out`` with the real tensorlake client: with
``0.0.0.0/0`` denied, ``allow_out`` is the sandbox's allow list (an allowed name reached
through corral's filter, another refused)."""

from __future__ import annotations

import pytest

from tests.security.net_helpers import no_host_proxy, server_ns  # noqa: F401  (a fixture)

pytest.importorskip("tensorlake")
from tests.server.test_compat_tensorlake import checked, run_script, serving  # noqa: E402

FETCH = ("import socket, sys\n"
         "try:\n"
         "    s = socket.create_connection((sys.argv[1], 80), timeout=10)\n"
         "    s.sendall(b'GET / HTTP/1.0\\r\\nHost: ' + sys.argv[1].encode() + b'\\r\\n\\r\\n')\n"
         "    print(s.recv(4096).split(b'\\r\\n\\r\\n', 1)[-1].decode())\n"
         "except Exception as e:\n"
         "    print(type(e).__name__)\n")


def test_allow_out_with_everything_denied(tmp_path):
    with server_ns(38, "GOOD") as good, server_ns(42, "BAD") as bad, \
            serving(env={"CORRAL_NETWORK_HOSTS": f"good.test={good},bad.test={bad}"}) as d, \
            checked(d):
        out = run_script(d, f"""
            sb = Sandbox.create(memory_mb=128, allow_out=["good.test"], deny_out=["0.0.0.0/0"])
            for name in ("good.test", "bad.test"):
                r = sb.run("python3", ["-c", {FETCH!r}, name])
                out[name] = r.stdout.strip()
            sb.terminate()
        """)
    assert out == {"good.test": "GOOD GET / HTTP/1.0", "bad.test": "gaierror"}
