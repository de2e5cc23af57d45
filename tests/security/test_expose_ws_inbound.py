"""A client's messages to an exposed port's WebSocket server (server/expose.py,
server/ws_flow.py): held in the output budget of the sandbox's tenant, and relayed
whole whatever their shape.

Whoever holds an exposed port's URL (no token) sent 16 MiB messages to a sandbox's
server that reads none: the daemon held them outside any budget (and read the next
while it held one). Now, with room for two such messages in the tenant's budget
(``--tenant-output-memory-mb 40``): two relays each hold the one they were sent (the
daemon's gauge says so), a third is closed with 1013 (try again later) and a reason
that says its message was not relayed, and once the clients have gone, every byte
comes back, though the sandbox's server still reads nothing (the relays learn that
their clients left: the daemon's keepalive ping gets no pong).

The client is now read a piece at a time, only while the relay waits for a message;
a large message goes to the sandbox in fragments; a fragmented one is joined in one
buffer: empty, small, large, text, client-fragmented and back-to-back messages all
reach the sandbox's server whole and in order.
"""

from __future__ import annotations

import hashlib
import os
import struct
import threading
import time

import pytest

import corral
from tests.security.tenants_helpers import no_traceback, team_daemon
from tests.security.test_expose import _serve
from tests.security.test_expose_relay_bounds import (
    FLOOD,
    UP_FRAME,
    UP_MESSAGE,
    _open,
    deaf_url,
)

PATIENCE_S = 240  # a loaded host (uvicorn's keepalive: a ping each 20 s, 20 s for a pong)


@pytest.fixture(scope="module")
def team():
    with team_daemon("--tenant-output-memory-mb", "40") as t:
        yield t


def _held(team) -> int:
    with team.admin() as admin:
        text = admin.get("/metrics").text
    line = next(ln for ln in text.splitlines() if ln.startswith("corral_output_held_bytes "))
    return int(float(line.split()[1]))


def _until(team, ok, what: str) -> None:
    deadline = time.monotonic() + PATIENCE_S
    while not ok(held := _held(team)):
        assert time.monotonic() < deadline, f"{what}: {held} bytes held"
        time.sleep(0.1)


def _send(s) -> threading.Thread:
    def send() -> None:
        try:
            s.sendall(UP_FRAME)
        except OSError:
            pass  # (refused: the daemon closed it)

    thread = threading.Thread(target=send, daemon=True)
    thread.start()
    return thread


def _close_frame(s) -> tuple[int, bytes]:
    """The code and reason of the close frame the daemon sent first (past the rest of
    the handshake's reply)."""
    s.settimeout(PATIENCE_S)
    data = b""
    while b"\r\n\r\n" not in data or len(data.split(b"\r\n\r\n", 1)[1]) < 2:
        data += s.recv(4096) or pytest.fail(f"no close frame: {data!r}")
    frame = data.split(b"\r\n\r\n", 1)[1]
    assert frame[0] == 0x88 and frame[1] < 126, frame  # a close frame, short
    while len(frame) < 2 + frame[1]:
        frame += s.recv(4096) or pytest.fail(f"a short close frame: {frame!r}")
    return struct.unpack(">H", frame[2:4])[0], frame[4:2 + frame[1]]


def spend_and_refuse(team, open_one) -> None:
    """Two WebSockets (``open_one()``, raw, to a server that reads nothing) are each
    sent a 16 MiB message: both held in the tenant's budget (40 MiB); a third is closed
    with 1013 and the relay's reason; once the clients have gone, all comes back."""
    socks, threads = [], []
    try:
        for n in (1, 2):
            socks.append(open_one())
            threads.append(_send(socks[-1]))
            _until(team, lambda held, n=n: held >= n * UP_MESSAGE - (1 << 16),
                   f"relay {n}'s message is not held in the budget")
        socks.append(open_one())
        threads.append(_send(socks[-1]))
        code, reason = _close_frame(socks[-1])
        assert code == 1013 and b"output budget spent" in reason, (code, reason)
        assert b"not relayed" in reason, reason
        assert _held(team) <= 40 << 20
    finally:
        for s in socks:
            s.close()
        for t in threads:
            t.join(timeout=60)
    # the sandbox's server still reads nothing: the relays end as their clients left
    _until(team, lambda held: held == 0, "the relays' holds were not given back")


