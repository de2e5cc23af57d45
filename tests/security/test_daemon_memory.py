"""Output nobody reads cannot keep the daemon's memory after its sandboxes are gone.

The attack (red-team pass of issue 24): 12 spawned processes that print and are never
read took the daemon from 65 to 277 MB (16 MiB of unread output kept per process, as
documented), and deleting the sandboxes gave none of it back: the buffers were freed
inside the daemon, but glibc keeps freed heap memory in the process. A release now
drops the output nobody can read any more and gives the memory back to the system.

Measured as a ratio of the daemon's own resident memory (VmRSS): what the attack added,
and how much of it is left after the deletes. Real daemon, real SDK, real sandboxes.
"""

from __future__ import annotations

import time
from pathlib import Path

import pytest

import corral
from tests.conftest import requires_root

pytestmark = [requires_root, pytest.mark.root]

N = 12
BUFFER = 16 << 20  # the daemon's default max_buffer per stream
PRINTER = ["python3", "-c", "import sys\nb = b'x' * 65536\nwhile True: sys.stdout.buffer.write(b)"]
PATIENCE_S = 600  # a bound on the waits below, never a measure


def rss_mb(pid: int) -> float:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    raise AssertionError("no VmRSS")


def attack(client: corral.Client, n: int, pid: int) -> float:
    """n sandboxes, each with a process whose output fills its buffer unread; the
    daemon's RSS at that point. The sandboxes are deleted before returning."""
    sandboxes = [corral.Sandbox.create(client=client) for _ in range(n)]
    try:
        procs = [sb.spawn(PRINTER) for sb in sandboxes]
        deadline = time.monotonic() + PATIENCE_S
        for proc in procs:
            while proc.refresh()["unread_bytes"] < BUFFER:
                assert time.monotonic() < deadline, proc.refresh()
                time.sleep(0.1)
        return rss_mb(pid)
    finally:
        for sb in sandboxes:
            sb.delete()


def settled(pid: int, below: float) -> float:
    """The daemon's RSS once it is under ``below`` MB (or the patience ran out)."""
    deadline = time.monotonic() + PATIENCE_S
    while (now := rss_mb(pid)) > below and time.monotonic() < deadline:
        time.sleep(0.2)
    return now


def test_unread_output_of_deleted_sandboxes_returns_to_the_system(make_daemon):
    daemon = make_daemon()
    pid = daemon.proc.pid
    with corral.Client(daemon.url) as client:
        attack(client, 1, pid)  # warm-up: imports, slots, code paths the daemon keeps
        base = rss_mb(pid)
        peak = attack(client, N, pid)
        grown = peak - base
        # the attack worked: the unread output was held (by design, up to the cap)
        assert grown >= 0.75 * N * BUFFER / (1 << 20), (base, peak)
        after = settled(pid, base + 0.1 * grown)
        # and it came back: at most a tenth of what it added is left
        assert after - base <= 0.1 * grown, (base, peak, after)
        # twice more: nothing creeps up round after round
        for _ in range(2):
            attack(client, N, pid)
            again = settled(pid, base + 0.1 * grown)
            assert again - base <= 0.1 * grown, (base, peak, again)
