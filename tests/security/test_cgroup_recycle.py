"""A recycled cgroup: what one sandbox leaves in its group must not reach the next.

On cgroup v1 an ended sandbox's emptied group is renamed, reset and given to a later
warm slot (runtime/cgroup_recycle.py). The attacks: a sandbox that raises its group's
memory peak and CPU time hopes the next sandbox in that group is
reported with them (an exit blamed on the OOM killer, usage billed or leaked to
another tenant); a sandbox with tight limits, or one frozen or given every device,
leaves them for the next; a process left running in the group would share it; and
anything that still names the old group (the ended sandbox's handle) would reach the
new sandbox. The engine tests follow one group from sandbox A to a later sandbox C by
the inode of its memory directory (a rename keeps it), and fail if no such hand-over
happened; the last one calls the recycling itself.
"""

from __future__ import annotations

import asyncio
import os
import subprocess
from pathlib import Path

import pytest

from tests.conftest import requires_root

GROUP_WAIT_S = 60.0


def _inode(group) -> int:
    return os.stat(group._dirs["memory"]).st_ino


async def _until(pred, what: str):
    for _ in range(int(GROUP_WAIT_S / 0.05)):
        found = pred()
        if found:
            return found
        await asyncio.sleep(0.05)
    raise AssertionError(f"{what} within {GROUP_WAIT_S} s")


@pytest.fixture
async def one_slot_engine(state_dir):
    """An engine with one warm slot: A's group, recycled, is the next slot's but one."""
    from corral.runtime.cgroups import detect
    from corral.runtime.engine import Engine
    from tests.conftest import have_root_runtime

    if not have_root_runtime():
        pytest.skip("needs root")
    if detect().version != 1:
        pytest.skip("groups are recycled on cgroup v1 only (v2: always removed)")
    eng = await Engine.open(state_dir, warm_slots=1)
    try:
        yield eng
    finally:
        await eng.close()


async def _successor(engine, a_id: str, a_inode: int, **create):
    """Delete A; create sandboxes until one runs in A's group (renamed): that one's id."""
    pool = engine._pool
    await engine.delete(a_id)
    await _until(lambda: any(_inode(g) == a_inode for g in pool._spare),
                 "the ended sandbox's group was not kept")
    others = []
    try:
        for _ in range(4):  # the ready slot came first; the next is made on A's group
            info = await engine.create(**create)
            if _inode(engine.cgroup(info.id)) == a_inode:
                return info.id
            others.append(info.id)
    finally:
        for sid in others:
            await engine.delete(sid)
    raise AssertionError("no later sandbox got the recycled group")


@requires_root
async def test_a_recycled_group_carries_no_usage_of_the_last_sandbox(one_slot_engine):
    engine = one_slot_engine
    a = await engine.create(memory_mb=96)
    group_a = engine.cgroup(a.id)
    # memory peak near the limit and a second of CPU (a group the OOM killer fired in
    # is never recycled: test_cgroup_recycle_handover.py)
    r = await engine.exec(a.id, ["python3", "-c", "b = bytearray(60 << 20); b[::4096] = b'x' * len(b[::4096])"],
                          timeout=60)
    assert r.returncode == 0, r
    await engine.exec(a.id, ["python3", "-c", "import time\nt = time.process_time()\n"
                             "while time.process_time() - t < 1: pass"], timeout=60)
    peak_a, cpu_a = group_a.memory_peak_bytes(), group_a.cpu_seconds()
    assert peak_a > 60 << 20 and cpu_a > 0.8, (peak_a, cpu_a)

    c = await _successor(engine, a.id, _inode(group_a))
    group_c = engine.cgroup(c)
    assert group_c.path != group_a.path  # the old name reaches nothing
    assert not Path(group_a._dirs["memory"]).exists()
    assert group_c.oom_kills() == 0
    assert group_c.memory_peak_bytes() < 40 << 20, group_c.memory_peak_bytes()
    assert group_c.cpu_seconds() < cpu_a / 2, (group_c.cpu_seconds(), cpu_a)
    r = await engine.exec(c, ["true"])
    assert (r.returncode, r.oom_killed) == (0, False), r
    usage = engine.usage(c)  # what the API reports for the new sandbox
    assert usage["cpu_seconds"] < cpu_a / 2 and usage["memory_mb"] < 40, usage
    # the ended sandbox's handle cannot touch the new sandbox's group
    group_a.remove(children=False)
    assert (await engine.exec(c, ["echo", "alive"])).stdout == b"alive\n"
    await engine.delete(c)


@requires_root
async def test_a_recycled_group_gets_the_next_sandboxs_limits_thawed(one_slot_engine):
    from corral.schema import DEFAULT_CPUS, DEFAULT_MEMORY_MB, DEFAULT_PIDS

    engine = one_slot_engine
    a = await engine.create(memory_mb=64, pids=20, cpus=0.25)
    group_a = engine.cgroup(a.id)
    group_a.allow_all_devices()  # as a GPU or disk sandbox's group is while it launches
    group_a.freeze()  # deleted while paused
    c = await _successor(engine, a.id, _inode(group_a))  # the defaults: nothing to write?
    d = engine.cgroup(c)._dirs
    assert int((d["memory"] / "memory.limit_in_bytes").read_text()) == DEFAULT_MEMORY_MB << 20
    assert (d["pids"] / "pids.max").read_text().strip() == str(DEFAULT_PIDS)
    assert int((d["cpu"] / "cpu.cfs_quota_us").read_text()) == int(DEFAULT_CPUS * 100_000)
    assert (d["freezer"] / "freezer.state").read_text().strip() == "THAWED"
    if "devices" in d:
        assert "a *:* rwm" not in (d["devices"] / "devices.list").read_text()
        # a process of its group cannot open the host's loop control
        probe = subprocess.run(
            ["python3", "-c", "import os, sys\nopen(sys.argv[1], 'w').write(str(os.getpid()))\n"
             "try:\n    os.open('/dev/loop-control', os.O_RDONLY)\n    print('opened')\n"
             "except OSError as e:\n    print(e.strerror)",
             str(d["devices"] / "cgroup.procs")], capture_output=True, text=True, timeout=60)
        assert probe.stdout.strip() == "Operation not permitted", probe
    r = await engine.exec(c, ["python3", "-c", "print(1)"])
    assert r.stdout == b"1\n", r
    await engine.delete(c)


