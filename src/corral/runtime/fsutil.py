"""Filesystem helpers of the image store: locks, atomic writes, safe removal.

Shared by :mod:`corral.runtime.images`, :mod:`corral.runtime.debian` and the image
build and import modules. Removal refuses to descend into anything still mounted.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import hashlib
import os
import re
import stat
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

from corral.errors import InternalError
from corral.runtime import syscalls
from corral.runtime.treecopy import listings, remove_tree


@contextlib.contextmanager
def _flock(path: Path, on_wait: Callable[[], Any] | None = None) -> Iterator[None]:
    fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o644)
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            if on_wait is not None:
                on_wait()
            fcntl.flock(fd, fcntl.LOCK_EX)
        yield
    finally:
        os.close(fd)  # closing the last descriptor releases the lock


def try_lock(path: Path) -> int | None:
    """A descriptor of ``path`` (made 0600) holding its exclusive flock, or None if
    another process holds it (the lock lives as long as the descriptor)."""
    fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o600)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError as exc:
        os.close(fd)
        if exc.errno in (errno.EWOULDBLOCK, errno.EAGAIN):
            return None
        raise
    return fd


def _write_atomic(path: Path, text: str, mode: int = 0o644) -> None:
    """tmp file + fsync + rename: ``path`` holds the old text or the new, never half.

    Inside a rootfs this is also safe from symlinks: the rename replaces a link at
    ``path`` instead of writing through it to wherever it points.
    """
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_CLOEXEC, mode)
    try:
        with os.fdopen(fd, "w") as f:
            f.write(text)
            f.flush()
            os.fsync(f.fileno())
        os.chmod(tmp, mode)
        os.rename(tmp, path)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        raise
    _fsync_dir(path.parent)


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _empty_dir(path: Path) -> None:
    if path.is_symlink() or not path.is_dir():
        if os.path.lexists(path):
            _rm(path)
        path.mkdir(mode=0o755)
        return
    for child in path.iterdir():
        _rm(child)


def _scan_tree(rootfs: Path) -> tuple[int, str]:
    """Apparent size (hard links once) and a sha256 of the tree's listing (each
    directory's entries in name order, then its subdirectories', as ``os.walk`` gave
    them). Iterative and descriptor-relative: an image's tree may be thousands of
    levels deep (os.walk recursed past Python's limit: an import was a 500)."""
    digest = hashlib.sha256()
    seen: set[tuple[int, int]] = set()
    size = 0
    for rel, fd, name, st in listings(rootfs):
        link = os.readlink(name, dir_fd=fd) if stat.S_ISLNK(st.st_mode) else ""
        digest.update(f"{rel}\0{st.st_mode:o}\0{st.st_uid}\0{st.st_gid}\0{st.st_size}\0"
                      f"{st.st_mtime_ns}\0{link}\n".encode("utf-8", "surrogateescape"))
        if (st.st_dev, st.st_ino) not in seen:
            seen.add((st.st_dev, st.st_ino))
            size += st.st_size
    return size, digest.hexdigest()


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        pass  # alive, only not ours
    return True


def _mounts_below(path: Path) -> list[str]:
    return syscalls.mounts_under(str(path.resolve()) if path.exists() else str(path))


def _unmount_below(path: Path) -> None:
    """Unmount whatever an interrupted debootstrap left mounted (proc, sys, dev) in ``path``."""
    for mountpoint in _mounts_below(path):  # deepest first
        try:
            syscalls.umount(mountpoint, lazy=True)
        except OSError:
            pass


def _remove_tree(path: Path) -> None:
    """Delete ``path``; refuses to descend into anything still mounted below it."""
    path = Path(path)
    if not os.path.lexists(path):
        return
    if path.is_dir() and not path.is_symlink():
        _unmount_below(path)
        if _mounts_below(path):
            raise InternalError(f"cannot delete {path}: something is still mounted below it",
                                details={"path": str(path)})
    _rm(path)


def _rm(path: Path) -> None:
    """Delete a file, link or tree inside a rootfs that has nothing mounted in it."""
    remove_tree(path)  # iterative: a tree deeper than the recursion limit goes too



def unescape_mountinfo(field: str) -> str:
    """A field of ``/proc/*/mountinfo``, where space, tab, newline and backslash are
    escaped as ``\\ooo`` (octal)."""
    return re.sub(r"\\([0-7]{3})", lambda m: chr(int(m.group(1), 8)), field)
