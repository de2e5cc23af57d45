"""Resource limits for sandboxes: cgroup v1 and v2 behind one interface.

:func:`detect` picks the hierarchy at run time: cgroup v2 when a ``cgroup2`` mount
offers the ``cpu``, ``memory`` and ``pids`` controllers (a pure v2 host, or a hybrid
whose ``unified`` mount has them), else cgroup v1 when the ``memory``, ``pids``,
``cpu`` and ``freezer`` controllers are mounted. Groups are always made under each
hierarchy's root mount, wherever the calling process itself sits::

    driver = detect()
    group = driver.create("corral/e1234/sb-abc", cpus=1.0, memory_mb=512, pids=256)
    # the launcher joins with `echo $$ > F` for F in group.procs_files(), then execs
    group.remove()  # kills whatever is left, then removes the group
"""

from __future__ import annotations

import errno
import os
import time
import weakref
from collections.abc import Sequence
from contextlib import suppress
from pathlib import Path

from corral import errors
from corral.runtime import cgroup_files
from corral.runtime.cgroup_files import CFS_PERIOD_US, CgroupError, effective_cpus
from corral.runtime.devices import DeviceRule, allow_all, restrict
from corral.runtime.fsutil import unescape_mountinfo

__all__ = ["Cgroup", "CgroupDriver", "CgroupError", "CgroupV1Driver", "CgroupV2Driver", "detect",
           "effective_cpus"]

# the control-file helpers under their names here (cgroup_files.py)
_translated = cgroup_files.translated
_write = cgroup_files.write
_read = cgroup_files.read
_keyed = cgroup_files.keyed
_sigkill = cgroup_files.sigkill
_child_names = cgroup_files.child_names
_quota_us = cgroup_files.quota_us
_check_path = cgroup_files.check_path
_check_limits = cgroup_files.check_limits

V1_CONTROLLERS = ("memory", "pids", "cpu", "freezer")
V1_OPTIONAL_CONTROLLERS = ("cpuacct", "cpuset", "devices")
V2_CONTROLLERS = ("cpu", "memory", "pids")
MOUNTINFO = "/proc/self/mountinfo"
_POLL_S = 0.001