@requires_root
async def test_a_group_with_a_process_left_is_removed_not_recycled(state_dir):
    from corral.runtime.cgroup_recycle import recycle
    from corral.runtime.cgroups import detect
    from tests.conftest import have_root_runtime

    if not have_root_runtime():
        pytest.skip("needs root")
    driver = detect()
    if driver.version != 1:
        pytest.skip("groups are recycled on cgroup v1 only")
    parent = f"corral-test-recycle-{os.getpid()}"
    group = driver.create(f"{parent}/a", cpus=1.0, memory_mb=64, pids=16)
    group.recyclable = True
    lurker = subprocess.Popen(["sleep", "60"])
    try:
        # in one hierarchy only (a half-made join): still a process of the group
        (group._dirs["pids"] / "cgroup.procs").write_text(str(lurker.pid))
        assert recycle(driver, group, f"{parent}/b", cpus=1.0, memory_mb=64, pids=16) is None
        assert group._dirs["memory"].exists()  # left to the removal, which kills it
        group.remove(children=False)
        assert lurker.wait(10) == -9
        # an empty one is recycled; one not made for a slot is not
        other = driver.create(f"{parent}/c", cpus=1.0, memory_mb=64, pids=16)
        assert recycle(driver, other, f"{parent}/d", cpus=1.0, memory_mb=64, pids=16) is None
        other.recyclable = True
        new = recycle(driver, other, f"{parent}/d", cpus=1.0, memory_mb=64, pids=16)
        assert new is not None and new.uses == 2 and not other._dirs["pids"].exists()
        new.remove(children=False)
    finally:
        lurker.kill()
        lurker.wait()
        for root in driver._roots().values():
            for d in (root / parent / n for n in "abcd"):
                if d.exists():
                    d.rmdir()
            if (root / parent).exists():
                (root / parent).rmdir()


@requires_root
def test_a_group_left_holding_memory_is_removed_not_recycled(tmp_path):
    """Memory a sandbox leaves charged to its group once all its processes are gone
    (here tmpfs pages of a file it wrote that outlives it, as a volume's page cache or a
    memfd handed to a sibling sandbox would): recycled, the group would hand the charge
    to the next sandbox (another tenant's), which would reach its memory limit that much
    sooner (an OOM kill scored as its own). A group holding more than MAX_CHARGE is
    removed instead."""
    from corral.runtime.cgroup_recycle import MAX_CHARGE, recycle
    from corral.runtime.cgroups import detect
    from tests.conftest import have_root_runtime

    if not have_root_runtime():
        pytest.skip("needs root")
    driver = detect()
    if driver.version != 1:
        pytest.skip("groups are recycled on cgroup v1 only")
    shm = Path("/dev/shm")
    if not shm.is_dir():
        pytest.skip("no /dev/shm (tmpfs) on this host")
    parent = f"corral-test-recycle-charge-{os.getpid()}"
    left = shm / f"corral-test-recycle-charge-{os.getpid()}"
    size = 8 * MAX_CHARGE
    group = driver.create(f"{parent}/a", cpus=1.0, memory_mb=64, pids=16)
    group.recyclable = True
    try:
        # a process of the group writes the file, then exits: the pages stay charged
        writer = subprocess.run(
            ["python3", "-c", "import os, sys\n"
             "for procs in sys.argv[2:]:\n    open(procs, 'w').write(str(os.getpid()))\n"
             f"open(sys.argv[1], 'wb').write(b'x' * {size})", str(left), *group.procs_files()],
            capture_output=True, text=True, timeout=60)
        assert writer.returncode == 0, writer.stderr
        assert not group.pids()
        assert group.memory_bytes() >= size, group.memory_bytes()
        assert recycle(driver, group, f"{parent}/b", cpus=1.0, memory_mb=64, pids=16) is None
        assert group._dirs["memory"].exists()  # left to the caller's removal, as it was
    finally:
        left.unlink(missing_ok=True)
        group.remove(children=False)
        for root in driver._roots().values():
            for d in (root / parent / "b", root / parent):
                if d.exists():
                    d.rmdir()


def test_swapped_out_charge_counts_against_recycling(tmp_path):
    """Where the kernel accounts swap, memory the last sandbox left that went to swap
    counts as still charged (``memory.memsw.usage_in_bytes``): a group whose memory
    alone looks empty is not handed on. (No swap on CI hosts: the files stand in.)"""
    from corral.runtime.cgroup_recycle import MAX_CHARGE, _charged

    (tmp_path / "memory.usage_in_bytes").write_text("4096\n")
    assert _charged(tmp_path) == 4096
    (tmp_path / "memory.memsw.usage_in_bytes").write_text(f"{MAX_CHARGE + 4096}\n")
    assert _charged(tmp_path) > MAX_CHARGE
