"""Attacks on the sweep of dead engines' cgroups (runtime/cgroup_sweep.py).

A sweep runs whenever any engine starts, so what it removes must be provably a dead
engine's and empty: a name that only looks like an engine's group, a dead-looking
group that still holds someone's process, a key whose lock is held or whose lock file
was replaced by a link, and a live engine's frozen or empty groups all survive it; and sandbox processes with
megabytes of arguments each do not swell the sweep that reads every process's.
Every group here has a private random key; the test removes what it made.
"""

from __future__ import annotations

import os
import secrets
import subprocess
from pathlib import Path

import pytest

from tests.conftest import requires_root

pytestmark = [requires_root, pytest.mark.root]


def _key() -> str:
    return "e" + secrets.token_hex(5)  # a private engine key (Layout.engine_key's shape)


def _sweep(*keys: str):
    """A sweep as every engine's start runs it, looking at these private keys alone
    (other engines on the host are no test's to sweep)."""
    from corral.runtime import cgroup_sweep, cgroups
    from corral.runtime.paths import cgroup_lock_dir

    return cgroup_sweep.sweep(cgroups.detect().hierarchies(), cgroup_lock_dir(), only=keys)


def _roots() -> list[Path]:
    from corral.runtime import cgroups

    return cgroups.detect().hierarchies()


def _plant(names: list[str]) -> list[Path]:
    made = []
    for root in _roots():
        for name in names:
            (root / name).mkdir(parents=True)
            made.append(root / name)
    return made


def _unplant(made: list[Path]) -> None:
    for d in sorted(made, key=lambda p: len(p.parts), reverse=True):
        try:
            d.rmdir()
        except FileNotFoundError:
            pass


def test_names_that_only_look_like_an_engines_group_are_never_removed():
    key = _key()
    decoys = [f"corral-{key}x", f"corral-{key.upper()}", f"corral-{key[:-1]}",
              f"corralx-{key}", f"xcorral-{key}", f"corral-{key}.slice", f"corral_{key}",
              f"corral-{key}-bench"]
    made = _plant(decoys)
    try:
        _sweep(key, key.upper(), key[:-1])
        gone = [d for d in made if not d.is_dir()]
        assert not gone, f"a sweep removed groups that are no engine's: {gone}"
    finally:
        _unplant(made)


def test_a_dead_keys_group_holding_a_process_is_reported_not_killed():
    from corral.runtime import cgroups

    key = _key()
    driver = cgroups.detect()
    group = driver.create(f"corral-{key}/sb-held", cpus=0.5, memory_mb=32, pids=8)
    sleeper = subprocess.Popen(["sleep", "60"])
    try:
        group.add(sleeper.pid)
        swept = _sweep(key)
        assert sleeper.poll() is None, "a sweep killed a process"
        assert all(d.is_dir() for d in group._dirs.values()), "a group in use was removed"
        held = {str(d) for d in group._dirs.values()}
        assert held <= set(swept.busy), "a dead key's group in use was not reported"
    finally:
        sleeper.kill()
        sleeper.wait()
        group.remove()
        driver.open(f"corral-{key}").remove()


def test_a_key_whose_lock_is_held_or_replaced_by_a_link_is_left_alone(tmp_path):
    from corral.runtime.cgroup_sweep import KeyLock
    from corral.runtime.paths import cgroup_lock_dir

    held, linked = _key(), _key()
    made = _plant([f"corral-{held}", f"corral-{held}/sb-empty", f"corral-{linked}"])
    lock = KeyLock.take(cgroup_lock_dir(), held)  # as a live engine holds its own
    target = tmp_path / "not-a-lock"
    target.write_text("untouched")
    link = cgroup_lock_dir() / f"{linked}.lock"
    link.symlink_to(target)
    try:
        swept = _sweep(held, linked)
        gone = [d for d in made if not d.is_dir()]
        assert not gone, f"a sweep removed groups it could not prove dead: {gone}"
        assert {held, linked} <= set(swept.live)
        assert target.read_text() == "untouched" and link.is_symlink()
    finally:
        lock.release()
        link.unlink()
        _unplant(made)


async def test_a_live_engines_frozen_and_empty_groups_survive_a_sweep(engine):
    """What a tenant can do to its own sandbox's group (pause it, end every process in
    it) does not make a sweep take it for a dead engine's."""
    info = await engine.create(memory_mb=64)
    await engine.exec(info.id, "true")
    await engine.pause(info.id)
    empty = engine.cgroups.create(f"{engine.cgroup_parent}/sb-ended", cpus=0.5,
                                  memory_mb=32, pids=8)
    dirs = [*engine.cgroup(info.id)._dirs.values(), *empty._dirs.values()]
    try:
        # without the warden's name to go by: the key's lock alone keeps them
        from corral.runtime import cgroup_sweep

        named = cgroup_sweep._named_keys
        cgroup_sweep._named_keys = set  # (a version of the sweep that only reads locks)
        try:
            swept = _sweep(engine.cgroup_key.key)
        finally:
            cgroup_sweep._named_keys = named
        gone = [d for d in dirs if not d.is_dir()]
        assert not gone, f"a sweep removed a live engine's groups: {gone}"
        assert engine.cgroup_key.key in swept.live
    finally:
        empty.remove()
    await engine.resume(info.id)
    assert (await engine.exec(info.id, "echo alive")).stdout == b"alive\n"
    assert os.path.isdir(dirs[0])


ARGS_EACH, PROCESSES = 4 << 20, 8  # (an exec takes at most 6 MiB of arguments)
HUGE = """
import os, resource, sys, time
n, count = int(sys.argv[1]), int(sys.argv[2])
resource.setrlimit(resource.RLIMIT_STACK, (resource.RLIM_INFINITY,) * 2)  # (a quarter of it)
fd = os.open("/dev/null", os.O_RDWR)
for _ in range(count):
    pid = os.fork()
    if pid == 0:
        for k in (0, 1, 2):
            os.dup2(fd, k)
        os.execv("/bin/sleep", ["sleep", "120"] + ["k" * 131000] * (n // 131000))
    while len(open(f"/proc/{pid}/cmdline", "rb").read()) < n // 2:
        assert os.waitpid(pid, os.WNOHANG) == (0, 0), "exec failed"
        time.sleep(0.01)
"""


async def test_a_sandboxs_huge_argument_lists_do_not_swell_a_sweep(sandbox):
    """Sandbox processes with megabytes of arguments each (visible in the host's /proc)
    hoped each engine's start, sweeping a dead key, would read them all into the
    daemon: every process's whole argument list, up to 6 MiB each for every pid of
    every sandbox, read and split on the start's path while a dead key's group is left."""
    import tracemalloc

    engine, sid = sandbox
    r = await engine.exec(sid, ["python3", "-c", HUGE, str(ARGS_EACH), str(PROCESSES)],
                          timeout=60)
    assert r.returncode == 0, r.stderr
    key = _key()
    made = _plant([f"corral-{key}"])
    try:
        tracemalloc.start()
        try:
            swept = _sweep(key)
            peak = tracemalloc.get_traced_memory()[1]
        finally:
            tracemalloc.stop()
        assert len(swept.removed) == len(made)  # the dead key was swept all the same
        assert peak < ARGS_EACH // 4, peak
    finally:
        _unplant(made)