class Cgroup:
    """One sandbox's group, present in one directory per hierarchy (build it with
    :meth:`CgroupDriver.create` or :meth:`CgroupDriver.open`)."""

    def __init__(self, path: str, dirs: dict[str, Path]) -> None:
        self.path = path
        self._dirs = dirs  # controller (or "" on v2) -> directory
        self.limits: tuple[float, int, int] | None = None  # as last written here (set_limits)
        self._oom_fd = -1  # the OOM counter's file, kept open (_oom_text)
        # a warm slot's, which may serve a next sandbox once empty (cgroup_recycle.py):
        # how many it has served
        self.recyclable = False
        self.uses = 1
        self.handed_on = False  # renamed for the next sandbox: its kept fd reads that one's

    def _hierarchies(self) -> list[Path]:
        return list(dict.fromkeys(self._dirs.values()))  # co-mounted controllers share one

    def procs_files(self) -> list[str]:
        """The ``cgroup.procs`` files a process writes its pid to, to join every hierarchy."""
        return [str(d / "cgroup.procs") for d in self._hierarchies()]

    def add(self, pid: int) -> None:
        """Move process ``pid`` into this group in every hierarchy."""
        for procs in self.procs_files():
            _write(Path(procs), str(pid))

    def pids(self) -> list[int]:
        """Every process in the group, in any hierarchy (a crash mid-join leaves some in one)."""
        found: set[int] = set()
        for procs in self.procs_files():
            try:
                found.update(int(line) for line in Path(procs).read_text().split())
            except FileNotFoundError:
                continue
        return sorted(found)

    def freezer_dir(self) -> Path:
        """The directory of the group's freezer (v1's hierarchy, or v2's group)."""
        return self._dirs.get("freezer") or self._dirs[""]

    def restrict_devices(self, rules: list[DeviceRule]) -> str:
        """Only the device nodes ``rules`` name may be opened by the group's processes
        (:mod:`corral.runtime.devices`); ``"v1"``, ``"v2"`` or ``""`` (no controller)."""
        return restrict(self._dirs, rules)

    def allow_all_devices(self) -> bool:
        """Undo :meth:`restrict_devices` on v1 (every device the parent allows); False
        where the group has no v1 devices hierarchy."""
        return allow_all(self._dirs)

    def freeze(self, timeout: float = 5.0) -> None:
        """Stop every process in the group; return once they are all stopped."""
        raise NotImplementedError

    def thaw(self) -> None:
        """Let the processes of a frozen group run again."""
        raise NotImplementedError

    def frozen(self) -> bool:
        """Whether the group is completely frozen."""
        raise NotImplementedError

    def _wait_frozen(self, timeout: float) -> None:
        deadline = time.monotonic() + timeout
        while not self.frozen():
            if time.monotonic() > deadline:
                raise CgroupError(f"cgroup {self.path} did not freeze within {timeout}s")
            time.sleep(_POLL_S)

    def _kill_frozen(self) -> None:
        try:
            self.freeze()
        except CgroupError:
            pass  # a task stuck in D state keeps it FREEZING; kill what we can anyway
        # Frozen tasks cannot exit or fork, so the pids read now stay valid and complete.
        _sigkill(self.pids())
        try:
            self.thaw()  # v1: a frozen task acts on SIGKILL only once it runs again
        except CgroupError:
            pass  # not in the freezer hierarchy (half-made group): nothing was frozen

    def _start_kill(self) -> None:
        self._kill_frozen()

    def kill_all(self, timeout: float = 5.0) -> None:
        """SIGKILL every process in the group and wait until the group is empty."""
        self._start_kill()
        deadline = time.monotonic() + timeout
        while left := self.pids():
            if time.monotonic() > deadline:
                raise CgroupError(
                    f"cgroup {self.path} still has processes {left} after {timeout}s of SIGKILL",
                    details={"pids": left},
                )
            _sigkill(left)  # stragglers that joined only some hierarchies were not frozen
            time.sleep(_POLL_S * 10)

    def oom_kills(self) -> int:
        """How many processes the kernel's OOM killer has killed in this group."""
        raise NotImplementedError

    def _oom_text(self, path: Path) -> str:
        """``path``, the OOM counter's file, read before every command (and after one
        that was SIGKILLed) through a descriptor opened once: one ``pread`` instead of an
        open, two reads and a close (~40 µs of the daemon's loop a command under load).
        The descriptor is closed only when this object is collected, never while a read
        might still use it (a number closed and reused by another file would read that
        file); a removed group's file answers ENODEV (a :class:`CgroupError`), and so
        does a group handed on (renamed: the descriptor reads the next sandbox's)."""
        if self.handed_on:
            raise CgroupError(f"cannot read {path}: the group serves another sandbox now")
        if self._oom_fd < 0:
            with _translated("open", path):
                fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
            weakref.finalize(self, os.close, fd)
            self._oom_fd = fd
        return cgroup_files.pread_text(self._oom_fd, path)

    def memory_bytes(self) -> int:
        """Current memory use of the group, in bytes."""
        raise NotImplementedError

    def memory_peak_bytes(self) -> int:
        """Highest memory use of the group, in bytes (current use if the kernel has no peak)."""
        raise NotImplementedError

    def cpu_seconds(self) -> float:
        """CPU time used by every process that ever ran in the group, in seconds."""
        raise NotImplementedError

    def remove(self, *, children: bool = True) -> None:
        """Kill every process, then remove the group (and its child groups); idempotent.

        A sandbox cannot make child groups (it has no access to cgroupfs), so the
        engine passes ``children=False`` and skips the scan for them.
        """
        if children:
            for name in _child_names(self._hierarchies()):
                child = {k: d / name for k, d in self._dirs.items()}
                type(self)(f"{self.path}/{name}", child).remove()
        elif self._removed_empty():
            return
        if self.pids():
            self.kill_all()
        for d in self._hierarchies():
            _rmdir(d)

    def _removed_empty(self) -> bool:
        """Remove each directory while the kernel lets us (a group holding a task
        answers EBUSY: left to the kill and the retries); whether all went."""
        for d in self._hierarchies():
            try:
                d.rmdir()
            except FileNotFoundError:
                continue
            except OSError as exc:
                if exc.errno == errno.EBUSY:
                    return False
                with _translated("remove cgroup", d):
                    raise
        return True


