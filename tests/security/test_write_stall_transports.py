"""Clients that stop reading, on the daemon's other transports (server/write_stall.py).

- The Unix socket: the rule was TCP's only, yet a local client that stops reading holds
  the same room in the output budget (all tenants' together) as a TCP one.
- An exposed port's WebSocket (whoever holds the URL, no token): a client that read
  nothing of what the sandbox's server sent kept the relay's message in the tenant's
  output budget, a live stream of the tenant and the sandbox's server, for as long as
  it kept the socket open: uvicorn's keepalive gave up on it but only *closed* the
  transport, and a close waits for a buffer that never drains.

Real daemon, raw sockets; waits are bounded polls (timeouts only stop hangs).
"""

from __future__ import annotations

import base64
import json
import os
import socket
import time

import pytest

from tests.conftest import have_root_runtime
from tests.security.edge_daemon import HANG_GUARD_S, served
from tests.security.test_write_stall import _closed, _held, _wait_for

pytestmark = pytest.mark.skipif(not have_root_runtime(), reason="needs root (a real daemon)")

STALL_S = 4  # the daemon's --write-stall-timeout here
OUTPUT = 6 << 20

# A WebSocket server in the standard library that sends 64 KiB binary messages for as
# long as its client's connection takes them (one connection at a time).
FLOOD = r"""
import base64, hashlib, socket
s = socket.socket(); s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
s.bind(("127.0.0.1", 9001)); s.listen()
frame = bytes([0x82, 127]) + (1 << 16).to_bytes(8, "big") + b"x" * (1 << 16)
while True:
    c, _ = s.accept()
    head = b""
    while b"\r\n\r\n" not in head and (chunk := c.recv(4096)):
        head += chunk
    if b"\r\n\r\n" not in head:
        c.close()
        continue
    key = [l.split(b":", 1)[1].strip() for l in head.split(b"\r\n")
           if l.lower().startswith(b"sec-websocket-key")][0]
    accept = base64.b64encode(hashlib.sha1(key + b"258EAFA5-E914-47DA-95CA-C5AB0DC85B11").digest())
    c.sendall(b"HTTP/1.1 101 Switching Protocols\r\nUpgrade: websocket\r\nConnection: Upgrade\r\n"
              b"Sec-WebSocket-Accept: " + accept + b"\r\n\r\n")
    try:
        while True:
            c.sendall(frame)
    except OSError:
        pass
    c.close()
"""


@pytest.fixture(scope="module")
def daemon():
    with served("--write-stall-timeout", str(STALL_S)) as d:
        with d.client() as admin:
            made = admin.post("/v1/sandboxes", json={"memory_mb": 128})
            assert made.status_code == 201, made.text
            d.sid = made.json()["id"]
        yield d


def test_a_unix_socket_client_that_never_reads_is_cut_off(daemon):
    baseline = _held(daemon)
    body = json.dumps({"cmd": f"head -c {OUTPUT} /dev/zero | tr '\\0' a",
                       "max_output": OUTPUT}).encode()
    s = socket.socket(socket.AF_UNIX)
    s.settimeout(HANG_GUARD_S)
    s.connect(str(daemon.daemon.socket))
    try:
        s.sendall(f"POST /v1/sandboxes/{daemon.sid}/exec HTTP/1.1\r\nHost: x\r\n"
                  f"Content-Type: application/json\r\nContent-Length: {len(body)}\r\n\r\n"
                  .encode() + body)
        _wait_for(lambda: _held(daemon) > baseline + OUTPUT // 2, "the reply never held room")
        _wait_for(lambda: _held(daemon) <= baseline, "the unread reply's room never came back")
        assert _closed(s), "the stalled connection is still open"
    finally:
        s.close()
    assert "closed a connection on the Unix socket" in daemon.log()


def _serve_flood(daemon) -> str:
    with daemon.client() as admin:
        wrote = admin.post(f"/v1/sandboxes/{daemon.sid}/exec", json={"cmd": [
            "python3", "-c", "import sys; open('/workspace/flood.py', 'w').write(sys.argv[1])",
            FLOOD], "timeout": 30})
        assert wrote.status_code == 200 and wrote.json()["returncode"] == 0, wrote.text
        ran = admin.post(f"/v1/sandboxes/{daemon.sid}/exec", json={
            "cmd": "nohup python3 /workspace/flood.py >/dev/null 2>&1 &", "timeout": 30})
        assert ran.status_code == 200, ran.text
        probe = "import socket; socket.create_connection(('127.0.0.1', 9001), timeout=1)"
        deadline = time.monotonic() + HANG_GUARD_S
        while admin.post(f"/v1/sandboxes/{daemon.sid}/exec", json={
                "cmd": ["python3", "-c", probe], "timeout": 30}).json()["returncode"] != 0:
            assert time.monotonic() < deadline, "nothing listens on 9001"
            time.sleep(0.05)
        made = admin.post(f"/v1/sandboxes/{daemon.sid}/ports", json={"port": 9001})
        assert made.status_code in (200, 201), made.text
        return made.json()["url"]


def test_an_exposed_websocket_whose_client_never_reads_is_cut_off(daemon):
    url = _serve_flood(daemon)
    path = "/" + url.split("//")[1].split("/", 1)[1]
    baseline = _held(daemon)
    s = socket.socket()
    s.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
    s.settimeout(HANG_GUARD_S)
    s.connect(("127.0.0.1", daemon.port))
    try:
        key = base64.b64encode(os.urandom(16)).decode()
        s.sendall(f"GET {path} HTTP/1.1\r\nHost: x\r\nUpgrade: websocket\r\n"
                  f"Connection: Upgrade\r\nSec-WebSocket-Key: {key}\r\n"
                  "Sec-WebSocket-Version: 13\r\n\r\n".encode())
        head = b""
        while b"\r\n\r\n" not in head:  # the handshake's answer only: then nothing
            head += s.recv(1)
        assert head.startswith(b"HTTP/1.1 101"), head
        # the relay waits to send a message the client does not take, holding its room
        _wait_for(lambda: _held(daemon) > baseline, "the relay never held room")
        _wait_for(lambda: _held(daemon) <= baseline, "the unread relay's room never came back")
        assert _closed(s), "the stalled WebSocket is still open"
    finally:
        s.close()
    assert "closed a WebSocket from 127.0.0.1" in daemon.log()