def test_a_client_flooding_a_deaf_server_spends_the_tenant_budget_and_gets_1013(team):
    with corral.Client(team.url, token=team.tokens["alice"]) as alice:
        sb = corral.Sandbox.create(memory_mb=256, client=alice)
        url = deaf_url(sb)
        spend_and_refuse(team, lambda: _open(team, url))
        sb.delete()
    no_traceback(team)


# a WebSocket server (the standard library) that answers each message, however it was
# fragmented, with its opcode, length and digest
WS_DIGEST = r"""
def exact(c, n):
    buf = bytearray()
    while len(buf) < n:
        chunk = c.recv(min(n - len(buf), 1 << 20))
        if not chunk:
            raise EOFError
        buf += chunk
    return bytes(buf)
def unmask(data, mask):
    key = (mask * (len(data) // 4 + 1))[:len(data)]
    return (int.from_bytes(data, "big") ^ int.from_bytes(key, "big")).to_bytes(len(data), "big")
""" + FLOOD[:FLOOD.index("    try:")].replace("9000", "9002") + r"""
    kind, parts = 0, []
    try:
        while True:
            h = exact(c, 2)
            n = h[1] & 0x7F
            if n == 126:
                n = int.from_bytes(exact(c, 2), "big")
            elif n == 127:
                n = int.from_bytes(exact(c, 8), "big")
            mask = exact(c, 4)
            data = unmask(exact(c, n), mask)
            op = h[0] & 0x0F
            if op == 8:
                break
            if op in (1, 2):
                kind, parts = op, []
            if op in (0, 1, 2):
                parts.append(data)
            if op in (0, 1, 2) and h[0] & 0x80:
                whole = b"".join(parts)
                reply = ("%d %d %s" % (kind, len(whole), hashlib.sha256(whole).hexdigest()[:16])).encode()
                c.sendall(bytes([0x81, len(reply)]) + reply)
    except (EOFError, OSError):
        pass
    c.close()
while True:
    threading.Thread(target=serve, args=(s.accept()[0],), daemon=True).start()
"""


def _said(message) -> str:
    data = message.encode() if isinstance(message, str) else b"".join(message) \
        if isinstance(message, list) else message
    kind = 1 if isinstance(message, str) else 2
    return f"{kind} {len(data)} {hashlib.sha256(data).hexdigest()[:16]}"


def test_messages_of_every_shape_reach_the_sandbox_whole_and_in_order(team):
    from websockets.sync.client import connect

    big, text = os.urandom(3 << 20), "é€ ascii " * 40_000
    shapes = [b"", b"x", "hi", big, text, [b"ab", b"", b"cd" * 70_000], b"after"]
    with corral.Client(team.url, token=team.tokens["alice"]) as alice:
        sb = corral.Sandbox.create(memory_mb=256, client=alice)
        try:
            sb.files.write("/workspace/ws_digest.py", WS_DIGEST.encode())
            _serve(sb, "python3 /workspace/ws_digest.py", 9002)
            url = sb.expose(9002).replace("http://", "ws://") + "x"
            with connect(url, open_timeout=60, max_size=None) as ws:
                for message in shapes:
                    ws.send(message)
                    assert ws.recv(timeout=PATIENCE_S) == _said(message)
                many = [f"m{i}" for i in range(2000)] + [b"\0" * 5000] * 50
                for message in many:  # back to back: many in one read of the daemon's
                    ws.send(message)
                for message in many:
                    assert ws.recv(timeout=PATIENCE_S) == _said(message)
        finally:
            sb.delete()
        _until(team, lambda held: held == 0, "the relay's hold was not given back")
    no_traceback(team)