def _rmdir(d: Path, timeout: float = 2.0) -> None:
    deadline = time.monotonic() + timeout
    with _translated("remove cgroup", d):
        while True:
            try:
                return d.rmdir()
            except FileNotFoundError:
                return
            except OSError as exc:
                # EBUSY just after the last task died: the kernel lets go asynchronously.
                if exc.errno != errno.EBUSY or time.monotonic() > deadline:
                    raise
            time.sleep(_POLL_S * 10)


_REFREEZE_S = 0.5  # v1: how often a freeze still FREEZING is asked again


class CgroupV1(Cgroup):
    """A group on cgroup v1: one directory per controller hierarchy."""

    def freeze(self, timeout: float = 5.0) -> None:
        # The state goes through FREEZING first; a task asleep in the kernel (a write
        # throttled under disk pressure) freezes only when it wakes, and v1 sends the
        # request again to those not frozen yet each time FROZEN is written.
        deadline = time.monotonic() + timeout
        while True:
            _write(self._dirs["freezer"] / "freezer.state", "FROZEN")
            again = min(time.monotonic() + _REFREEZE_S, deadline)
            while not self.frozen():
                if time.monotonic() > again:
                    break
                time.sleep(_POLL_S)
            else:
                return
            if time.monotonic() > deadline:
                raise CgroupError(f"cgroup {self.path} did not freeze within {timeout}s")

    def thaw(self) -> None:
        _write(self._dirs["freezer"] / "freezer.state", "THAWED")

    def frozen(self) -> bool:
        return _read(self._dirs["freezer"] / "freezer.state").strip() == "FROZEN"

    def oom_kills(self) -> int:
        # The "oom_kill" line of memory.oom_control exists since Linux 4.13; older
        # kernels do not count kills at all.
        return cgroup_files.count_in(self._oom_text(self._dirs["memory"] / "memory.oom_control"),
                                     "oom_kill")

    def memory_bytes(self) -> int:
        return int(_read(self._dirs["memory"] / "memory.usage_in_bytes"))

    def memory_peak_bytes(self) -> int:
        return int(_read(self._dirs["memory"] / "memory.max_usage_in_bytes"))

    def cpu_seconds(self) -> float:
        if "cpuacct" in self._dirs:
            return int(_read(self._dirs["cpuacct"] / "cpuacct.usage")) / 1e9
        stat = _keyed(self._dirs["cpu"] / "cpu.stat")
        if "usage_usec" not in stat:
            raise CgroupError("cannot measure CPU time: cpuacct is not mounted")
        return stat["usage_usec"] / 1e6


class CgroupV2(Cgroup):
    """A group on cgroup v2: one directory in the unified hierarchy."""

    @property
    def _dir(self) -> Path:
        return self._dirs[""]

    def freeze(self, timeout: float = 5.0) -> None:
        _write(self._dir / "cgroup.freeze", "1")
        self._wait_frozen(timeout)

    def thaw(self) -> None:
        _write(self._dir / "cgroup.freeze", "0")

    def frozen(self) -> bool:
        return _keyed(self._dir / "cgroup.events").get("frozen") == 1

    def _start_kill(self) -> None:
        # cgroup.kill (Linux 5.14) kills the whole subtree atomically, forks included.
        if (self._dir / "cgroup.kill").exists():
            _write(self._dir / "cgroup.kill", "1")
        else:
            self._kill_frozen()

    def oom_kills(self) -> int:
        return cgroup_files.count_in(self._oom_text(self._dir / "memory.events"), "oom_kill")

    def memory_bytes(self) -> int:
        return int(_read(self._dir / "memory.current"))

    def memory_peak_bytes(self) -> int:
        peak = self._dir / "memory.peak"  # Linux 5.19
        return int(_read(peak)) if peak.exists() else self.memory_bytes()

    def cpu_seconds(self) -> float:
        return _keyed(self._dir / "cpu.stat")["usage_usec"] / 1e6


