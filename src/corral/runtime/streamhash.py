"""Hashing a staged copy's files while they are being copied, not after.

A snapshot commit copies the sandbox's writable layer (frozen), then checksums the copy
(:func:`corral.runtime.layers.tree_digest`). For large files the checksum is the longer
part, and it would read every byte a second time after the copy. A :class:`Hasher`
follows the copy instead: as each chunk of a *destination* file is written, a worker
thread hashes that chunk, reading it back from the destination (from the page cache
the copy just filled), so the hashing overlaps the copying and most of it is done when
the sandbox is thawed.

What it hashes is the staged copy itself, exactly as ``tree_digest`` would read it: the
digest of a layer never depends on trusting the source. A result is only used when the
file is still what was hashed (same inode, size, and a single data extent covering it:
:meth:`Hasher.lookup`); anything else (a short copy, a sparse file, a failed read) is
simply not cached and ``tree_digest`` hashes the file itself.
"""

from __future__ import annotations

import hashlib
import os
import threading
from concurrent.futures import Future, ThreadPoolExecutor

MIN_SIZE = 1 << 20  # smaller files: hashing them at seal is cheaper than a hand-off
CHUNK = 8 << 20  # bytes copied, then handed to the worker, at a time
MAX_OPEN = 16  # files being hashed at once (each holds a descriptor until hashed)


def spare_cpu() -> bool:
    """Whether a CPU is idle enough to hash beside the copy (the 1-minute load average
    at least one below the CPUs this process may use). Measured (issue 30): with idle
    cores the commit of a 50 MB file takes 0.8x the time, the copy unchanged; on a
    saturated host the hashing thread only takes the copy's CPU, and the sandbox stays
    frozen longer."""
    return os.getloadavg()[0] + 1 <= len(os.sched_getaffinity(0))


NICE = 5  # the worker's niceness: on a busy host the frozen copy goes first


def _yield_to_copy() -> None:
    """Lower the worker thread's priority (Linux: niceness is per thread), so that it
    hashes with spare CPU and never lengthens the sandbox's frozen window by much."""
    try:
        os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), NICE)
    except OSError:
        pass


class _File:
    """One destination file being hashed, chunk after chunk, by the worker (in order)."""

    def __init__(self, fd: int, size: int) -> None:
        self.fd, self.size = fd, size
        self.h = hashlib.sha256()
        self.done = 0  # bytes hashed
        self.ok = True

    def hash_range(self, end: int) -> None:  # in the worker
        while self.ok and self.done < end:
            chunk = os.pread(self.fd, min(end - self.done, 1 << 20), self.done)
            if not chunk:
                self.ok = False
                break
            self.h.update(chunk)
            self.done += len(chunk)


class Hasher:
    """Content hashes of a staged tree's large files, computed behind their copy.
    ``start`` a file (the copy's open destination), ``feed`` it as its bytes land,
    ``finish`` it; :meth:`lookup` the results after :meth:`wait`; :meth:`close` always."""

    def __init__(self) -> None:
        self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="corral-hash",
                                        initializer=_yield_to_copy)
        self._lock = threading.Lock()
        self._open: set[int] = set()  # dup'd descriptors not yet closed
        self._last: Future[None] | None = None
        self.results: dict[tuple[int, int], tuple[int, bytes]] = {}  # (dev, ino) -> size, hex
        self._stale: set[tuple[int, int]] = set()  # files removed: their inode may be reused

    def start(self, fd: int, size: int) -> _File | None:
        """Begin hashing the destination open as ``fd`` (``size`` bytes expected), or
        None for a file too small to be worth it."""
        if size < MIN_SIZE:
            return None
        with self._lock:  # the copy outruns the hashing: never hold a descriptor per file
            if len(self._open) >= MAX_OPEN:
                return None  # of a tree of many large files; the rest are hashed at seal
        # the copy writes through a write-only descriptor: read back through one of our own
        dup = os.open(f"/proc/self/fd/{fd}", os.O_RDONLY | os.O_CLOEXEC)
        with self._lock:
            self._open.add(dup)
        return _File(dup, size)

    def feed(self, f: _File, end: int) -> None:
        """The first ``end`` bytes of ``f`` are written: hash them (in the worker)."""
        self._last = self._pool.submit(f.hash_range, end)

    def finish(self, f: _File) -> None:
        """No more bytes of ``f``: record its hash if the whole of it was read."""
        self._last = self._pool.submit(self._finish, f)

    def _finish(self, f: _File) -> None:  # in the worker
        try:
            if f.ok and f.done == f.size:
                st = os.fstat(f.fd)
                with self._lock:
                    if (st.st_dev, st.st_ino) not in self._stale:
                        self.results[(st.st_dev, st.st_ino)] = (f.size, f.h.hexdigest().encode())
        finally:
            self._close(f.fd)

    def wait(self) -> None:
        """Until every chunk handed over is hashed (errors are only a lost cache)."""
        last = self._last
        if last is not None:
            try:
                last.result()
            except OSError:
                pass

    def close(self) -> None:
        self._pool.shutdown(wait=True, cancel_futures=True)
        with self._lock:
            fds, self._open = self._open, set()
        for fd in fds:
            os.close(fd)

    def _close(self, fd: int) -> None:
        with self._lock:
            if fd not in self._open:
                return
            self._open.discard(fd)
        os.close(fd)

    def forget(self, st: os.stat_result) -> None:
        """The staged file ``st`` is about to be removed (copied again: a precopy's
        delta): never use a hash for its inode number, which a new file may reuse."""
        with self._lock:
            self._stale.add((st.st_dev, st.st_ino))
            self.results.pop((st.st_dev, st.st_ino), None)

    def lookup(self, fd: int, st: os.stat_result) -> bytes | None:
        """The hex sha256 of the file open as ``fd`` (its ``st``), if it was hashed
        whole while copied and is unchanged since: one data extent, the same size."""
        with self._lock:
            found = None if (st.st_dev, st.st_ino) in self._stale else self.results.get(
                (st.st_dev, st.st_ino))
        if found is None or found[0] != st.st_size:
            return None
        try:  # no hole anywhere (tree_digest's "f" kind): data from 0 to the end
            if os.lseek(fd, 0, os.SEEK_DATA) != 0 or os.lseek(fd, 0, os.SEEK_HOLE) < st.st_size:
                return None
        except OSError:
            return None
        return found[1]
