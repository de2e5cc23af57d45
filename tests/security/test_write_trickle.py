"""A client that reads its reply a trickle at a time is cut off like one that reads none.

Before, any byte read restarted ``--write-stall-timeout``'s wait: a client that took
~1.5 KB a minute kept a large reply, and its room in the tenant's output budget, open
for ever. Now a connection paused for writing must drain ``--write-min-rate`` bytes a
second on average over each window (:class:`corral.server.limits.BoundedHttpProtocol`).
Here the daemon's minimum is raised so the window is short; the trickler reads far
below it, the slow reader far above (it catches up after a starved turn, as a real
client's socket would), so neither depends on how loaded the host is. Real daemon, raw
sockets on loopback.
"""

from __future__ import annotations

import json
import re
import time

import pytest

from tests.conftest import have_root_runtime
from tests.security.edge_daemon import HANG_GUARD_S, served
from tests.security.test_write_stall import _ask_big_reply, _held, _length, _wait_for

pytestmark = pytest.mark.skipif(not have_root_runtime(), reason="needs root (a real daemon)")

STALL_S = 8  # the daemon's --write-stall-timeout here
MIN_RATE = 128 << 10  # its --write-min-rate: 1 MiB a window
TRICKLE = 4096  # bytes the trickler reads at a time, at most ...
TRICKLE_PACE_S = 0.25  # ... this often: <= 16 KiB/s, an eighth of the minimum
SLOW_RATE = 1 << 20  # the slow reader's pace: eight times the minimum
MSS = 1460  # an Ethernet network's segments: the daemon's kernel buffers stay small
OUTPUT = 6 << 20
SLOW_OUTPUT = 4 << 20


@pytest.fixture(scope="module")
def daemon():
    with served("--write-stall-timeout", str(STALL_S), "--write-min-rate", str(MIN_RATE)) as d:
        with d.client() as admin:
            made = admin.post("/v1/sandboxes", json={"memory_mb": 128})
            assert made.status_code == 201, made.text
            d.sid = made.json()["id"]
        yield d


def test_a_client_that_reads_a_trickle_is_cut_off_and_what_it_held_goes_back(daemon):
    baseline = _held(daemon)
    trickler = _ask_big_reply(daemon, OUTPUT, rcvbuf=4096, mss=MSS)
    got = 0
    try:
        _wait_for(lambda: _held(daemon) > baseline + OUTPUT // 2, "the reply never held room")
        deadline = time.monotonic() + HANG_GUARD_S
        while True:  # read a trickle until the daemon cuts the connection
            assert time.monotonic() < deadline, f"still open after {got} bytes read"
            try:
                chunk = trickler.recv(TRICKLE)
            except OSError:
                break  # reset
            if not chunk:
                break
            got += len(chunk)
            time.sleep(TRICKLE_PACE_S)
        assert got < OUTPUT, "the trickler got its whole reply"
        _wait_for(lambda: _held(daemon) <= baseline, "the trickled reply's room never came back")
    finally:
        trickler.close()
    read = [int(n) for n in re.findall(r"its client read (\d+) bytes of its reply", daemon.log())]
    assert any(0 < n < MIN_RATE * STALL_S for n in read), read  # cut for its rate


def test_a_slow_but_real_reader_gets_its_whole_reply(daemon):
    reader = _ask_big_reply(daemon, SLOW_OUTPUT, rcvbuf=1 << 20, mss=MSS)
    got = bytearray()
    start = time.monotonic()
    try:
        while not (b"\r\n\r\n" in got and len(got) >= _length(got)):
            # at most SLOW_RATE on average since the start: after a turn the host did not
            # give it, it reads what its socket holds at once (as a real client would)
            due = SLOW_RATE * (time.monotonic() - start) - len(got)
            if due < 16 << 10:
                time.sleep(0.02)
                continue
            chunk = reader.recv(int(due))
            assert chunk, f"cut off after {len(got)} bytes though it kept reading"
            got += chunk
    finally:
        reader.close()
    head, _, body = bytes(got).partition(b"\r\n\r\n")
    assert head.startswith(b"HTTP/1.1 200"), head[:200]
    assert json.loads(body)["stdout"] == "a" * SLOW_OUTPUT