def _fill_cpuset(d: Path, cpus: Sequence[int] = ()) -> None:
    """A new cpuset group has no CPUs and no memory nodes (v1; on v2 it inherits them):
    no task could join it. It starts with its parent's, or ``cpus`` (one write of
    ``cpuset.cpus``, a rebuild of the kernel's scheduling domains, not two). Idempotent:
    a concurrent create that finds the group made by another fills it too."""
    for name in ("cpuset.cpus", "cpuset.mems"):
        if ((d / name).exists() and (d.parent / name).exists()
                and not _read(d / name).strip()):
            value = (",".join(str(c) for c in cpus) if cpus and name == "cpuset.cpus"
                     else _read(d.parent / name).strip())
            _write(d / name, value)


class CgroupDriver:
    """Creates and finds groups on one cgroup version. Get one from :func:`detect`."""

    version: int
    _group_type: type[Cgroup]
    _prepared: set[Path]  # parent directories known to exist, prepared (create)
    memory_resets: tuple[str, ...] | None = None  # v1 counters a recycle zeroes (cgroup_recycle)

    def _roots(self) -> dict[str, Path]:
        """Controller (or "" on v2) -> root directory of its hierarchy."""
        raise NotImplementedError

    def _dirs(self, path: str) -> dict[str, Path]:
        return {k: root / _check_path(path) for k, root in self._roots().items()}

    def _set_limits(self, group: Cgroup, cpus: float, memory_mb: int, pids: int,
                    was: tuple[float, int, int] | None) -> None:  # those not as in ``was``
        raise NotImplementedError

    def _prepare_parent(self, parent: Path) -> None:
        """Called on the parent of every directory on the way to a group, root first."""

    def _made(self, d: Path, cpus: Sequence[int] = ()) -> None:
        """Called on every directory :meth:`create` made, parents first (``cpus``: the
        group's own cpuset, for its own directory)."""
        _fill_cpuset(d, cpus)

    def set_cpus(self, group: Cgroup, cpus: Sequence[int]) -> bool:
        """Confine ``group`` to the CPUs ``cpus`` (its cpuset); False where the host
        offers no cpuset controller to us (the launcher's affinity still applies)."""
        for d in group._hierarchies():
            if (d / "cpuset.cpus").exists():
                _write(d / "cpuset.cpus", ",".join(str(c) for c in cpus))
                return True
        return False

    def create(self, path: str, *, cpus: float, memory_mb: int, pids: int,
               cpuset: Sequence[int] = ()) -> Cgroup:
        """Make group ``path`` (and missing parents) in every hierarchy and set its limits.

        ``cpus`` becomes a CFS quota of ``cpus * 100 ms`` per 100 ms, ``memory_mb`` a
        hard memory limit with no swap, ``pids`` a cap on tasks; ``cpuset``, where
        given, the CPUs it may run on (as :meth:`set_cpus`, where a new group's cpuset
        is filled: v1). On failure whatever this call created is removed again.
        """
        _check_limits(cpus, memory_mb, pids)
        try:
            return self._create(path, cpus, memory_mb, pids, cpuset)
        except CgroupError as exc:  # (a parent removed meanwhile is made again)
            if not isinstance(exc.__cause__, FileNotFoundError):
                raise
        self._prepared.clear()
        return self._create(path, cpus, memory_mb, pids, cpuset)

    def _create(self, path: str, cpus: float, memory_mb: int, pids: int,
                cpuset: Sequence[int]) -> Cgroup:
        dirs = self._dirs(path)
        made: list[Path] = []
        try:
            for d, root in {d: self._roots()[k] for k, d in dirs.items()}.items():
                rel = d.relative_to(root)
                steps = [root / step for step in (*reversed(rel.parents[:-1]), rel)]
                known = d.parent in self._prepared  # no stat: it costs as much as a mkdir
                for here in steps[-1:] if known else steps:
                    if not known:
                        self._prepare_parent(here.parent)
                    if known or not here.is_dir():
                        try:
                            with _translated("create cgroup", here):
                                here.mkdir()
                                # 0755 whatever the umask: CRIU (docs/live.md) could not
                                # find a freezer under a 077 daemon's 0700 groups
                                os.chmod(here, 0o755)
                        except CgroupError as exc:
                            # another create made the same parent a moment ago
                            if not isinstance(exc.__cause__, FileExistsError):
                                raise
                            continue
                        made.append(here)
                        self._made(here, cpuset if here == d else ())
            group = self._group_type(path, dirs)
            self._set_limits(group, cpus, memory_mb, pids, None)
            group.limits = (cpus, memory_mb, pids)
            self._prepared.update(d.parent for d in dirs.values())
        except BaseException:
            for d in reversed(made):
                with suppress(OSError):
                    d.rmdir()
            raise
        return group

    def set_limits(self, group: Cgroup, *, cpus: float, memory_mb: int, pids: int) -> None:
        """Change the limits of an existing group (a warm slot gets its sandbox's limits):
        only those that differ from what this object last wrote (a default-size sandbox:
        none; after a failed write: all)."""
        _check_limits(cpus, memory_mb, pids)
        was, group.limits = group.limits, None  # unknown until every write is done
        if was != (cpus, memory_mb, pids):
            self._set_limits(group, cpus, memory_mb, pids, was)
        group.limits = (cpus, memory_mb, pids)

    def handle(self, path: str) -> Cgroup:
        """Group ``path`` whether it exists or not: a hibernated sandbox's old group,
        gone with its processes (removing it again changes nothing)."""
        return self._group_type(path, self._dirs(path))

    def open(self, path: str) -> Cgroup:
        """The existing group ``path``; :class:`~corral.errors.NotFound` if it is nowhere."""
        dirs = self._dirs(path)
        if not any(d.is_dir() for d in dirs.values()):
            raise errors.NotFound(f"cgroup {path} does not exist (cgroup v{self.version})")
        return self._group_type(path, dirs)

    def hierarchies(self) -> list[Path]:
        """The root directory of each hierarchy groups are made in."""
        return list(dict.fromkeys(self._roots().values()))

    def children(self, parent: str) -> list[str]:
        """Names of the child groups of ``parent`` found in any hierarchy."""
        return _child_names(self._dirs(parent).values())


