"""Cgroup control files, read and written one way (below :mod:`corral.runtime.cgroups`).

Every ``OSError`` on a control file becomes a :class:`CgroupError` here; ``cgroups.py``
builds the groups and drivers on these.
"""

from __future__ import annotations

import os
import signal
from collections.abc import Iterable, Iterator
from contextlib import contextmanager
from pathlib import Path

from corral import errors

CFS_PERIOD_US = 100_000


class CgroupError(errors.InternalError):
    """A cgroup operation failed (a limit could not be set, a group would not empty)."""

    code = "cgroup_failed"  # its own: a code names one class (tests/test_error_codes.py)


@contextmanager
def translated(what: str, path: Path) -> Iterator[None]:
    """The one place where an ``OSError`` on a cgroup file becomes a :class:`CgroupError`."""
    try:
        yield
    except OSError as exc:
        details = {"path": str(path), "errno": exc.errno}
        raise CgroupError(f"cannot {what} {path}: {exc.strerror}", details=details) from exc


def write(path: Path, value: str) -> None:
    # No O_CREAT: a missing control file means the kernel lacks the feature, and
    # that must fail loudly instead of leaving a stray regular file.
    with translated(f"write {value!r} to", path):
        fd = os.open(path, os.O_WRONLY | os.O_TRUNC)
        try:
            os.write(fd, value.encode())
        finally:
            os.close(fd)


def read(path: Path) -> str:
    # os.read, not Path.read_text: a control file needs no buffered text stream (which
    # costs an fstat, an ioctl and a seek besides the read)
    with translated("read", path):
        fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
        try:
            data = chunk = os.read(fd, 65536)
            while chunk:
                chunk = os.read(fd, 65536)
                data += chunk
        finally:
            os.close(fd)
        return data.decode()


def keyed(path: Path) -> dict[str, int]:
    """Parse a flat-keyed file such as ``cpu.stat`` or ``memory.events``."""
    out = {}
    for line in read(path).splitlines():
        key, _, value = line.partition(" ")
        if value.strip().lstrip("-").isdigit():
            out[key] = int(value)
    return out


def pread_text(fd: int, path: Path) -> str:
    """The whole of the control file open as ``fd`` (``path``: for the error), read from
    its start: each read at offset 0 makes the kernel show the file afresh."""
    with translated("read", path):
        data = chunk = os.pread(fd, 65536, 0)
        while len(chunk) == 65536:
            chunk = os.pread(fd, 65536, len(data))
            data += chunk
        return data.decode()


def count(path: Path, key: str) -> int:
    """The value of one ``key value`` line of a flat-keyed file (0 if absent)."""
    return count_in(read(path), key)


def count_in(text: str, key: str) -> int:
    """The value of one ``key value`` line of a flat-keyed file's ``text`` (0 if absent)."""
    for line in text.splitlines():
        name, _, value = line.partition(" ")
        if name == key:
            value = value.strip()
            return int(value) if value.lstrip("-").isdigit() else 0
    return 0


def sigkill(pids: Iterable[int]) -> None:
    for pid in pids:
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass


def child_names(dirs: Iterable[Path]) -> list[str]:
    # In every version each subdirectory of a group is a child group.
    return sorted({c.name for d in set(dirs) if d.is_dir() for c in d.iterdir() if c.is_dir()})


def quota_us(cpus: float) -> int:
    return max(1000, round(cpus * CFS_PERIOD_US))  # the kernel refuses quotas under 1 ms


def effective_cpus(cpus: float) -> float:
    """The CPUs a sandbox asking ``cpus`` gets (at least 0.01: the smallest CFS quota)."""
    return quota_us(cpus) / CFS_PERIOD_US


def check_path(path: str) -> str:
    parts = path.strip("/").split("/")
    if not path or path.startswith("/") or any(p in ("", ".", "..") for p in parts):
        raise errors.InvalidArgument(
            f"invalid cgroup path {path!r}: use a relative path like 'corral/e1/sb-abc'"
        )
    return path


def check_limits(cpus: float, memory_mb: int, pids: int) -> None:
    if not cpus > 0 or memory_mb <= 0 or pids <= 0:
        raise errors.InvalidArgument(f"cgroup limits must be positive (cpus={cpus}, "
                                     f"memory_mb={memory_mb}, pids={pids})")
