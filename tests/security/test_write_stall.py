"""A TCP client that asks for a large reply and never reads it is cut off.

Before, such a client held the reply's output-budget room, the daemon's buffers and its
connection for as long as it kept the socket open (the reply waited in uvicorn's
``drain`` forever). Now a connection whose transport stays paused for writing with
none of its reply read for ``--write-stall-timeout`` seconds is aborted
(:class:`corral.server.limits.BoundedHttpProtocol`): what it held goes back, others are
not affected, and a client that reads slowly but steadily gets its whole reply. Real
daemon, raw sockets on loopback; waits are bounded polls (timeouts only stop hangs).
"""

from __future__ import annotations

import json
import re
import socket
import time

import pytest

from tests.conftest import have_root_runtime
from tests.security.edge_daemon import HANG_GUARD_S, TOKEN, served

pytestmark = pytest.mark.skipif(not have_root_runtime(), reason="needs root (a real daemon)")

STALL_S = 4  # (a loaded host may starve the slow reader for a while) the daemon's --write-stall-timeout here
OUTPUT = 6 << 20  # bytes of stdout the stalled reply carries (its JSON: a little more)
SLOW_OUTPUT = 2 << 20  # ... and the slow reader's


@pytest.fixture(scope="module")
def daemon():
    with served("--write-stall-timeout", str(STALL_S)) as d:
        with d.client() as admin:
            made = admin.post("/v1/sandboxes", json={"memory_mb": 128})
            assert made.status_code == 201, made.text
            d.sid = made.json()["id"]
        yield d


def _held(daemon) -> int:
    with daemon.client() as admin:
        text = admin.get("/metrics").text
    return int(float(re.search(r"^corral_output_held_bytes (\S+)$", text, re.M)[1]))


def _ask_big_reply(daemon, output: int, rcvbuf: int, verb: str = "exec",
                   mss: int | None = None) -> socket.socket:
    """A raw connection that asks for a command's ``output`` bytes of stdout in one reply
    (``exec/stream``: as a stream), with a small receive buffer: the daemon's writes
    pause soon. ``mss``: the segment size it offers (an Ethernet network's 1460 keeps
    the daemon's kernel buffers as small as there; loopback's 65483 makes them MBs)."""
    body = json.dumps({"cmd": f"head -c {output} /dev/zero | tr '\\0' a",
                       "max_output": output}).encode()
    s = socket.socket()
    s.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, rcvbuf)
    if mss is not None:
        s.setsockopt(socket.IPPROTO_TCP, socket.TCP_MAXSEG, mss)
    s.settimeout(HANG_GUARD_S)
    s.connect(("127.0.0.1", daemon.port))
    s.sendall(f"POST /v1/sandboxes/{daemon.sid}/{verb} HTTP/1.1\r\nHost: x\r\n"
              f"Authorization: Bearer {TOKEN}\r\nContent-Type: application/json\r\n"
              f"Content-Length: {len(body)}\r\n\r\n".encode() + body)
    return s


def _wait_for(predicate, what: str) -> None:
    deadline = time.monotonic() + HANG_GUARD_S
    while not predicate():
        assert time.monotonic() < deadline, what
        time.sleep(0.1)


def _closed(s: socket.socket) -> bool:
    """Whether the daemon closed ``s`` (what it had sent is drained, a little at a time)."""
    s.setblocking(False)
    try:
        while chunk := s.recv(1 << 20):
            del chunk
        return True  # EOF
    except BlockingIOError:
        return False
    except OSError:
        return True  # reset (an abort)


def test_a_client_that_never_reads_is_cut_off_and_what_it_held_goes_back(daemon):
    baseline = _held(daemon)
    stalled = _ask_big_reply(daemon, OUTPUT, rcvbuf=4096)
    try:
        # the reply is built and waits, holding its room in the output budget
        _wait_for(lambda: _held(daemon) > baseline + OUTPUT // 2, "the reply never held room")
        # meanwhile another client is served as usual
        with daemon.client() as admin:
            ran = admin.post(f"/v1/sandboxes/{daemon.sid}/exec", json={"cmd": "echo ok"})
            assert ran.status_code == 200 and ran.json()["stdout"] == "ok\n", ran.text
        # after the write-stall timeout the connection is aborted: read nothing until
        # then (the poll below reads, so it only looks once the room has gone back)
        _wait_for(lambda: _held(daemon) <= baseline, "the stalled reply's room never came back")
        assert _closed(stalled), "the stalled connection is still open"
    finally:
        stalled.close()
    log = daemon.log()
    assert "of its reply in" in log and "--write-stall-timeout" in log


def test_a_stream_nobody_reads_is_cut_off_too(daemon):
    baseline = _held(daemon)
    stalled = _ask_big_reply(daemon, 64 << 20, rcvbuf=4096, verb="exec/stream")
    try:
        _wait_for(lambda: _held(daemon) > baseline, "the stream never held room")
        _wait_for(lambda: _held(daemon) <= baseline, "the unread stream's room never came back")
        assert _closed(stalled), "the stalled stream is still open"
    finally:
        stalled.close()


def test_a_slow_reader_that_keeps_reading_gets_its_whole_reply(daemon):
    reader = _ask_big_reply(daemon, SLOW_OUTPUT, rcvbuf=64 << 10)
    got = bytearray()
    try:
        reader.settimeout(HANG_GUARD_S)
        pace = STALL_S / 16  # far more often than the timeout, far slower than it could
        while not (b"\r\n\r\n" in got and len(got) >= _length(got)):
            chunk = reader.recv(256 << 10)
            assert chunk, f"cut off after {len(got)} bytes though it kept reading"
            got += chunk
            time.sleep(pace)
    finally:
        reader.close()
    head, _, body = bytes(got).partition(b"\r\n\r\n")
    assert head.startswith(b"HTTP/1.1 200"), head[:200]
    assert json.loads(body)["stdout"] == "a" * SLOW_OUTPUT


def _length(got: bytearray) -> int:
    head = bytes(got).partition(b"\r\n\r\n")[0]
    m = re.search(rb"(?im)^content-length:\s*(\d+)", head)
    assert m, head[:300]
    return len(head) + 4 + int(m[1])
