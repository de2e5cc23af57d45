"""Lifecycle, listing, bad input and crash safety of the engine."""

from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import sys
import textwrap
import threading
import time
from pathlib import Path

import pytest

from corral.errors import (
    ImageNotFound,
    InvalidArgument,
    InvalidState,
    NetworkNotFound,
    SandboxNotFound,
)
from corral.runtime import syscalls, uids
from corral.schema import SandboxState
from tests.conftest import requires_root

pytestmark = [requires_root, pytest.mark.root]


def leftovers(engine) -> dict:
    """Everything of the engine's that exists on the host besides its registry."""
    groups = engine.cgroups.children(engine.cgroup_parent)
    slots = [g for g in groups if g.startswith("slot-")]  # warm launchers, by design
    assert len(slots) <= engine._pool.target + 1, f"warm slots pile up: {slots}"
    return {
        "mounts": syscalls.mounts_under(str(engine.layout.sandboxes_dir)),
        "cgroups": [g for g in groups if g not in slots],
        "dirs": sorted(p.name for p in engine.layout.sandboxes_dir.iterdir()),
    }


async def wait_state(engine, sid, state, limit=15.0):
    deadline = time.monotonic() + limit
    while time.monotonic() < deadline:
        info = engine.get(sid)
        if info.state == state:
            return info
        await asyncio.sleep(0.1)
    raise AssertionError(f"{sid} stayed {engine.get(sid).state}, expected {state}")


