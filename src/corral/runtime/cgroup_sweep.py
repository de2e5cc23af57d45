"""Cgroups of dead engines: swept when an engine starts, never a live engine's.

Each engine keeps its sandboxes' groups under ``corral-<key>`` at the top of every
hierarchy (``corral/<key>`` on the older layout: :func:`.reconcile.engine_cgroup_parent`),
``<key>`` naming its state directory. Its warden removes them when the engine dies; if
both are killed (``kill -9`` of both, the OOM killer, a crashed test run) the groups of
that key, and the child groups of its sandboxes, would stay for good. So every engine,
when it starts, sweeps the groups of the keys whose engine is dead.

Liveness is a lock a key, machine-wide (beside the uid blocks' locks, :mod:`.uids`)::

    <run dir>/cgroups/<key>.lock    flock'd by the live engine of <key>, and its warden

:meth:`Engine.open` takes its key's lock (:meth:`KeyLock.take`) before it makes or removes
any group and keeps it until it has closed; its warden inherits it and keeps it while
it cleans up after a dead engine or holds its sandboxes for a live restore. A sweep
takes a key's lock without waiting: if it gets it, no engine of that key runs or can
start until the sweep lets go (an engine starting meanwhile waits for it, bounded), so
a sweep never races a live engine; if not, the key is alive (or another engine is
sweeping it) and is skipped. A key some process names in its arguments as a warden
does is skipped too: an engine of an older version takes no key lock, but has a warden
from before it makes its first group until its groups are gone (such an engine that
starts on a dead key while it is swept is the one race left: its first create retries
once if a parent group went meanwhile). The lock file is removed by whoever holds it last (the
engine on a clean close, the sweep), and a holder checks after locking that the file
it locked is still the one at its path.

What a sweep removes: directories named exactly like an engine's group
(``corral-e`` + 10 hex digits, or ``e`` + 10 hex digits under ``corral``), each
subtree bottom up, with ``rmdir`` only: the kernel refuses (EBUSY) a group that holds
a process or a child group, so no group in use can go, whatever its name. A sweep
kills nothing: a dead key's group that still holds processes is reported (a warning,
and :attr:`Swept.busy`) and left for the warden or the next engine of that state
directory (:func:`.reconcile.reconcile`), which know what those processes are.
Bounded: at most :data:`MAX_KEYS` keys and :data:`MAX_DIRS` directories a sweep, and
:data:`SWEEP_S` seconds; of each process's arguments, :data:`CMDLINE_BYTES`.
"""

from __future__ import annotations

import errno
import fcntl
import logging
import os
import re
import time
from collections.abc import Collection
from contextlib import suppress
from dataclasses import dataclass, field
from pathlib import Path

from corral.errors import InvalidState

__all__ = ["MAX_DIRS", "MAX_KEYS", "SWEEP_S", "KeyLock", "Swept", "sweep"]

logger = logging.getLogger("corral.runtime")

MAX_KEYS = 256  # dead keys looked at in one sweep (the rest: the next start's)
MAX_DIRS = 20_000  # directories removed or tried in one sweep
SWEEP_S = 10.0  # and for how long
# of each process's arguments, read at most (a warden names its groups in ~1 KB; a
# sandbox's process may have 6 MiB of them, each of its pids, visible in /proc)
CMDLINE_BYTES = 64 << 10
HOLD_WAIT_S = 30.0  # how long an engine waits for its key (a sweep, a dead engine's warden)
LEGACY_PARENT = "corral"
_KEY = re.compile(r"e[0-9a-f]{10}")  # :attr:`.paths.Layout.engine_key`
_TOP = re.compile(r"corral-(e[0-9a-f]{10})")
_NAMED = re.compile(rb"/corral-(e[0-9a-f]{10})/?$|/corral/(e[0-9a-f]{10})/?$")


@dataclass
class Swept:
    """What one sweep did."""

    removed: list[str] = field(default_factory=list)  # groups removed (each hierarchy's)
    busy: list[str] = field(default_factory=list)  # dead keys' groups holding processes
    live: list[str] = field(default_factory=list)  # keys skipped: their engine holds them
    left: int = 0  # keys not looked at (the bounds)


def _lock_path(lock_dir: Path, key: str) -> Path:
    if not _KEY.fullmatch(key):
        raise ValueError(f"not an engine key: {key!r}")
    return lock_dir / f"{key}.lock"


def _try_hold(lock_dir: Path, key: str) -> int | None:
    """A descriptor holding ``key``'s lock, or None if another holds it (or its path
    is not a plain file of ours: never followed, never taken)."""
    lock_dir.mkdir(mode=0o700, parents=True, exist_ok=True)
    path = _lock_path(lock_dir, key)
    for _ in range(8):  # (each retry: a holder removed the file as we opened it)
        try:
            fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC | os.O_NOFOLLOW, 0o600)
        except OSError as exc:
            if exc.errno == errno.ELOOP:
                return None
            raise
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            os.close(fd)
            return None
        try:
            same = os.stat(path, follow_symlinks=False).st_ino == os.fstat(fd).st_ino
        except FileNotFoundError:
            same = False
        if same:
            return fd
        os.close(fd)
    return None


