"""Red team of the uvloop daemon loop (``CORRAL_DAEMON_LOOP=uvloop``, server/daemon.py,
issue 30): the door's checks were proven on asyncio's loop; uvloop brings its own
transports (its pause/resume of reading, its write buffer, its timers), so each check
that leans on them is attacked again on a daemon that really runs on uvloop:

- unfinished headers are cut with a typed 408, oversized ones with a 431, garbage gets
  the JSON error shape, and an unauthenticated body is never read (401, closed);
- one address holds few unauthenticated connections, and its in-flight requests are
  capped (429), while the Unix socket is not;
- bearer guesses from one address are refused unchecked after a few;
- a port socket: another tenant opens nothing (as if the sandbox did not exist), a
  tenant holds no more than its live streams, and a client that pings and reads
  nothing does not grow the daemon (server/ws_flow.py pauses uvloop's reading too).
Real daemon on loopback TCP; counts and sizes are asserted, never times.
"""

from __future__ import annotations

import base64
import json
import os
import socket
import time

import httpx
import pytest

import corral
from corral.server.auth_throttle import FREE_FAILURES
from tests.security.edge_daemon import closed_by_daemon, silent, source, still_open
from tests.security.tenants_helpers import UNKNOWN, team_daemon
from tests.security.test_connection_limits import _ask_info
from tests.server.conftest import uds_client

pytest.importorskip("uvloop")
HANG_GUARD_S = 120  # only keeps a broken daemon from hanging the suite
PORT = 8000
ECHO = (
    "import socket, threading\n"
    "s = socket.socket(); s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)\n"
    f"s.bind(('127.0.0.1', {PORT})); s.listen(8)\n"
    "def echo(c):\n"
    "    while d := c.recv(65536):\n"
    "        c.sendall(d)\n"
    "while True:\n"
    "    threading.Thread(target=echo, args=(s.accept()[0],), daemon=True).start()\n"
)


@pytest.fixture(scope="module")
def team():
    before = os.environ.get("CORRAL_DAEMON_LOOP")
    os.environ["CORRAL_DAEMON_LOOP"] = "uvloop"  # the daemon's environment is this one's
    try:
        ctx = team_daemon("--max-client-connections", "8", "--max-client-requests", "2",
                          "--max-tenant-streams", "2", "--max-connections", "40")
        t = ctx.__enter__()
    finally:
        if before is None:
            os.environ.pop("CORRAL_DAEMON_LOOP", None)
        else:
            os.environ["CORRAL_DAEMON_LOOP"] = before
    try:
        maps = open(f"/proc/{t.daemon.proc.pid}/maps").read()
        assert "uvloop" in maps, "the daemon does not run on uvloop"
        yield t
    finally:
        ctx.__exit__(None, None, None)


def _raw(port: int, data: bytes) -> socket.socket:
    sock = socket.create_connection(("127.0.0.1", port), timeout=HANG_GUARD_S)
    sock.sendall(data)
    return sock


def _reply(sock: socket.socket) -> tuple[int, bytes, bytes]:
    """Status, head and body of one reply, read until the daemon closes."""
    data = b""
    while chunk := sock.recv(65536):
        data += chunk
    head, _, body = data.partition(b"\r\n\r\n")
    return int(head.split(b" ", 2)[1]), head.lower(), body


def test_unfinished_oversized_and_garbage_requests_get_typed_errors(team):
    with _raw(team.port, b"GET /v1/health HTTP/1.1\r\nHost: x\r\n") as sock:  # no end
        status, head, body = _reply(sock)
    assert status == 408 and b"content-type: application/json" in head
    assert json.loads(body)["error"]["code"] == "request_timeout"
    junk = b"".join(b"X-Junk-%d: %s\r\n" % (i, b"a" * 1000) for i in range(1000))
    with _raw(team.port, b"GET /v1/health HTTP/1.1\r\nHost: x\r\n" + junk + b"\r\n") as sock:
        status, _, body = _reply(sock)
    assert status == 431 and json.loads(body)["error"]["code"] == "headers_too_large"
    with _raw(team.port, b"NOT HTTP AT ALL\x00\r\n\r\n") as sock:
        status, _, body = _reply(sock)
    assert status == 400 and json.loads(body)["error"]["code"] == "invalid_argument"


