"""Where an engine puts its sandboxes' CPU groups (docs/performance.md, "CPU share").

Each engine's sandboxes go under a group of its own at the top of every cgroup
hierarchy (``corral-<engine key>``), not under one ``corral`` group shared by every
engine of the host: a shared parent weighs as ONE task group against the host's other
work (a session's autogroup, a systemd slice), so another daemon's busy sandboxes took
this one's CPU share. An older engine's ``corral/<key>`` is still used (and cleaned up)
while it exists.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import tempfile
from pathlib import Path

import pytest

from corral.runtime.cgroups import CgroupV2Driver, detect
from corral.runtime.reconcile import engine_cgroup_parent
from tests.conftest import requires_root


def _cpu_group(pid: int) -> str:
    """The process's group in the hierarchy holding the ``cpu`` controller."""
    for line in Path(f"/proc/{pid}/cgroup").read_text().splitlines():
        _, controllers, path = line.split(":", 2)
        if "cpu" in controllers.split(",") or (controllers == "" and not Path(
                "/sys/fs/cgroup/cpu").is_dir()):
            return path
    raise AssertionError(f"no cpu group for {pid}")


def test_a_new_engine_gets_a_group_of_its_own_an_older_ones_is_kept(tmp_path):
    driver = CgroupV2Driver(tmp_path)
    assert engine_cgroup_parent(driver, "e0123456789") == "corral-e0123456789"
    (tmp_path / "corral" / "e0123456789").mkdir(parents=True)  # an older engine's
    assert engine_cgroup_parent(driver, "e0123456789") == "corral/e0123456789"
    assert engine_cgroup_parent(driver, "eabcdefabcd") == "corral-eabcdefabcd"


@requires_root
@pytest.mark.root
async def test_two_engines_sandboxes_do_not_share_a_cpu_group(engine):
    from corral.runtime.engine import Engine

    other_dir = Path(tempfile.mkdtemp(prefix="corral-test-state-"))  # sandboxes reach it
    other = await Engine.open(other_dir)
    try:
        a, b = await engine.create(memory_mb=64), await other.create(memory_mb=64)
        groups = [_cpu_group(e._live[i.id].proc.pid) for e, i in ((engine, a), (other, b))]
        for eng, group in zip((engine, other), groups, strict=True):
            assert eng.cgroup_parent == f"corral-{eng.layout.engine_key}"
            # at the top of the hierarchy: no parent shared with another engine
            assert group.startswith(f"/{eng.cgroup_parent}/"), group
        assert groups[0].split("/")[1] != groups[1].split("/")[1]
    finally:
        await other.close()
        shutil.rmtree(other_dir, ignore_errors=True)
    assert not any(d.is_dir() for d in other.cgroups._dirs(other.cgroup_parent).values())


@requires_root
@pytest.mark.root
async def test_an_older_engines_group_is_cleaned_up_and_then_left(state_dir):
    """An engine that finds ``corral/<key>`` (its state directory's older engine's,
    killed) uses it: its leftovers are removed as before, and the group goes when the
    engine closes; the next engine gets ``corral-<key>``."""
    from corral.runtime.engine import Engine

    eng = await Engine.open(state_dir)
    key = eng.layout.engine_key
    await eng.close()
    driver = detect()
    left = driver.create(f"corral/{key}/sb-left", cpus=1.0, memory_mb=64, pids=16)
    # a process the older engine left behind (killed with its group)
    proc = subprocess.Popen(["sleep", "300"], preexec_fn=lambda: left.add(os.getpid()))
    try:
        eng = await Engine.open(state_dir)
        try:
            assert eng.cgroup_parent == f"corral/{key}"
            assert "sb-left" not in eng.cgroups.children(eng.cgroup_parent)
            assert proc.wait(30) == -9
        finally:
            await eng.close()
        assert not any(d.is_dir() for d in driver._dirs(f"corral/{key}").values())
        eng = await Engine.open(state_dir)
        try:
            assert eng.cgroup_parent == f"corral-{key}"
        finally:
            await eng.close()
    finally:
        proc.kill()
        proc.wait()
