"""A full disk under the state directory is a typed error, never a traceback.

When the filesystem holding the daemon's state directory (its SQLite registry, the
sandboxes' directories) or its cache fills up, ``ENOSPC``/``EDQUOT`` and SQLite's
"database or disk is full" become :class:`~corral.errors.StorageFull` (507), naming
the path that is full. The registry's connection translates SQLite's errors itself
(:class:`Connection`, ``sqlite3.connect(factory=...)``); the engine translates the
rest with :func:`full_error` after undoing what it had begun.
"""

from __future__ import annotations

import errno
import os
import sqlite3
from pathlib import Path
from typing import Any, Callable, TypeVar

from corral.errors import StorageFull

T = TypeVar("T")

_FULL_ERRNOS = (errno.ENOSPC, errno.EDQUOT)
_SQLITE_FULL = 13  # SQLITE_FULL
# What an engine needs free to start: its lock, registry (and journal), directories and,
# on the first start, the agent binary. Less, and it refuses to start (check_room).
MIN_FREE_BYTES = 1 << 20
MIN_FREE_INODES = 64
# What snapshots and stopped sandboxes' kept files leave free on the disk under the
# state directory (the larger of the two): a stream of them, each as large as its
# sandbox's disk_mb (a client's or a sandbox's loop), cannot fill the host's disk.
RESERVE_BYTES = 1 << 30
RESERVE_FRACTION = 0.10


def room_above_reserve(path: Path) -> int:
    """Bytes that may still be written under ``path`` before its filesystem's free
    space falls to its reserve (negative: below it already)."""
    vfs = os.statvfs(path)
    reserve = max(RESERVE_BYTES, int(vfs.f_blocks * vfs.f_frsize * RESERVE_FRACTION))
    return vfs.f_bavail * vfs.f_frsize - reserve


def _free(path: Path) -> str:
    try:
        st = os.statvfs(path)
    except OSError:
        return ""
    return f"; {st.f_bavail * st.f_frsize >> 20} MiB and {st.f_favail} inodes free there"


def check_room(path: Path, state_dir: Path) -> None:
    """:class:`StorageFull` naming ``path`` (or its nearest existing parent) and the
    space left there, if its filesystem has less free than an engine needs to start."""
    where = Path(path).absolute()
    while not where.exists() and where != where.parent:  # bounded by the path's depth
        where = where.parent
    try:
        st = os.statvfs(where)
    except OSError:
        return
    free, inodes = st.f_bavail * st.f_frsize, st.f_favail
    # Some filesystems (btrfs) report no inode counts at all: then inodes do not run out.
    short_inodes = st.f_files > 0 and inodes < MIN_FREE_INODES
    if free >= MIN_FREE_BYTES and not short_inodes:
        return
    raise StorageFull(
        f"cannot start: the filesystem holding {path} is full{_free(where)} (at least "
        f"{MIN_FREE_BYTES >> 20} MiB and {MIN_FREE_INODES} inodes are needed; corral's "
        f"state directory is {state_dir}); free space or inodes there and start again",
        details={"path": str(path), "free_bytes": free, "free_inodes": inodes},
    )


def _sqlite_full(exc: BaseException) -> bool:
    if not isinstance(exc, sqlite3.Error):
        return False
    code = getattr(exc, "sqlite_errorcode", None)
    return code is not None and code & 0xFF == _SQLITE_FULL or "disk is full" in str(exc)


def full_error(exc: BaseException, state_dir: Path) -> StorageFull | None:
    """``exc`` as a :class:`StorageFull` if it says a filesystem is full, else None."""
    if isinstance(exc, StorageFull):
        return exc
    if isinstance(exc, OSError) and exc.errno in _FULL_ERRNOS:
        where = Path(exc.filename) if exc.filename else state_dir
        kind = "quota" if exc.errno == errno.EDQUOT else "filesystem"
        return StorageFull(
            f"the {kind} holding {where} is full (corral's state directory is {state_dir}): "
            f"{exc.strerror}{_free(where.parent if exc.filename else where)}; "
            "free space or inodes there and retry",
            details={"path": str(where), "errno": exc.errno},
        )
    if _sqlite_full(exc):
        return StorageFull(
            f"the filesystem holding corral's state directory {state_dir} is full: its "
            f"registry (SQLite) cannot be written ({exc}){_free(state_dir)}; free space "
            "there and retry",
            details={"path": str(state_dir), "sqlite": str(exc)},
        )
    return None


class Connection(sqlite3.Connection):
    """A registry connection whose "disk is full" is :class:`StorageFull`."""

    def _typed(self, exc: sqlite3.Error) -> BaseException:
        path = Path(self.execute("PRAGMA database_list").fetchone()[2] or ".").parent
        return full_error(exc, path) or exc

    def _call(self, method: Callable[..., T], *args: Any) -> T:
        try:
            return method(self, *args)
        except sqlite3.Error as exc:
            if not _sqlite_full(exc):
                raise
            raise self._typed(exc) from exc

    def execute(self, *args: Any) -> sqlite3.Cursor:
        return self._call(sqlite3.Connection.execute, *args)

    def executemany(self, *args: Any) -> sqlite3.Cursor:
        return self._call(sqlite3.Connection.executemany, *args)

    def commit(self) -> None:
        self._call(sqlite3.Connection.commit)