class CgroupV1Driver(CgroupDriver):
    """cgroup v1: ``mounts`` maps each controller to its hierarchy's mount point."""

    version = 1
    _group_type = CgroupV1

    def __init__(self, mounts: dict[str, Path]) -> None:
        missing = [c for c in V1_CONTROLLERS if c not in mounts]
        if missing:
            raise errors.Unsupported(f"cgroup v1 controllers not mounted: {', '.join(missing)}")
        wanted = V1_CONTROLLERS + V1_OPTIONAL_CONTROLLERS
        self.mounts = {c: Path(m) for c, m in mounts.items() if c in wanted}
        # On v1 a hierarchy has cpuset files at every level or at none: only the one
        # holding the cpuset controller needs filling, and memsw exists or not for the
        # whole host. Known once, rather than asked of every directory of every create.
        self._cpuset_under = f"{mounts['cpuset']}/" if "cpuset" in mounts else None
        self._memsw: bool | None = None
        self._prepared: set[Path] = set()

    def _roots(self) -> dict[str, Path]:
        return self.mounts

    def _in_cpuset(self, d: Path) -> bool:
        return self._cpuset_under is not None and str(d).startswith(self._cpuset_under)

    def _prepare_parent(self, parent: Path) -> None:
        # a root's cpuset is the host's own
        if self._in_cpuset(parent) and parent not in self.mounts.values():
            _fill_cpuset(parent)

    def _made(self, d: Path, cpus: Sequence[int] = ()) -> None:
        if self._in_cpuset(d):
            _fill_cpuset(d, cpus)

    def set_cpus(self, group: Cgroup, cpus: Sequence[int]) -> bool:
        d = group._dirs.get("cpuset")
        if d is None:
            return super().set_cpus(group, cpus)
        _write(d / "cpuset.cpus", ",".join(str(c) for c in cpus))
        return True

    def _set_limits(self, group: Cgroup, cpus: float, memory_mb: int, pids: int,
                    was: tuple[float, int, int] | None) -> None:
        cpu, memory = group._dirs["cpu"], group._dirs["memory"]
        if was is None or was[0] != cpus:
            _write(cpu / "cpu.cfs_period_us", str(CFS_PERIOD_US))
            _write(cpu / "cpu.cfs_quota_us", str(_quota_us(cpus)))
        if was is None or was[2] != pids:
            _write(group._dirs["pids"] / "pids.max", str(pids))
        if was is not None and was[1] == memory_mb:
            return
        # memsw (memory + swap) must stay >= the memory limit: when a limit is raised
        # (a warm slot starts with the defaults) memsw goes first, else second. It
        # exists only when swap accounting is on, and without it there is no swap cap.
        limit, memsw = memory_mb << 20, memory / "memory.memsw.limit_in_bytes"
        order = [memory / "memory.limit_in_bytes"]
        if self._memsw is None:
            self._memsw = memsw.exists()
        if self._memsw:
            raising = (memory_mb > was[1] if was is not None
                       else limit > int(_read(memory / "memory.limit_in_bytes")))
            order = [memsw, *order] if raising else [*order, memsw]
        for path in order:
            _write(path, str(limit))