def test_an_unauthenticated_body_is_never_read(team):
    sock = _raw(team.port, b"POST /v1/sandboxes HTTP/1.1\r\nHost: x\r\n"
                b"Content-Type: application/json\r\nContent-Length: 10000000\r\n\r\n{")
    with sock:
        first = sock.recv(65536)
        assert first.startswith(b"HTTP/1.1 401") and b"connection: close" in first.lower()
        closed = False
        for _ in range(50):  # bounded: 50 x 0.1 s of trickling
            try:
                sock.sendall(b" ")
                sock.settimeout(0.1)
                if sock.recv(65536) == b"":
                    closed = True
                    break
            except TimeoutError:
                continue
            except OSError:
                closed = True
                break
        assert closed, "the daemon kept reading an unauthenticated body"


def test_one_address_holds_few_connections_and_few_requests(team):
    held = [silent(team.port, source(3)) for _ in range(24)]
    try:
        assert closed_by_daemon(held[:-8], within=HANG_GUARD_S, enough=16) == 16
        assert still_open(held[-8:]) == 8
    finally:
        for s in held:
            s.close()
    token = team.tokens["alice"]
    waiting = [_raw(team.port, b"POST /v1/sandboxes HTTP/1.1\r\nHost: x\r\n"
                    + f"Authorization: Bearer {token}\r\n".encode()
                    + b"Content-Length: 100\r\n\r\n{") for _ in range(2)]
    try:
        with team.tenant("alice") as alice:
            for _ in range(600):  # bounded: until both held requests are counted
                reply = alice.get("/v1/health")
                if reply.status_code == 429:
                    break
                time.sleep(0.1)
        assert reply.status_code == 429, reply.text
        assert reply.json()["error"]["details"] == {"limit": "max_client_requests", "value": 2}
        with uds_client(team.daemon.socket) as local:
            assert local.get("/v1/health").status_code == 200
    finally:
        for s in waiting:
            s.close()


def test_an_authenticated_connection_stays_while_strangers_are_cut(team):
    """Past --max-connections, idle strangers make room for each other, never by
    closing a connection that authenticated."""
    token = team.tokens["alice"]
    kept = socket.create_connection(("127.0.0.1", team.port), timeout=HANG_GUARD_S)
    try:
        assert b" 200 " in _ask_info(kept, token)
        held = [silent(team.port, source(20 + i)) for i in range(60)]
        try:
            assert closed_by_daemon(held, within=HANG_GUARD_S, enough=20) >= 20
            kept.setblocking(True)
            assert b" 200 " in _ask_info(kept, token)
        finally:
            for s in held:
                s.close()
    finally:
        kept.close()


def test_bearer_guesses_from_one_address_are_refused_unchecked(team):
    guesses = 60  # one connection (the address holds at most 8): one after another
    with httpx.Client(base_url=team.url, timeout=HANG_GUARD_S,
                      transport=httpx.HTTPTransport(local_address=source(7))) as guesser:
        statuses = [guesser.get("/v1/info", headers={
            "Authorization": f"Bearer guess-{i:04d}-" + "y" * 40}).status_code
            for i in range(guesses)]
        assert statuses.count(401) <= FREE_FAILURES + 10, statuses
        assert statuses.count(429) >= guesses - FREE_FAILURES - 10, statuses
        right = guesser.get("/v1/info", headers={  # refused before the check
            "Authorization": f"Bearer {team.tokens['alice']}"})
        assert right.status_code == 429, right.text


# ------------------------------------------------------------------- port sockets


