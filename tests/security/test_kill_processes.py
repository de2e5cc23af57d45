"""``Sandbox.kill_processes``: everything the sandbox's code started dies, from outside,
even processes that fork as fast as they can; the sandbox and its files stay."""

from __future__ import annotations

import asyncio

import pytest

import corral
from corral.errors import InvalidState
from tests.conftest import requires_root

pytestmark = requires_root

COUNT = "n=0; for p in /proc/[0-9]*; do n=$((n+1)); done; echo $n"


def test_kill_processes_sweeps_background_and_forking_processes(daemon):
    with corral.Client(daemon.url) as client, corral.Sandbox.create(
        client=client, memory_mb=256, pids=64
    ) as sb:
        sb.files.write("/workspace/keep.txt", b"still here")
        sb.exec("nohup sleep 300 >/dev/null 2>&1 &")
        # A process that keeps forking children that keep forking (bounded by pids=64).
        sb.exec("nohup sh -c 'while true; do (sleep 100 &) ; done' >/dev/null 2>&1 &")
        spawned = sb.spawn(["sleep", "300"])
        before = int(sb.exec(COUNT).stdout)
        assert before >= 5  # agent, sleeper, forker and its children, spawned, this shell
        killed = sb.kill_processes()
        assert killed >= 4
        assert spawned.wait().returncode == -9
        # Only the agent and the counting shell itself are left.
        assert int(sb.exec(COUNT).stdout) == 2
        assert sb.files.read("/workspace/keep.txt") == b"still here"
        assert sb.refresh().state.value == "running"
        assert sb.exec(["echo", "ok"]).stdout == "ok\n"
        assert sb.kill_processes() == 0  # nothing left to kill


def test_kill_processes_needs_a_running_sandbox(daemon):
    with corral.Client(daemon.url) as client, corral.Sandbox.create(client=client) as sb:
        sb.pause()
        with pytest.raises(InvalidState, match="resume it first"):
            sb.kill_processes()
        sb.resume()
        assert sb.kill_processes() == 0


async def test_a_freeze_that_times_out_never_leaves_the_sandbox_frozen(engine, monkeypatch):
    # Red team: the sweep thawed only after a successful freeze; a freeze that timed out
    # (a task stuck in D state) left the agent frozen, and then no timeout ever fired.
    from corral.runtime.cgroups import CgroupError

    info = await engine.create()
    try:
        group = engine.cgroup(info.id)
        real_freeze = type(group).freeze

        def freeze_then_time_out(self, timeout: float = 5.0) -> None:
            real_freeze(self, timeout)
            raise CgroupError("did not freeze in time (simulated)")

        monkeypatch.setattr(type(group), "freeze", freeze_then_time_out)
        await engine.exec(info.id, "sleep 100 > /dev/null 2>&1 &")
        assert await engine.kill_processes(info.id) >= 1
        assert not group.frozen()
        r = await engine.exec(info.id, ["echo", "ok"], timeout=10)
        assert r.stdout == b"ok\n"
    finally:
        await engine.delete(info.id)


async def test_unread_output_written_a_byte_at_a_time_stays_compact(engine):
    # Red team: 12 MB written one byte at a time and never read cost the daemon ~5x that,
    # one event object per frame (and readline() a scan over all of them).
    info = await engine.create()
    try:
        code = "import os\nfor _ in range(300_000):\n    os.write(1, b'x')\n"
        proc = await engine.spawn(info.id, ["python3", "-c", code])
        for _ in range(1200):  # until it exits (at most 60 s), its output left unread
            if proc.info()["state"] == "exited":
                break
            await asyncio.sleep(0.05)
        assert proc.unread_bytes == 300_000  # nothing lost
        assert len(proc._events) <= 300_000 // (64 << 10) + 2  # in 64 KiB chunks
        assert await proc.readline() == b"x" * 300_000
    finally:
        await engine.delete(info.id)
