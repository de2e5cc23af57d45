"""Every raw syscall the engine makes, in one place (ctypes over libc).

Each wrapper raises ``OSError`` on failure, with errno and the path involved.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import errno
import os
import re
from functools import lru_cache

MNT_DETACH = 0x2
UMOUNT_NOFOLLOW = 0x8
AT_FDCWD = -100
RENAME_EXCHANGE = 0x2
CLONE_NEWNET = 0x40000000
KCMP_VM = 1
_KCMP_NR = {"x86_64": 312, "aarch64": 272, "riscv64": 272, "ppc64le": 354, "s390x": 343}


@lru_cache(maxsize=1)
def _libc() -> ctypes.CDLL:
    libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6", use_errno=True)
    libc.mount.argtypes = [ctypes.c_char_p, ctypes.c_char_p, ctypes.c_char_p, ctypes.c_ulong, ctypes.c_char_p]
    libc.mount.restype = ctypes.c_int
    libc.umount2.argtypes = [ctypes.c_char_p, ctypes.c_int]
    libc.umount2.restype = ctypes.c_int
    libc.statfs.argtypes = [ctypes.c_char_p, ctypes.c_char_p]
    libc.statfs.restype = ctypes.c_int
    libc.syncfs.argtypes = [ctypes.c_int]
    libc.syncfs.restype = ctypes.c_int
    libc.sync_file_range.argtypes = [ctypes.c_int, ctypes.c_int64, ctypes.c_int64, ctypes.c_uint]
    libc.sync_file_range.restype = ctypes.c_int
    libc.renameat2.argtypes = [ctypes.c_int, ctypes.c_char_p, ctypes.c_int, ctypes.c_char_p,
                               ctypes.c_uint]
    libc.renameat2.restype = ctypes.c_int
    libc.setns.argtypes = [ctypes.c_int, ctypes.c_int]
    libc.setns.restype = ctypes.c_int
    libc.connect.argtypes = [ctypes.c_int, ctypes.c_char_p, ctypes.c_uint]
    libc.connect.restype = ctypes.c_int
    return libc


def malloc_trim() -> bool:
    """Give the heap's free memory back to the system (glibc's ``malloc_trim(0)``);
    False where the C library has none (musl). Freed memory otherwise stays in the
    process: glibc returns only what sits at the top of its heaps, and megabytes of
    output buffers freed between live objects never are."""
    trim = getattr(_libc(), "malloc_trim", None)
    if trim is None:
        return False
    trim.argtypes = [ctypes.c_size_t]
    trim.restype = ctypes.c_int
    return bool(trim(0))


def _check(rc: int, what: str, path: str) -> None:
    if rc != 0:
        err = ctypes.get_errno()
        raise OSError(err, f"{what}: {os.strerror(err)}", path)


def reset_tcp(fd: int) -> None:
    """Abort the TCP connection of socket ``fd`` with a reset to its peer, the descriptor
    kept (its owner reads the end): connect(2) to ``AF_UNSPEC`` (Linux's disconnect).
    Best effort: one already gone stays so."""
    if fd >= 0:
        unspec = bytes(16)  # sa_family 0: AF_UNSPEC
        _libc().connect(fd, unspec, len(unspec))


def setns_net(fd: int, what: str) -> None:
    """setns(2) into the network namespace ``fd``: the calling *thread* only."""
    _check(_libc().setns(fd, CLONE_NEWNET), "setns", what)


def mount(source: str, target: str, fstype: str, flags: int = 0, data: str = "") -> None:
    """mount(2); sandbox roots are mounted by the launcher in C, this serves tests and tools."""
    rc = _libc().mount(
        source.encode(), target.encode(), fstype.encode(), flags, data.encode() or None
    )
    _check(rc, f"mount {fstype}", target)


def umount(target: str, *, lazy: bool = False) -> bool:
    """Unmount ``target``; False if it was not mounted. Lazy detaches a busy mount."""
    flags = UMOUNT_NOFOLLOW | (MNT_DETACH if lazy else 0)
    rc = _libc().umount2(target.encode(), flags)
    if rc != 0:
        err = ctypes.get_errno()
        if err in (errno.EINVAL, errno.ENOENT):
            return False
        if err == errno.EBUSY and not lazy:
            return umount(target, lazy=True)
        raise OSError(err, f"umount: {os.strerror(err)}", target)
    return True


TMPFS_MAGIC = 0x01021994


def fs_type(path: str) -> int:
    """``statfs(2)``'s ``f_type`` of the filesystem holding ``path`` (``os.statvfs``
    has no such field), e.g. :data:`TMPFS_MAGIC`."""
    buf = ctypes.create_string_buffer(256)  # struct statfs (120 bytes), f_type first
    _check(_libc().statfs(os.fsencode(path), buf), "statfs", path)
    return ctypes.c_long.from_buffer(buf).value


def syncfs(path: str) -> None:
    """Write back everything dirty on the filesystem holding ``path``: one call instead
    of an fsync per file (each of which would wait for its own journal commit)."""
    fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    try:
        _check(_libc().syncfs(fd), "syncfs", path)
    finally:
        os.close(fd)


SYNC_FILE_RANGE_WRITE = 0x2


def start_writeback(fd: int, offset: int, nbytes: int) -> None:
    """Start writing a just-written range of ``fd`` to disk, without waiting
    (sync_file_range ``SYNC_FILE_RANGE_WRITE``): a copy that kicks each chunk off this
    way finds little left to wait for at its ``syncfs``, the disk's writeback overlapping
    the copy. Best effort: only an optimisation (not durable by itself; never raises)."""
    _libc().sync_file_range(fd, offset, nbytes, SYNC_FILE_RANGE_WRITE)


def rename_exchange(a: str, b: str) -> None:
    """Swap two paths in one step (renameat2 RENAME_EXCHANGE): replacing a directory by
    a new one this way, readers see the old or the new, never neither."""
    rc = _libc().renameat2(AT_FDCWD, os.fsencode(a), AT_FDCWD, os.fsencode(b), RENAME_EXCHANGE)
    _check(rc, f"exchange with {b}", a)


def mounts_under(prefix: str) -> list[str]:
    """Mount points at or below ``prefix``, deepest first (the order to unmount them)."""
    prefix = prefix.rstrip("/") + "/"
    points = []
    with open("/proc/self/mountinfo") as f:
        for line in f:
            # mountinfo escapes space, tab, newline and backslash as \ooo (octal)
            point = re.sub(r"\\([0-7]{3})", lambda m: chr(int(m.group(1), 8)), line.split()[4])
            if (point + "/").startswith(prefix):
                points.append(point)
    return sorted(set(points), key=lambda p: (-p.count("/"), p))


def process_start_time(pid: int) -> int | None:
    """The start time (clock ticks since boot) of ``pid``, to detect pid reuse."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            data = f.read()
    except OSError:
        return None
    # The command name may contain spaces and parentheses: split after the last ')'.
    fields = data[data.rindex(b")") + 2 :].split()
    return int(fields[19])


def same_vm(pid_a: int, pid_b: int) -> bool | None:
    """Whether two processes share one address space: kcmp(2) ``KCMP_VM`` (a vfork
    child shares its parent's until it execs). None where kcmp cannot tell (an
    architecture without its number here, a process gone, no permission)."""
    nr = _KCMP_NR.get(os.uname().machine)
    if nr is None:
        return None
    rc = _libc().syscall(nr, ctypes.c_int(pid_a), ctypes.c_int(pid_b), ctypes.c_int(KCMP_VM),
                         ctypes.c_ulong(0), ctypes.c_ulong(0))
    return None if rc < 0 else rc == 0