async def test_a_delete_that_does_not_wait_has_ended_every_process(state_dir, monkeypatch):
    """``delete(wait=False)`` (the daemon's): when it returns the sandbox is gone and
    none of its processes runs, while its directories are still being removed (held
    here); closing the engine waits for that, and nothing is left behind. bwrap's
    outer process (the engine's, in the sandbox's cgroup: it reaps the agent and
    unmounts the sandbox's tree) may still be exiting then; it is gone after the close."""
    from corral.runtime import rootfs
    from corral.runtime.engine import Engine

    gate = threading.Event()
    remove_dirs = rootfs.remove_dirs

    def held(sandbox_dir):
        gate.wait(60)
        remove_dirs(sandbox_dir)

    monkeypatch.setattr(rootfs, "remove_dirs", held)
    engine = await Engine.open(state_dir)
    try:
        infos = [await engine.create() for _ in range(2)]
        pids, outer = set(), set()
        for info in infos:
            await engine.exec(info.id, "sleep 600 >/dev/null 2>&1 &")
            outer.add(engine._live[info.id].proc.pid)
            pids |= set(engine.cgroup(info.id).pids())
        pids -= outer
        assert len(pids) >= 4  # each: its agent and its sleep (at least)
        for info in infos:  # bounded: a delete that waited would hang on the gate
            assert await asyncio.wait_for(engine.delete(info.id, wait=False), 30) is True
            with pytest.raises(SandboxNotFound):
                engine.get(info.id)
        assert all((engine.layout.sandboxes_dir / i.id).exists() for i in infos)
        running = [p for p in pids if os.path.exists(f"/proc/{p}")
                   and Path(f"/proc/{p}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"]
        assert running == [], "a process of a deleted sandbox still runs"
    finally:
        closing = asyncio.create_task(engine.close())
        await asyncio.wait({closing}, timeout=1.0)
        gate.set()
        await closing
    assert not [p for p in outer if os.path.exists(f"/proc/{p}")], "bwrap outlived the close"
    assert syscalls.mounts_under(str(engine.layout.sandboxes_dir)) == []
    assert list(engine.layout.sandboxes_dir.iterdir()) == [], "close did not wait for teardowns"


async def until(predicate, limit: float = 60.0) -> None:
    """Poll ``predicate`` until it holds (bounded: a loaded host is slow, not stuck)."""
    deadline = time.monotonic() + limit
    while not predicate():
        assert time.monotonic() < deadline, "condition not reached in time"
        await asyncio.sleep(0.02)


async def test_pause_freezes_and_resume_continues(engine):
    info = await engine.create()
    sid = info.id
    # One line appended per tick (one write each): a count of whole lines is never
    # torn, wherever the freeze lands.
    await engine.exec(sid, "sh -c 'while true; do echo x >> /tmp/n; sleep 0.01; done' >/dev/null 2>&1 &")
    ticks = engine.upper_dir(sid) / "tmp/n"

    def count() -> int:
        try:
            return ticks.read_bytes().count(b"\n")
        except FileNotFoundError:
            return 0

    await until(lambda: count() >= 3)  # it runs
    paused = await engine.pause(sid)
    assert paused.state == SandboxState.PAUSED
    before = count()
    await asyncio.sleep(0.3)
    assert count() == before, "a paused sandbox kept running"
    with pytest.raises(InvalidState, match="resume"):
        await engine.exec(sid, "true")
    assert (await engine.resume(sid)).state == SandboxState.RUNNING
    await until(lambda: count() > before)  # the same loop goes on
    r = await engine.exec(sid, "wc -l < /tmp/n")
    assert int(r.stdout) > before


async def test_stop_then_delete_is_idempotent(engine):
    info = await engine.create(tags=["rl", "job=1"])
    stopped = await engine.stop(info.id, grace=0.5)
    assert stopped.state == SandboxState.STOPPED and stopped.ended_at
    with pytest.raises(InvalidState):
        await engine.exec(info.id, "true")
    assert (await engine.stop(info.id)).state == SandboxState.STOPPED
    assert await engine.delete(info.id) is True
    assert await engine.delete(info.id) is False
    with pytest.raises(SandboxNotFound):
        engine.get(info.id)
    assert leftovers(engine) == {"mounts": [], "cgroups": [], "dirs": []}


async def test_graceful_stop_lets_commands_handle_sigterm(engine):
    info = await engine.create()
    stream = engine.exec_stream(
        info.id, "trap 'echo got-term > /workspace/term; exit 0' TERM; echo ready; while true; do sleep 0.05; done"
    )
    assert (await stream.__anext__()).data == b"ready\n"
    stop = asyncio.create_task(engine.stop(info.id, grace=3))
    rest = [ev async for ev in stream]
    await stop
    assert rest[-1].kind == "exit" and rest[-1].result.returncode == 0


async def test_list_by_tags_and_state(engine):
    a = await engine.create(tags=["rl", "job=1"])
    b = await engine.create(tags=["rl", "job=2"])
    c = await engine.create(tags=["eval"])
    await engine.pause(b.id)
    ids = lambda infos: sorted(i.id for i in infos)  # noqa: E731
    assert ids(engine.list(tags=["rl"])) == sorted([a.id, b.id])
    assert ids(engine.list(tags=["rl", "job=2"])) == [b.id]
    assert ids(engine.list(state="paused")) == [b.id]
    assert ids(engine.list(state=["running"])) == sorted([a.id, c.id])
    assert ids(engine.list(tags=["nope"])) == []
    with pytest.raises(InvalidArgument):
        engine.list(state="sleeping")


async def test_lifetime_and_idle_timeouts_are_reaped(engine):
    short = await engine.create(timeout=1)
    idle = await engine.create(idle_timeout=1)
    # 6 s idle: its exec must come before it, on a loaded host too (2 s could pass);
    # the command outlives it
    busy = await engine.create(idle_timeout=6)
    run = asyncio.create_task(engine.exec(busy.id, "sleep 8"))
    info = await wait_state(engine, short.id, SandboxState.STOPPED)
    assert "timeout" in info.reason
    info = await wait_state(engine, idle.id, SandboxState.STOPPED)
    assert "idle" in info.reason
    r = await run
    assert r.returncode == 0, "a sandbox running a command is not idle"


async def test_bad_input_leaves_nothing_behind(engine):
    before = leftovers(engine)
    rows = len(engine.list())
    for bad in (
        dict(cpus=-1), dict(memory_mb=0), dict(pids=-5), dict(disk_mb=-1), dict(timeout=0),
        dict(tags=["bad tag with spaces"]), dict(env={"1BAD": "x"}), dict(workdir="relative"),
        dict(workdir="/a/../b"), dict(network="Bridge!"), dict(unknown_field=1),
    ):
        with pytest.raises(InvalidArgument):
            await engine.create(**bad)
    with pytest.raises(NetworkNotFound):  # a name no named network has
        await engine.create(network="bridge")
    with pytest.raises(ImageNotFound, match="no-such-image"):
        await engine.create(image="no-such-image")
    with pytest.raises(InvalidArgument):
        await engine.create(image="../../etc")
    with pytest.raises(SandboxNotFound):
        await engine.exec("sb-000000000000", "true")
    with pytest.raises(SandboxNotFound):
        await engine.read_file("sb-000000000000", "/etc/passwd")
    with pytest.raises(SandboxNotFound):
        await engine.pause("sb-nope")
    assert leftovers(engine) == before
    assert len(engine.list()) == rows


async def test_an_agent_that_dies_marks_the_sandbox_failed(engine):
    info = await engine.create()
    live = engine._live[info.id]
    os.kill(live.proc.pid, signal.SIGKILL)  # the outer bwrap; --die-with-parent takes the rest
    failed = await wait_state(engine, info.id, SandboxState.FAILED)
    assert "unexpectedly" in failed.reason
    assert leftovers(engine)["mounts"] == []


OWNER = textwrap.dedent(
    """
    import asyncio, sys
    from corral.runtime.engine import Engine
    async def main():
        eng = await Engine.open(sys.argv[1])
        ids = []
        for i in range(3):
            info = await eng.create(memory_mb=64)
            await eng.exec(info.id, "sleep 1000 >/dev/null 2>&1 &")
            ids.append(info.id)
        await eng.pause(ids[0])
        print(" ".join(ids), flush=True)
        await asyncio.sleep(3600)
    asyncio.run(main())
    """
)


async def test_restart_after_kill_9_cleans_up_and_reports_failed(state_dir):
    from corral.runtime.engine import Engine

    owner = subprocess.Popen(
        [sys.executable, "-c", OWNER, str(state_dir)], stdout=subprocess.PIPE, text=True
    )
    try:
        ids = owner.stdout.readline().split()
        assert len(ids) == 3, "the owner process did not create its sandboxes"
        os.kill(owner.pid, signal.SIGKILL)
        owner.wait()
        engine = await Engine.open(state_dir)
        try:
            for sid in ids:
                info = engine.get(sid)
                assert info.state == SandboxState.FAILED
                assert "lost" in info.reason and "restarted" in info.reason
            assert leftovers(engine) == {"mounts": [], "cgroups": [], "dirs": []}
            # no process of the old sandboxes survives (the paused one included)
            for pid in map(int, filter(str.isdigit, os.listdir("/proc"))):
                try:  # (other workers' sandboxes come and go meanwhile)
                    uid = os.stat(f"/proc/{pid}").st_uid
                    cmd = Path(f"/proc/{pid}/cmdline").read_bytes()
                except (FileNotFoundError, ProcessLookupError):
                    continue
                if uids.is_sandbox_uid(uid):
                    assert str(state_dir).encode() not in cmd, f"leaked process {pid}"
        finally:
            await engine.close()
    finally:
        if owner.poll() is None:
            owner.kill()
            owner.wait()
        owner.stdout.close()


async def test_two_engines_cannot_share_a_state_dir(engine, state_dir):
    from corral.runtime.engine import Engine

    with pytest.raises(InvalidState, match="another corral engine"):
        await Engine.open(state_dir)