class CgroupV2Driver(CgroupDriver):
    """cgroup v2: ``root`` is the mount point of the ``cgroup2`` hierarchy."""

    version = 2
    _group_type = CgroupV2

    def __init__(self, root: Path) -> None:
        self.root = Path(root)
        self._prepared: set[Path] = set()

    def _roots(self) -> dict[str, Path]:
        return {"": self.root}

    def _prepare_parent(self, parent: Path) -> None:
        # A child only gets the controllers its parent delegates in subtree_control
        # (cpuset too, where the parent has it: corral.runtime.cpus).
        enabled = _read(parent / "cgroup.subtree_control").split()
        offered = (_read(parent / "cgroup.controllers").split()
                   if (parent / "cgroup.controllers").exists() else [])
        wanted = [*V2_CONTROLLERS, *(["cpuset"] if "cpuset" in offered else [])]
        if any(c not in enabled for c in wanted):
            _write(parent / "cgroup.subtree_control", " ".join(f"+{c}" for c in wanted))

    def _made(self, d: Path, cpus: Sequence[int] = ()) -> None:
        """Nothing to fill: a v2 group's empty ``cpuset.cpus`` means its parent's
        effective set (and the root group has no ``cpuset.cpus`` to copy)."""

    def _set_limits(self, group: Cgroup, cpus: float, memory_mb: int, pids: int,
                    was: tuple[float, int, int] | None) -> None:
        d = group._dirs[""]
        if was is None or was[0] != cpus:
            _write(d / "cpu.max", f"{_quota_us(cpus)} {CFS_PERIOD_US}")
        if was is None or was[1] != memory_mb:
            _write(d / "memory.max", str(memory_mb << 20))
        if was is None and (d / "memory.swap.max").exists():  # absent without swap accounting
            _write(d / "memory.swap.max", "0")
        if was is None or was[2] != pids:
            _write(d / "pids.max", str(pids))


def _cgroup_mounts(mountinfo: str) -> tuple[dict[str, Path], list[Path]]:
    """(v1 controller -> mount point, cgroup2 mount points) from a mountinfo file."""
    v1: dict[str, Path] = {}
    v2: list[Path] = []
    for line in Path(mountinfo).read_text().splitlines():
        before, _, after = line.partition(" - ")
        fields, tail = before.split(), after.split()
        if len(fields) < 5 or len(tail) < 3:
            continue
        mount_point = Path(unescape_mountinfo(fields[4]))
        if tail[0] == "cgroup2":
            v2.append(mount_point)
        elif tail[0] == "cgroup":
            for option in tail[2].split(","):
                v1.setdefault(option, mount_point)
    return v1, v2


def detect(*, mountinfo: str = MOUNTINFO) -> CgroupDriver:
    """The driver for the best cgroup version this host offers.

    Raises :class:`~corral.errors.Unsupported` when neither a usable v2 hierarchy nor
    the v1 controllers are available.
    """
    v1, v2 = _cgroup_mounts(mountinfo)
    for root in v2:
        try:
            available = (root / "cgroup.controllers").read_text().split()
        except OSError:
            continue
        if all(c in available for c in V2_CONTROLLERS):
            return CgroupV2Driver(root)
    missing = [c for c in V1_CONTROLLERS if c not in v1]
    if not missing:
        return CgroupV1Driver(v1)
    raise errors.Unsupported(
        "no usable cgroups: need a cgroup2 mount with the cpu, memory and pids "
        f"controllers, or cgroup v1 with {', '.join(V1_CONTROLLERS)} mounted "
        f"(missing v1: {', '.join(missing)}); mount them or enable them in the kernel",
        details={"v1_mounted": sorted(v1), "v2_mounts": [str(p) for p in v2]},
    )
