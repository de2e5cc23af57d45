"""An exposed port's WebSocket relay (server/expose.py): the daemon reads the sandbox's
server with a ``websockets`` client and writes each message to the browser side. A
sandbox whose server sends large messages as fast as it can, to a client (the tenant
itself holds the URL) that reads none, must not make the daemon hold them without
bound: the relay reads the sandbox only as fast as the client takes what it sent.
"""

from __future__ import annotations

import base64
import os
import socket
import time

import pytest

import corral
from tests.security.tenants_helpers import team_daemon
from tests.security.test_expose import _serve
from tests.security.test_port_socket import _rss_mb

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


@pytest.fixture(scope="module")
def team():
    with team_daemon() as t:
        yield t


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
            grown, last = 0, -1
            for _ in range(200):  # until the daemon's memory stops growing
                time.sleep(0.25)
                grown = _rss_mb(pid) - before
                if grown == last and grown > 0:
                    break
                last = grown
        finally:
            for s in socks:
                s.close()
            sb.delete()
    # 4 relays: a few of their 8 MiB messages each in flight (~150 MB) is fine; 16
    # queued each (~660 MB before) is not
    assert grown < 320, f"the daemon grew by {grown} MB for 4 unread relays"