class KeyLock:
    """An engine's hold on its key (:meth:`take`), kept until :meth:`release`."""

    def __init__(self, lock_dir: Path, key: str, fd: int) -> None:
        self.lock_dir, self.key, self.fd = lock_dir, key, fd

    @classmethod
    def take(cls, lock_dir: Path, key: str, wait: float = HOLD_WAIT_S) -> "KeyLock":
        """Take ``key``'s lock for an engine that starts, waiting up to ``wait`` seconds
        for a sweep or a dead engine's warden to let go."""
        deadline = time.monotonic() + wait
        while (fd := _try_hold(lock_dir, key)) is None:
            if time.monotonic() > deadline:
                raise InvalidState(
                    f"the cgroups of engine {key} are held by another process "
                    f"({_lock_path(lock_dir, key)}): another engine on the same state "
                    "directory, or the warden of a dead one still cleaning up; wait, or "
                    "stop it")
            time.sleep(0.02)
        return cls(lock_dir, key, fd)

    def __del__(self) -> None:  # an engine that failed to open: let go, as its lock file does
        self.release(remove=False)

    def release(self, *, remove: bool = True) -> None:
        """Let go; with ``remove``, remove the lock's file first (only while no other
        process shares the lock: not when a warden keeps it for a live restore)."""
        if self.fd < 0:
            return
        fd, self.fd = self.fd, -1
        try:
            if remove:
                with suppress(FileNotFoundError):
                    os.unlink(_lock_path(self.lock_dir, self.key))
        finally:
            os.close(fd)


def _subdirs(d: Path) -> list[str]:
    try:
        return [e.name for e in os.scandir(d) if e.is_dir(follow_symlinks=False)]
    except OSError:
        return []


def _engine_groups(roots: list[Path]) -> dict[str, list[Path]]:
    """Key -> its top groups, in every hierarchy, both layouts."""
    found: dict[str, list[Path]] = {}
    for root in roots:
        for name in _subdirs(root):
            if m := _TOP.fullmatch(name):
                found.setdefault(m[1], []).append(root / name)
        for name in _subdirs(root / LEGACY_PARENT):
            if _KEY.fullmatch(name):
                found.setdefault(name, []).append(root / LEGACY_PARENT / name)
    return found


def _named_keys() -> set[str]:
    """Keys some process names a group of in its arguments, as every engine's warden
    does (``warden.py ... -- DIR...``), of this version or an older one that takes no
    key lock: those engines are alive. Anyone can name a key so: that only keeps its
    groups (a sweep leaves what it cannot prove dead)."""
    keys: set[str] = set()
    for pid in os.listdir("/proc"):
        if not pid.isdigit():
            continue
        try:
            with open(f"/proc/{pid}/cmdline", "rb") as f:
                args = f.read(CMDLINE_BYTES).split(b"\0")
        except OSError:
            continue
        for arg in args:
            if m := _NAMED.search(arg):
                keys.add((m[1] or m[2]).decode())
    return keys


def _has_processes(d: Path) -> bool:
    try:
        return bool((d / "cgroup.procs").read_text().split())
    except OSError:
        return False


def _remove_tree(top: Path, swept: Swept, budget: list[int]) -> None:
    """Remove ``top``'s empty groups, children first; report those holding processes."""
    order: list[Path] = []
    stack = [top]
    while stack and len(order) < budget[0]:
        d = stack.pop()
        order.append(d)
        stack.extend(d / n for n in _subdirs(d))
    budget[0] -= len(order)
    for d in reversed(order):  # every child before its parent
        try:
            d.rmdir()
            swept.removed.append(str(d))
        except FileNotFoundError:
            continue
        except OSError as exc:
            if exc.errno == errno.EBUSY and _has_processes(d):
                swept.busy.append(str(d))
                logger.warning("cgroup %s of a dead corral engine still holds processes: "
                               "left as it is (its state directory's next engine kills "
                               "them)", d)


def _forget_stale_locks(lock_dir: Path, skip: set[str], limit: int) -> None:
    """Remove the lock files no process holds whose key has no group (a warden that
    cleaned up after a failed live restore leaves its key's file)."""
    try:
        names = [e.name for e in os.scandir(lock_dir)]
    except OSError:
        return
    keys = [n[:-5] for n in names if n.endswith(".lock") and _KEY.fullmatch(n[:-5])]
    for key in [k for k in keys if k not in skip][:limit]:
        if (fd := _try_hold(lock_dir, key)) is not None:
            KeyLock(lock_dir, key, fd).release()


def sweep(roots: list[Path], lock_dir: Path, *, own: str | None = None,
          only: Collection[str] | None = None, max_keys: int = MAX_KEYS,
          max_dirs: int = MAX_DIRS, seconds: float = SWEEP_S) -> Swept:
    """Remove the empty groups of every dead engine found under the hierarchy roots
    ``roots`` (:meth:`.cgroups.CgroupDriver.hierarchies`); ``own``: the caller's key,
    never looked at; ``only``: look at these keys alone. See the module's docstring
    for what is and is not removed."""
    swept, budget = Swept(), [max_dirs]
    deadline = time.monotonic() + seconds
    found = _engine_groups(roots)
    keys = [k for k in sorted(found) if k != own and (only is None or k in only)]
    named: set[str] | None = None  # read once a key's lock is free (rarely: a dead key)
    for n, key in enumerate(keys):
        if n >= max_keys or budget[0] <= 0 or time.monotonic() > deadline:
            swept.left = len(keys) - n
            break
        fd = _try_hold(lock_dir, key)
        if fd is not None:
            named = _named_keys() if named is None else named
            if key in named:  # an older engine's, alive
                KeyLock(lock_dir, key, fd).release()
                fd = None
        if fd is None:
            swept.live.append(key)
            continue
        try:
            for top in found[key]:
                _remove_tree(top, swept, budget)
        finally:
            KeyLock(lock_dir, key, fd).release()
    if only is not None:
        return swept
    _forget_stale_locks(lock_dir, set(found) | {own or ""}, max_keys)
    for root in roots:  # the older layout's shared parent, once no engine has a group there
        legacy = root / LEGACY_PARENT
        if legacy.is_dir() and not _subdirs(legacy):
            try:
                legacy.rmdir()
            except OSError:
                pass  # in use again (EBUSY: the kernel refuses a group in use)
    return swept
