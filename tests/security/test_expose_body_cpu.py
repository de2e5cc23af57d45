"""An exposed port's HTTP relay reads the request's body before it relays it
(server/expose.py, up to ``--max-upload-bytes``, 256 MiB by default). It gathered the
body with ``data += chunk``: each chunk copied everything before it, so the daemon's
CPU grew with the square of the body (a 64 MiB POST: ~32 GiB copied on the event
loop, every tenant's requests waiting behind it), and whoever holds a port's URL needs
no token. Measured as a ratio in one run: the daemon's CPU for a body 6 times larger
is about 6 times more, not 36 (before: 0.06 s for 8 MiB, 0.57 s for 32 MiB).
"""

from __future__ import annotations

import os

import httpx
import pytest

import corral
from tests.security.tenants_helpers import team_daemon
from tests.security.test_expose import _serve

SINK = r"""
import http.server
class H(http.server.BaseHTTPRequestHandler):
    def do_POST(self):
        left = int(self.headers["Content-Length"])
        while left > 0:
            left -= len(self.rfile.read(min(left, 1 << 20)))
        self.send_response(200)
        self.send_header("Content-Length", "2")
        self.end_headers()
        self.wfile.write(b"ok")
    def log_message(self, *a):
        pass
http.server.ThreadingHTTPServer(("127.0.0.1", 8000), H).serve_forever()
"""


@pytest.fixture(scope="module")
def team():
    with team_daemon() as t:
        yield t


def _cpu_s(pid: int) -> float:
    fields = open(f"/proc/{pid}/stat").read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def _post(pid: int, url: str, mb: int) -> float:
    """The daemon's CPU seconds for relaying a body of ``mb`` MiB (the least of 2)."""
    body = b"x" * (mb << 20)
    spent = []
    for _ in range(2):
        before = _cpu_s(pid)
        reply = httpx.post(url, content=body, timeout=600)
        spent.append(_cpu_s(pid) - before)
        assert reply.status_code == 200 and reply.text == "ok", reply.text
    return min(spent)


def test_a_relayed_body_costs_the_daemon_cpu_in_proportion_to_its_size(team):
    pid = team.daemon.proc.pid
    with corral.Client(team.url, token=team.tokens["alice"]) as alice:
        sb = corral.Sandbox.create(memory_mb=256, client=alice)
        try:
            sb.files.write("/workspace/sink.py", SINK.encode())
            _serve(sb, "python3 /workspace/sink.py", 8000)
            url = sb.expose(8000) + "up"
            _post(pid, url, 1)  # warm
            small, large = _post(pid, url, 8), _post(pid, url, 48)
        finally:
            sb.delete()
    assert large < 15 * max(small, 0.03), (small, large)  # 6 linear, 36 squared
