"""An emptied sandbox group made ready for the next warm slot, not removed (cgroup v1).

Removing a v1 group and making its successor costs the engine ~0.85 ms of CPU (a
``mkdir`` and an ``rmdir`` in each of seven hierarchies, the new group's files
written) and the kernel about as much again in its workers: a memory group's offline
walks every superblock's LRU lists to reparent its objects, and a cpuset's rebuilds
the scheduling domains. The group of a sandbox that has ended is instead given a new
name and reset (:func:`recycle`); ``benchmarks/bench_engine.py`` and
``docs/performance.md`` have the figures.

What a recycled group carries over, and what it must not:

- **no process**: each hierarchy's ``tasks`` (every thread, not only leaders) is read
  empty first, else the group is removed as before (its stragglers killed). Only the
  engine joins processes to a group; a sandbox has no cgroupfs.
- **no name**: it is renamed (v1 allows it in the same parent) before anything else,
  so nothing that still names the old group (an ended sandbox's row or
  :class:`~corral.runtime.cgroups.Cgroup` object, a late removal) reaches its next
  sandbox: those paths no longer exist.
- **the new sandbox's limits**: every limit is written again (CPU quota, ``pids.max``,
  memory and memory+swap), not only those that differ; the freezer is thawed; the new
  slot writes the standard device list (``devices.deny a`` first) and its cpuset, as
  for a new group, and a sandbox's own limits follow at its create.
- **none of the last sandbox's usage**: the counters the kernel lets us reset are
  reset (``memory``/``memsw``/``kmem``/``kmem.tcp`` ``max_usage_in_bytes`` and
  ``failcnt``, ``cpuacct.usage`` with its per-CPU and user/system split). The OOM-kill
  count cannot be reset: a group the OOM killer fired in is removed, not recycled (a
  baseline kept on the engine's object was lost when a restarted engine took the
  sandboxes over and opened their groups afresh: the next tenant's sandbox read the
  last one's kills as its own, and an agent killed from outside was blamed on its
  memory; tests/security/test_cgroup_recycle_handover.py). Memory still
  charged (kernel objects the last sandbox left, ~100 KB) stays charged; a group
  holding more than :data:`MAX_CHARGE` is removed instead, and so is one that has
  served :data:`MAX_USES` sandboxes, so such leftovers cannot build up. Counters the
  engine never reports stay as they were: v1 ``cpu.stat``'s throttling counts and
  ``pids.events``. No sandbox can read any of them (it has no cgroupfs).

cgroup v2 groups are always removed: ``memory.peak`` and ``memory.events`` cannot be
reset for every reader, and v2 has no rename.
"""

from __future__ import annotations

import os
from pathlib import Path

from corral.runtime import cgroup_files
from corral.runtime.cgroup_files import CgroupError
from corral.runtime.cgroups import Cgroup, CgroupDriver

__all__ = ["MAX_CHARGE", "MAX_USES", "recycle", "set_slot_cpus"]

MAX_CHARGE = 1 << 20  # bytes still charged to an empty group it may carry over
MAX_USES = 64  # sandboxes one group serves before it is removed
# counters a write of "0" resets (v1); each only where the kernel has it
_MEMORY_RESETS = ("memory.max_usage_in_bytes", "memory.failcnt",
                  "memory.memsw.max_usage_in_bytes", "memory.memsw.failcnt",
                  "memory.kmem.max_usage_in_bytes", "memory.kmem.failcnt",
                  "memory.kmem.tcp.max_usage_in_bytes", "memory.kmem.tcp.failcnt")


def _charged(memory: Path) -> int:
    """Bytes still charged to the group: memory and swap together where the kernel
    accounts swap (``memory.memsw``), so shared memory swapped out before the group is
    looked at is counted too (a red-team pass noted it; this host has no swap)."""
    memsw = memory / "memory.memsw.usage_in_bytes"
    if memsw.exists():
        return int(cgroup_files.read(memsw))
    return int(cgroup_files.read(memory / "memory.usage_in_bytes"))


def recycle(driver: CgroupDriver, group: Cgroup, path: str, *, cpus: float, memory_mb: int,
            pids: int) -> Cgroup | None:
    """``group``, empty, under the new name ``path`` (in the same parent) with these
    limits and no usage of its last sandbox's; None where it cannot be (v2, a process
    left, too much still charged, an OOM kill, too many uses, a write refused): then remove it as
    before. Blocking: call it off the event loop."""
    dirs = group._dirs
    parent, name = path.rsplit("/", 1)
    if (driver.version != 1 or not group.recyclable or group.uses >= MAX_USES
            or "cpuacct" not in dirs or "memory" not in dirs
            or group.path.rsplit("/", 1)[0] != parent or group.path == path):
        return None
    try:
        if any(cgroup_files.read(d / "tasks").strip() for d in group._hierarchies()):
            return None
        if _charged(dirs["memory"]) > MAX_CHARGE:
            return None
        if cgroup_files.count(dirs["memory"] / "memory.oom_control", "oom_kill"):
            return None  # (cannot be reset: it would be the next sandbox's)
    except (CgroupError, ValueError):
        return None
    # its OOM counter's kept descriptor would follow the rename to the next sandbox's
    # (an ended sandbox's late reason, read through it, blamed on that one's OOM kills)
    group.handed_on = True
    moved: dict[Path, Path] = {}  # (controllers co-mounted share one directory)
    for d in group._hierarchies():
        try:
            os.rename(d, d.parent / name)
        except OSError:
            _give_up(group, moved)
            return None
        moved[d] = d.parent / name
    new = type(group)(path, {k: moved[d] for k, d in dirs.items()})
    new.recyclable, new.uses = True, group.uses + 1
    try:
        _reset(driver, new)
        driver._set_limits(new, cpus, memory_mb, pids, None)
        new.limits = (cpus, memory_mb, pids)
    except CgroupError:
        new.remove(children=False)
        return None
    return new


def _reset(driver: CgroupDriver, group: Cgroup) -> None:
    dirs = group._dirs
    if "freezer" in dirs:
        cgroup_files.write(dirs["freezer"] / "freezer.state", "THAWED")
    memory = dirs["memory"]
    resets = driver.memory_resets
    if resets is None:  # which of them this kernel has: asked once per driver
        present = set(os.listdir(memory))
        resets = driver.memory_resets = tuple(f for f in _MEMORY_RESETS if f in present)
    for name in resets:
        cgroup_files.write(memory / name, "0")
    cgroup_files.write(dirs["cpuacct"] / "cpuacct.usage", "0")


def _give_up(group: Cgroup, moved: dict[Path, Path]) -> None:
    """A rename failed part way: put back what moved (else remove it there) so that
    the caller's removal of ``group`` finds every directory."""
    for was, now in moved.items():
        try:
            os.rename(now, was)
        except OSError:
            type(group)(group.path, {"": now}).remove(children=False)


def set_slot_cpus(driver: CgroupDriver, group: Cgroup, cpus: tuple[int, ...]) -> None:
    """A recycled group's cpuset for its next slot (it held its last sandbox's): ``cpus``,
    or where none were picked its parent's, as a new group's (v1 skips an equal write)."""
    if cpus:
        driver.set_cpus(group, cpus)
        return
    d = group._dirs.get("cpuset")
    if d is not None:
        cgroup_files.write(d / "cpuset.cpus", cgroup_files.read(d.parent / "cpuset.cpus").strip())
