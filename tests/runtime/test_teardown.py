"""A mass teardown leaves nothing: when the deletes return, no process or network
namespace of the sandboxes is left; once the background release is done (or after a
crash in the middle of it, at the next start), no cgroup, directory, mount, uid or row."""

from __future__ import annotations

import asyncio
import json
import os
import re
import signal
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from corral.runtime import syscalls
from corral.schema import SandboxState
from tests.conftest import requires_root

pytestmark = [requires_root, pytest.mark.root]

N = 8  # sandboxes torn down at once: enough to overlap, few enough to stay cheap


def leftovers(engine) -> dict:
    """What of the engine's ended sandboxes exists on the host (warm slots are by design)."""
    groups = [g for g in engine.cgroups.children(engine.cgroup_parent) if not g.startswith("slot-")]
    return {
        "mounts": syscalls.mounts_under(str(engine.layout.sandboxes_dir)),
        "cgroups": groups,
        "dirs": sorted(p.name for p in engine.layout.sandboxes_dir.iterdir()),
    }


def still_running(started: dict[int, int | None]) -> list[int]:
    """The processes of ``{pid: start time}`` that run (not zombies, not a reused pid)."""
    running = []
    for pid, t in started.items():
        try:
            stat = Path(f"/proc/{pid}/stat").read_bytes().rsplit(b")", 1)[1].split()
        except OSError:
            continue
        if stat[0] != b"Z" and int(stat[19]) == t:
            running.append(pid)
    return running


def net_namespaces(engine) -> set[str]:
    """The network namespaces some process of the host is in, but for the processes of
    other engines' sandboxes (other test workers'): a namespace's id is an inode number
    the kernel gives again once it is free, so a sandbox another worker just made may
    be in a namespace with the id one of ours had."""
    found = set()
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            groups = Path(f"/proc/{pid}/cgroup").read_text()
            if re.search(r"/corral[-/]e", groups) and f"/{engine.cgroup_parent}/" not in groups:
                continue
            found.add(os.readlink(f"/proc/{pid}/ns/net"))
        except OSError:
            continue
    return found


async def busy_sandboxes(engine, n: int) -> list:
    """``n`` sandboxes, each with a process of its own besides its agent."""
    infos = await asyncio.gather(*(engine.create(memory_mb=64) for _ in range(n)))
    await asyncio.gather(*(engine.exec(i.id, "sleep 1000 >/dev/null 2>&1 &") for i in infos))
    return [engine._live[i.id] for i in infos]


async def test_a_mass_teardown_leaves_no_process_cgroup_netns_file_or_uid(engine):
    lives = await busy_sandboxes(engine, N)
    started = {p: syscalls.process_start_time(p) for live in lives for p in live.cgroup.pids()}
    assert len(started) >= 3 * N  # bwrap, the agent, the sleep
    netns: set[str] = set()
    # held open here, so that the kernel cannot give a freed namespace's id to a new
    # one (a warm slot's, another worker's) while it is looked for
    held: list[int] = []
    for live in lives:  # the agent's network namespace (the outer bwrap is in the host's)
        inner = [p for p in live.cgroup.pids() if p != live.proc.pid]
        netns |= {os.readlink(f"/proc/{p}/ns/net") for p in inner}
        held += [os.open(f"/proc/{p}/ns/net", os.O_RDONLY) for p in inner]
    assert os.readlink("/proc/self/ns/net") not in netns
    uids = {live.uid for live in lives}

    outer = {p: t for p, t in started.items() if p in {live.proc.pid for live in lives}}

    try:
        # (the daemon's deletes: they return once every process is gone)
        assert all(await asyncio.gather(*(engine.delete(live.id, wait=False) for live in lives)))
        # at once: every process and network namespace is gone (but bwrap's outer
        # process, the engine's: it reaps its agent and exits after, in the teardown)
        running = still_running({p: t for p, t in started.items() if p not in outer})
        assert not running, "processes of deleted sandboxes still run"
        assert not netns & net_namespaces(engine), "a deleted sandbox's network namespace is in use"
    finally:
        for fd in held:
            os.close(fd)
    assert not {live.id for live in lives} & {i.id for i in engine.list()}

    await engine.reclaimed()  # then: bwrap, the empty cgroups, directories and uids
    assert not still_running(outer), "bwrap outlived its sandbox's teardown"
    assert leftovers(engine) == {"mounts": [], "cgroups": [], "dirs": []}
    assert all(not d.exists() for live in lives for d in live.cgroup._dirs.values())
    assert uids <= set(engine.uids._free) and not uids & engine.uids._used


