"""An exposed port's HTTP relay read the whole request body into the daemon before it
relayed it (up to ``--max-upload-bytes``, 256 MiB by default, per request; a tenant's
relays at once: ``--max-tenant-streams``, 256), whether or not the sandbox's server
took any of it: a few clients holding a port's URL (no token needed) made the daemon
hold hundreds of MiB. The body now goes to the sandbox's server as it comes: the daemon
reads the client only as fast as the server takes it.
"""

from __future__ import annotations

import socket
import time

import pytest

import corral
from tests.security.tenants_helpers import team_daemon
from tests.security.test_expose import _serve
from tests.security.test_port_socket import _rss_mb

# accepts connections and reads nothing
DEAF = r"""
import socket, time
s = socket.socket(); s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
s.bind(("127.0.0.1", 8000)); s.listen(64)
held = []
while True:
    held.append(s.accept()[0])
"""
BODY_MB = 96


@pytest.fixture(scope="module")
def team():
    with team_daemon() as t:
        yield t


def _push(team, path: str) -> tuple[socket.socket, int]:
    """A POST of BODY_MB MiB to ``path``, sent until the daemon stops taking it."""
    s = socket.create_connection(("127.0.0.1", team.port))
    s.sendall((f"POST {path} HTTP/1.1\r\nHost: x\r\nContent-Length: {BODY_MB << 20}\r\n"
               "\r\n").encode())
    s.settimeout(3)
    piece, sent = b"x" * (1 << 20), 0
    try:
        while sent < BODY_MB << 20:
            s.sendall(piece)
            sent += len(piece)
    except TimeoutError:
        pass
    return s, sent


def test_a_relayed_body_is_held_only_as_the_sandbox_takes_it(team):
    pid = team.daemon.proc.pid
    with corral.Client(team.url, token=team.tokens["alice"]) as alice:
        sb = corral.Sandbox.create(memory_mb=128, client=alice)
        socks = []
        try:
            sb.files.write("/workspace/deaf.py", DEAF.encode())
            _serve(sb, "python3 /workspace/deaf.py", 8000)
            path = "/expose/" + sb.expose(8000).split("/expose/", 1)[1] + "up"
            before = _rss_mb(pid)
            pushed = [_push(team, path) for _ in range(3)]
            socks = [s for s, _ in pushed]
            time.sleep(0.5)
            grown = _rss_mb(pid) - before
        finally:
            for s in socks:
                s.close()
            sb.delete()
    sent = sum(n for _, n in pushed) >> 20
    # before: the daemon took (and held) all 3 x 96 MiB
    assert grown < 64 and sent < 3 * BODY_MB, f"the daemon grew by {grown} MB, took {sent} MiB"


# answers with the raw request it read (head and chunked body) once the last chunk came
ECHO_RAW = r"""
import socket
s = socket.socket(); s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
s.bind(("127.0.0.1", 8001)); s.listen(8)
while True:
    c, _ = s.accept()
    data = b""
    while not (data.endswith(b"\r\n0\r\n\r\n") or data.endswith(b"\r\n\r\nabc")):
        chunk = c.recv(65536)
        if not chunk:
            break
        data += chunk
    c.sendall(b"HTTP/1.1 200 OK\r\nContent-Length: %d\r\n\r\n" % len(data) + data)
    c.close()
"""


def test_chunked_and_sized_bodies_arrive_whole_and_too_large_ones_are_refused(team):
    import httpx

    with corral.Client(team.url, token=team.tokens["alice"]) as alice:
        sb = corral.Sandbox.create(memory_mb=128, client=alice)
        try:
            sb.files.write("/workspace/echo.py", ECHO_RAW.encode())
            _serve(sb, "python3 /workspace/echo.py", 8001)
            url = sb.expose(8001) + "in"
            chunked = httpx.post(url, content=iter([b"ab", b"cd" * 1000]), timeout=60)
            sized = httpx.post(url, content=b"abc", timeout=60)
            path = "/expose/" + url.split("/expose/", 1)[1]
            with socket.create_connection(("127.0.0.1", team.port), timeout=60) as raw:
                raw.sendall(f"POST {path} HTTP/1.1\r\nHost: x\r\nContent-Length: "
                            f"{1 << 40}\r\n\r\nx".encode())
                big = raw.recv(12)
        finally:
            sb.delete()
    head, _, body = chunked.content.partition(b"\r\n\r\n")
    assert b"transfer-encoding: chunked" in head.lower() and body.endswith(b"\r\n0\r\n\r\n")
    assert b"ab" in body and b"cd" * 1000 in body.replace(b"\r\n", b"")
    assert sized.content.lower().split(b"\r\n\r\n")[1] == b"abc"
    assert b"content-length: 3" in sized.content.lower()
    assert big == b"HTTP/1.1 413", big  # refused by its length, before a byte is relayed
