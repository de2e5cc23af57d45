"""Bounds on an exposed port's relays (server/expose.py), the attacks sharing one
daemon (its RSS and CPU are measured, one test at a time; the client's floods, each a
daemon of its own).

1. WebSocket: the daemon reads the sandbox's server with a ``websockets`` client and
   writes each message to the client. A sandbox sending large messages as fast as it
   can, to a client (its tenant holds the URL) reading none, made the daemon hold 16
   per relay (websockets' queue: 659 MB for 4 relays); it reads the sandbox only as
   the client takes, each message held in the tenant's output budget.
2. Request bodies, CPU: the relay gathered a body with ``bytes += chunk`` (quadratic,
   on the event loop, up to ``--max-upload-bytes``, 256 MiB; whoever holds the URL
   needs no token): the daemon's CPU for a 6 times larger body is about 6 times
   more, not 36 (before: 0.06 s for 8 MiB, 2.4 s for 48 MiB).
3. Request bodies, memory: the relay read the whole body into the daemon whether or
   not the sandbox's server took any (3 clients, 96 MiB each: +547 MB); it goes to
   the server as it comes, the client read only as fast as the server takes it.
4. WebSocket, client to sandbox: whoever holds the URL (no token) sent 16 MiB messages
   (uvicorn's ``ws_max_size``) to a sandbox's server that reads none past its
   handshake. The daemon grew ~204 MB for 4 relays (~51 MB each: the message in
   websockets' client transport, masked; another queued in uvicorn's protocol, which
   read the client again as soon as the relay took one; the frame being parsed),
   charged to no budget; 256 relays a tenant (``--max-tenant-streams``): ~13 GB. Now
   the client is read only while the relay waits for a message, the one it relays is
   held in the tenant's output budget (1013 once spent:
   ``test_expose_ws_budget.py``), and goes out in fragments each written once the
   last left: ~24 MB a relay (the message, and what malloc keeps of its parsing).
5. WebSocket, many messages: behind the one a relay holds, uvicorn read on and queued
   all that one read brought (256 KiB: up to 43,690 empty messages, ~8 MB a relay);
   now nothing is read until the relay asks for its next message, and then 4 KiB at
   a time.
6. WebSocket, fragments: uvicorn kept a fragmented message as a list of its
   fragments' bytes: 2 MB sent as 1-byte fragments grew the daemon by 112 MB (and
   empty continuations, which add nothing to the message's size, without end). A
   fragmented message now grows one buffer (server/ws_flow.py).
"""

from __future__ import annotations

import base64
import os
import socket
import struct
import threading
import time

import httpx
import pytest

import corral
from tests.security.tenants_helpers import team_daemon
from tests.security.test_expose import _serve
from tests.security.test_port_socket import _rss_mb


@pytest.fixture(scope="module")
def team():
    with team_daemon() as t:
        yield t


@pytest.fixture
def fresh():
    """A daemon of its own: the memory earlier tests freed (which malloc keeps) would
    take a flood's growth unseen (a full run of this file: 139 MB for 4, before)."""
    with team_daemon() as t:
        yield t


# after the handshake: 8 MiB binary messages, unmasked, forever (the stdlib only)
FLOOD = r"""
import base64, hashlib, socket, struct, threading
s = socket.socket(); s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
s.bind(("127.0.0.1", 9000)); s.listen()
frame = bytes([0x82, 127]) + struct.pack(">Q", 8 << 20) + b"x" * (8 << 20)
def serve(c):
    head = b""
    while b"\r\n\r\n" not in head and (chunk := c.recv(4096)):
        head += chunk
    if b"\r\n\r\n" not in head:
        return c.close()
    key = [l.split(b":", 1)[1].strip() for l in head.split(b"\r\n")
           if l.lower().startswith(b"sec-websocket-key")][0]
    accept = base64.b64encode(hashlib.sha1(key + b"258EAFA5-E914-47DA-95CA-C5AB0DC85B11").digest())
    c.sendall(b"HTTP/1.1 101 Switching Protocols\r\nUpgrade: websocket\r\nConnection: Upgrade\r\n"
              b"Sec-WebSocket-Accept: " + accept + b"\r\n\r\n")
    try:
        while True:
            c.sendall(frame)
    except OSError:
        c.close()
while True:
    threading.Thread(target=serve, args=(s.accept()[0],), daemon=True).start()
"""


def _open(team, url: str) -> socket.socket:
    """A WebSocket to ``url`` that will read nothing past the handshake."""
    s = socket.create_connection(("127.0.0.1", team.port))
    s.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
    key = base64.b64encode(os.urandom(16)).decode()
    path = url.split(str(team.port), 1)[1]
    s.sendall((f"GET {path} HTTP/1.1\r\nHost: x\r\nUpgrade: websocket\r\n"
               f"Connection: Upgrade\r\nSec-WebSocket-Key: {key}\r\n"
               f"Sec-WebSocket-Version: 13\r\n\r\n").encode())
    s.settimeout(60)
    assert s.recv(12) == b"HTTP/1.1 101"
    return s


def _settled_growth(pid: int, before: int, checks: int, *, none: bool = False) -> int:
    """The daemon's growth in MB once it stopped growing (``checks`` x 0.25 s alike;
    ``none``: no growth counts, once what grows it was sent)."""
    grown, last, still = 0, -1, 0
    for _ in range(240):
        time.sleep(0.25)
        grown = _rss_mb(pid) - before
        still = still + 1 if grown == last and (grown > 0 or none) else 0
        if still >= checks:
            break
        last = grown
    return grown


