"""Groups of dead engines are swept when an engine starts; a live engine's never are.

An engine killed together with its warden leaves ``corral-<key>`` and its sandboxes'
child groups behind; the next engine to start (any state directory) removes them. A
live engine's groups, empty ones included, survive that sweep (its key's lock), and an
engine starting on a key while it is being swept waits for the sweep and then works.
Every key here is a private state directory's.
"""

from __future__ import annotations

import asyncio
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import textwrap
import threading
import time
from pathlib import Path

import pytest

from tests.conftest import requires_root

pytestmark = [requires_root, pytest.mark.root]

OWNER = textwrap.dedent(
    """
    import asyncio, json, sys
    from corral.runtime.engine import Engine
    async def main():
        eng = await Engine.open(sys.argv[1], warm_slots=1)
        info = await eng.create(memory_mb=64)
        await eng.exec(info.id, "sleep 1000 >/dev/null 2>&1 &")
        cg = eng.cgroup(info.id)
        print(json.dumps({"warden": eng._warden.proc.pid,
                          "groups": [str(d) for d in cg._dirs.values()],
                          "parents": [str(d.parent) for d in cg._dirs.values()]}), flush=True)
        await asyncio.sleep(3600)
    asyncio.run(main())
    """
)


def _procs(dirs: list[Path]) -> list[int]:
    """Processes anywhere under ``dirs``."""
    found: list[int] = []
    for top in dirs:
        for here, _subdirs, files in os.walk(top):
            if "cgroup.procs" in files:
                try:
                    found += [int(p) for p in Path(here, "cgroup.procs").read_text().split()]
                except OSError:
                    pass
    return found


def _wait(predicate, what: str, timeout: float = 60.0) -> None:
    deadline = time.monotonic() + timeout  # only against a hang
    while not predicate():
        assert time.monotonic() < deadline, what
        time.sleep(0.05)


@pytest.fixture
def other_state_dir():
    d = Path(tempfile.mkdtemp(prefix="corral-test-sweeper-"))
    yield d
    shutil.rmtree(d, ignore_errors=True)


async def test_an_engine_killed_with_its_warden_leaves_groups_the_next_start_sweeps(
        state_dir, other_state_dir):
    from corral.runtime.cgroup_sweep import KeyLock
    from corral.runtime.engine import Engine
    from corral.runtime.paths import Layout, cgroup_lock_dir

    owner = subprocess.Popen([sys.executable, "-c", OWNER, str(state_dir)],
                             stdout=subprocess.PIPE, text=True)
    try:
        line = owner.stdout.readline()
        assert line, "the owner process did not create its sandbox"
        made = json.loads(line)
        parents = [Path(p) for p in made["parents"]]
        os.kill(made["warden"], signal.SIGKILL)  # both die: nobody is left to clean up
        os.kill(owner.pid, signal.SIGKILL)
        owner.wait()
        # (held meanwhile, so that no other engine starting on this host sweeps them first)
        held = KeyLock.take(cgroup_lock_dir(), Layout(state_dir, state_dir).engine_key)
        try:
            _wait(lambda: not _procs(parents), "the dead engine's sandboxes did not end")
            assert all(Path(g).is_dir() for g in made["groups"]), "nothing was left to sweep"
        finally:
            held.release(remove=False)
        engine = await Engine.open(other_state_dir, warm_slots=0)
        try:
            left = [p for p in parents if p.exists()]
            assert not left, f"a dead engine's groups outlived the next start: {left}"
            assert engine.swept is not None
            assert not [b for b in engine.swept.busy if any(b.startswith(str(p)) for p in parents)]
        finally:
            await engine.close()
    finally:
        if owner.poll() is None:
            owner.kill()
            owner.wait()
        from corral.runtime.engine import Engine  # (a failed run: whatever is left)

        engine = await Engine.open(state_dir, warm_slots=0)
        await engine.close()


async def test_a_live_engines_groups_survive_another_engines_start(engine, other_state_dir):
    from corral.runtime.engine import Engine

    info = await engine.create(memory_mb=64)
    await engine.pause(info.id)  # frozen
    empty = engine.cgroups.create(f"{engine.cgroup_parent}/empty-for-test", cpus=0.5,
                                  memory_mb=32, pids=8)  # a group with no process at all
    dirs = [*engine.cgroup(info.id)._dirs.values(), *empty._dirs.values()]
    other = await Engine.open(other_state_dir, warm_slots=0)
    try:
        assert engine.cgroups is not None and other.swept is not None
        gone = [d for d in dirs if not d.is_dir()]
        assert not gone, f"a sweep removed a live engine's groups: {gone}"
        assert engine.cgroup_key is not None and engine.cgroup_key.key in other.swept.live
    finally:
        await other.close()
        empty.remove()
    await engine.resume(info.id)
    assert (await engine.exec(info.id, "echo alive")).stdout == b"alive\n"


async def test_an_engine_starting_during_a_sweep_of_its_key_waits_and_keeps_its_groups(
        state_dir):
    from corral.runtime import cgroup_sweep, cgroups
    from corral.runtime.engine import Engine
    from corral.runtime.paths import Layout, cgroup_lock_dir

    key = Layout(state_dir, state_dir).engine_key
    roots = cgroups.detect().hierarchies()
    for root in roots:  # what a dead engine of this key left: many empty groups
        for i in range(40):
            (root / f"corral-{key}" / f"sb-dead{i}").mkdir(parents=True, exist_ok=True)
    sweeping = threading.Event()

    def sweep() -> cgroup_sweep.Swept:
        sweeping.set()
        return cgroup_sweep.sweep(roots, cgroup_lock_dir(), only={key})

    swept = asyncio.ensure_future(asyncio.to_thread(sweep))
    await asyncio.to_thread(sweeping.wait, 10)
    engine = await Engine.open(state_dir, warm_slots=0)  # meanwhile: one waits for the other
    try:
        await swept
        info = await engine.create(memory_mb=64)
        assert (await engine.exec(info.id, "echo ok")).stdout == b"ok\n"
        assert all(d.is_dir() for d in engine.cgroup(info.id)._dirs.values())
        assert not any((r / f"corral-{key}" / "sb-dead0").exists() for r in roots)
    finally:
        await engine.close()
    assert not any((r / f"corral-{key}").exists() for r in roots)
    assert not (cgroup_lock_dir() / f"{key}.lock").exists(), "a closed engine left its lock"


async def test_an_engine_does_not_start_while_its_key_is_held(state_dir):
    """A sweep holds a dead key's lock while it removes that key's groups: an engine of
    that key waits for it, then starts (and neither sees the other's groups go)."""
    from corral.runtime.cgroup_sweep import KeyLock
    from corral.runtime.engine import Engine
    from corral.runtime.paths import Layout, cgroup_lock_dir

    key = Layout(state_dir, state_dir).engine_key
    held = KeyLock.take(cgroup_lock_dir(), key)
    opening = asyncio.ensure_future(Engine.open(state_dir, warm_slots=0))
    try:
        await asyncio.sleep(0.5)
        assert not opening.done(), "an engine started while its key was held"
    finally:
        held.release(remove=False)
    engine = await opening
    try:
        assert engine.cgroup_key is not None and engine.cgroup_key.key == key
    finally:
        await engine.close()