def start_echo(sb: corral.Sandbox) -> corral.Process:
    """The line echo server on :data:`PORT` of ``sb``, once it listens."""
    proc = sb.spawn(["python3", "-c", ECHO])
    deadline = time.monotonic() + 60
    while sb.exec(["sh", "-c", f"grep -q ':{PORT:04X} ' /proc/net/tcp"]).returncode:
        assert time.monotonic() < deadline, "the echo server did not listen"
        time.sleep(0.1)
    return proc


@pytest.fixture(scope="module")
def echo(team):
    with corral.Client(team.url, token=team.tokens["alice"]) as client:
        sb = corral.Sandbox.create(memory_mb=64, client=client)
        proc = start_echo(sb)
        yield sb.id
        proc.close()
        sb.delete()


def _upgrade(team, token: str | None, sandbox_id: str) -> socket.socket:
    """A raw WebSocket handshake to the port socket; the socket, past the reply's head
    (which is checked: 101 or a refusal's status)."""
    key = base64.b64encode(os.urandom(16)).decode()
    auth = f"Authorization: Bearer {token}\r\n" if token else ""
    s = socket.create_connection(("127.0.0.1", team.port), timeout=HANG_GUARD_S)
    s.sendall((f"GET /v1/sandboxes/{sandbox_id}/ports/{PORT}/socket HTTP/1.1\r\n"
               f"Host: x\r\nUpgrade: websocket\r\nConnection: Upgrade\r\n"
               f"Sec-WebSocket-Key: {key}\r\nSec-WebSocket-Version: 13\r\n{auth}\r\n").encode())
    return s


def _status(s: socket.socket) -> int:
    head = b""
    while b"\r\n\r\n" not in head and (chunk := s.recv(1)):
        head += chunk
    return int(head.split(b" ", 2)[1]) if head else 0


def test_another_tenant_reaches_no_port_socket(team, echo):
    with _upgrade(team, team.tokens["bob"], UNKNOWN) as s:
        unknown = _status(s)
    with _upgrade(team, team.tokens["bob"], echo) as s:
        assert _status(s) == unknown != 101  # as if it did not exist
    with _upgrade(team, None, echo) as s:
        assert _status(s) in (401, 403)
    with _upgrade(team, team.tokens["alice"], echo) as s:  # the control
        assert _status(s) == 101
        s.sendall(bytes([0x82, 0x80 | 3]) + b"\0\0\0\0" + b"hi\n")
        assert s.recv(16)[2:] == b"hi\n"


def test_a_tenant_holds_no_more_port_sockets_than_its_streams(team, echo):
    token = team.tokens["alice"]
    held = []
    try:
        for _ in range(2):
            held.append(_upgrade(team, token, echo))
            assert _status(held[-1]) == 101
        with _upgrade(team, token, echo) as third:
            assert _status(third) == 403  # over --max-tenant-streams 2
    finally:
        for s in held:
            s.close()


def _rss_mb(pid: int) -> int:
    for line in open(f"/proc/{pid}/status"):
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) >> 10
    raise AssertionError("no VmRSS")


def test_pings_never_read_do_not_grow_the_daemon(team, echo):
    pid = team.daemon.proc.pid
    deadline = time.monotonic() + 60
    while True:  # the streams of the test before are given back once their closes are seen
        s = _upgrade(team, team.tokens["alice"], echo)
        s.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
        if _status(s) == 101:
            break
        s.close()
        assert time.monotonic() < deadline
        time.sleep(0.1)
    try:
        before = _rss_mb(pid)
        ping = bytes([0x89, 0x80 | 125]) + b"\0\0\0\0" + b"p" * 125
        batch, sent = ping * 8192, 0
        s.settimeout(3)  # the daemon stops reading: the send blocks, then times out
        try:
            while sent < 192 << 20:
                s.sendall(batch)
                sent += len(batch)
        except TimeoutError:
            pass
        grown = _rss_mb(pid) - before
        print(f"uvloop: {sent >> 20} MB of pings sent, daemon +{grown} MB")
        assert grown < 64, f"the daemon grew by {grown} MB for {sent >> 20} MB of pings"
    finally:
        s.close()