def test_a_sandbox_flooding_an_unread_websocket_is_held_to_a_bounded_copy(team):
    pid = team.daemon.proc.pid
    with corral.Client(team.url, token=team.tokens["alice"]) as alice:
        sb = corral.Sandbox.create(memory_mb=256, client=alice)
        socks = []
        try:
            sb.files.write("/workspace/flood.py", FLOOD.encode())
            _serve(sb, "python3 /workspace/flood.py", 9000)
            url = sb.expose(9000) + "x"
            before = _rss_mb(pid)
            socks = [_open(team, url) for _ in range(4)]
            grown = _settled_growth(pid, before, 8)
        finally:
            for s in socks:
                s.close()
            sb.delete()
    # 4 relays: a few of their 8 MiB messages each in flight (~150 MB) is fine; 16
    # queued each (~660 MB before) is not
    assert grown < 320, f"the daemon grew by {grown} MB for 4 unread relays"


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


# a sandbox's WebSocket server that reads nothing past its handshake (FLOOD's, on 9001)
WS_DEAF = FLOOD.replace("9000", "9001").replace(
    "threading\n", "threading, time\n", 1).replace("c.sendall(frame)", "time.sleep(3600)")
UP_MESSAGE = 16 << 20  # uvicorn's ws_max_size


def deaf_url(sb: corral.Sandbox) -> str:
    """The exposed URL of WS_DEAF, serving in ``sb``."""
    sb.files.write("/workspace/ws_deaf.py", WS_DEAF.encode())
    _serve(sb, "python3 /workspace/ws_deaf.py", 9001)
    return sb.expose(9001) + "x"
# a client's masked binary frame (a zero mask: the payload as it is)
UP_FRAME = bytes([0x82, 0xFF]) + struct.pack(">Q", UP_MESSAGE) + b"\0" * 4 + b"u" * UP_MESSAGE


def test_a_client_flooding_a_deaf_sandbox_server_is_held_to_a_bounded_copy(fresh):
    team = fresh
    pid = team.daemon.proc.pid
    stop = threading.Event()

    def flood(s: socket.socket) -> None:
        try:
            while not stop.is_set():
                s.sendall(UP_FRAME)
        except OSError:
            pass

    with corral.Client(team.url, token=team.tokens["alice"]) as alice:
        sb = corral.Sandbox.create(memory_mb=256, client=alice)
        socks = []
        try:
            url = deaf_url(sb)
            before = _rss_mb(pid)
            socks = [_open(team, url) for _ in range(4)]
            for s in socks:
                threading.Thread(target=flood, args=(s,), daemon=True).start()
            grown = _settled_growth(pid, before, 12)  # (3 s: a loaded CI)
        finally:
            stop.set()
            for s in socks:
                s.close()
            sb.delete()
    # in messages a relay: measured ~1.5 (the message, and what malloc keeps of its
    # parsing), ~3.2 before (another queued in uvicorn, a masked copy, a third begun)
    held = 4 * UP_MESSAGE >> 20
    assert grown < 2.25 * held, f"the daemon grew by {grown} MB for 4 relays to a deaf server"


# one message's fragments: a 1-byte start, then 1-byte continuations (masked, a zero
# mask), never the last
FRAGMENTS = 2_000_000
FIRST_FRAGMENT = bytes([0x02, 0x81]) + b"\0" * 4 + b"u"
MORE_FRAGMENTS = (bytes([0x00, 0x81]) + b"\0" * 4 + b"u") * 100_000


def test_a_message_in_two_million_fragments_is_held_as_its_payload(fresh):
    team = fresh
    pid = team.daemon.proc.pid
    with corral.Client(team.url, token=team.tokens["alice"]) as alice:
        sb = corral.Sandbox.create(memory_mb=256, client=alice)
        s = None
        try:
            url = deaf_url(sb)
            before = _rss_mb(pid)
            s = _open(team, url)
            s.settimeout(600)
            s.sendall(FIRST_FRAGMENT)
            for _ in range(FRAGMENTS // 100_000):
                s.sendall(MORE_FRAGMENTS)
            grown = _settled_growth(pid, before, 12)
        finally:
            if s is not None:
                s.close()
            sb.delete()
    # 2 MB of payload; uvicorn kept each fragment's bytes in a list (~50 bytes a byte)
    assert grown < 40, f"the daemon grew by {grown} MB for 2 MB in 1-byte fragments"


EMPTY_MESSAGES = (bytes([0x82, 0x80]) + b"\0" * 4) * 200_000  # 1.2 MB, masked


def test_small_messages_behind_one_a_deaf_server_holds_are_not_read(fresh):
    team = fresh
    pid = team.daemon.proc.pid
    with corral.Client(team.url, token=team.tokens["alice"]) as alice:
        sb = corral.Sandbox.create(memory_mb=256, client=alice)
        socks = []
        try:
            url = deaf_url(sb)
            socks = [_open(team, url) for _ in range(4)]
            for s in socks:  # the relay's message: it waits, the server reads none
                s.sendall(UP_FRAME)
            before = _rss_mb(pid) + _settled_growth(pid, _rss_mb(pid), 12)
            for s in socks:
                s.settimeout(3)
                try:
                    s.sendall(EMPTY_MESSAGES)
                except TimeoutError:
                    pass  # (the daemon reads no more: the TCP window is full)
            grown = _settled_growth(pid, before, 12, none=True)  # (all it will read)
        finally:
            for s in socks:
                s.close()
            sb.delete()
    # before: 33 MB (uvicorn read on as the relay took its message, and queued all of
    # one read: 43,690 empty messages a relay)
    assert grown < 16, f"the daemon grew by {grown} MB for empty messages behind 4"