CRASHER = textwrap.dedent(
    """
    import asyncio, json, os, signal, sys, threading
    from corral.runtime.engine import Engine
    from corral.runtime.syscalls import process_start_time

    async def main():
        eng = await Engine.open(sys.argv[1])
        infos = await asyncio.gather(*(eng.create(memory_mb=64) for _ in range(int(sys.argv[2]))))
        for info in infos:
            await eng.exec(info.id, "sleep 1000 >/dev/null 2>&1 &")
        pids = {p: process_start_time(p) for i in infos for p in eng._live[i.id].cgroup.pids()}
        stuck = threading.Event()
        # every background release hangs at its cgroup: the deletes return (their groups
        # are empty), their cgroups, directories and uids stay, and the engine dies in
        # the middle of releasing them
        group = type(eng._live[infos[0].id].cgroup)
        group.remove = lambda self, **how: stuck.wait()
        eng._pool.give_back = lambda group: stuck.wait()  # (or kept for a slot: recycled)
        done = await asyncio.gather(*(eng.delete(i.id, wait=False) for i in infos[1:]))
        assert all(done) and len(eng._teardowns) == len(infos) - 1, eng._teardowns
        print(json.dumps({"ids": [i.id for i in infos], "pids": pids}), flush=True)
        os.kill(os.getpid(), signal.SIGKILL)

    asyncio.run(main())
    """
)


async def test_a_crash_in_the_middle_of_a_teardown_leaves_nothing_after_restart(state_dir):
    from corral.runtime.engine import Engine

    crasher = subprocess.Popen([sys.executable, "-c", CRASHER, str(state_dir), "4"],
                               stdout=subprocess.PIPE, text=True)
    try:
        made = json.loads(crasher.stdout.readline() or "{}")
        assert crasher.wait(60) == -signal.SIGKILL and len(made.get("ids", [])) == 4, made
    finally:
        if crasher.poll() is None:
            crasher.kill()
            crasher.wait()
    ids, started = made["ids"], {int(p): t for p, t in made["pids"].items()}
    assert len(started) >= 3 * len(ids)
    engine = await Engine.open(state_dir)
    try:
        assert leftovers(engine) == {"mounts": [], "cgroups": [], "dirs": []}
        rows = {i.id: i for i in engine.list()}
        assert set(rows) == {ids[0]}, "a deleted sandbox's row came back"
        assert rows[ids[0]].state == SandboxState.FAILED  # the one not deleted: lost
        assert not still_running(started), "processes of the crashed engine's sandboxes run"
    finally:
        await engine.close()


async def test_paused_sandboxes_deleted_at_once_are_killed_not_waited_for(engine, monkeypatch):
    """A frozen sandbox cannot see its channel close: its delete kills it (the freezer
    is read off the event loop, batched with the agents' hang-ups) instead of waiting
    ``STOP_WAIT_S`` for an exit, here an hour: a delete that waited would hang."""
    from corral.runtime import engine_end

    monkeypatch.setattr(engine_end, "STOP_WAIT_S", 3600.0)
    lives = await busy_sandboxes(engine, 4)
    started = {p: syscalls.process_start_time(p) for live in lives for p in live.cgroup.pids()}
    outer = {p: started.pop(p) for p in {live.proc.pid for live in lives}}
    for live in lives[:2]:
        await engine.pause(live.id)
    assert all(await asyncio.wait_for(asyncio.gather(
        *(engine.delete(live.id, wait=False) for live in lives)), 120))
    # (bwrap's outer process, the engine's, exits after its agent: in the teardown)
    assert not still_running(started), "processes of deleted sandboxes still run"
    await engine.reclaimed()
    assert not still_running(outer), "bwrap outlived its sandbox's teardown"
    assert leftovers(engine) == {"mounts": [], "cgroups": [], "dirs": []}


async def test_a_process_joined_from_outside_is_killed_before_its_group_goes(engine):
    """A release removes a sandbox's cgroup without reading its members first; a
    process that joined the group from outside the sandbox's pid namespace (here: a
    host process the test puts there) keeps the group busy, and is then killed and the
    group removed, its uid given back only after that."""
    live = (await busy_sandboxes(engine, 1))[0]
    outsider = subprocess.Popen(["sleep", "1000"])
    try:
        live.cgroup.add(outsider.pid)
        assert await engine.delete(live.id, wait=False)
        await engine.reclaimed()
        assert outsider.wait(30) == -signal.SIGKILL
        assert leftovers(engine) == {"mounts": [], "cgroups": [], "dirs": []}
        assert live.uid in engine.uids._free and live.uid not in engine.uids._used
    finally:
        if outsider.poll() is None:
            outsider.kill()
            outsider.wait()
