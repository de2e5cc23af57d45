"""Red team of the precopy commit (corral.runtime.precopy): a write already under way
when the precopy takes a file's signature.

A write(2) sets the file's mtime and ctime when it *starts*, then copies its data in.
A sandbox overwriting a large file in place with one call that began just before the
precopy's stat leaves the signature as the precopy saw it (same size, same times)
while the bytes are still changing: the delta trusts the precopy's copy, so a copy
read while the write ran would be torn (measured: with the copy's lseek removed, the
delta found nothing to do and the snapshot held old and new bytes). What holds: the
copy's first ``lseek(SEEK_DATA)`` waits for the inode lock the write holds, so the
precopy reads the file only once the write is done. The write's source is a mapping
of a file evicted from the page cache, so it runs slower than the copy (which would
otherwise read ahead of it). No root needed; the tree is on a tmpfs, as a sandbox's
writable layer is.
"""

from __future__ import annotations

import mmap
import os
import threading
import time
from pathlib import Path

import pytest

from corral.runtime.treecopy import copy_tree
from corral.runtime.treedelta import sync_delta

SIZE = 32 << 20



def _cold_source(path: Path) -> mmap.mmap:
    """A mapping of ``SIZE`` bytes of b"b" that page faults read back from the disk."""
    path.write_bytes(b"b" * SIZE)
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        return mmap.mmap(fd, SIZE, prot=mmap.PROT_READ)
    finally:
        os.close(fd)


def test_a_write_under_way_at_the_precopy_is_in_the_snapshot(shm, tmp_path):
    src = shm / "src"
    src.mkdir()
    (src / "big").write_bytes(b"a" * SIZE)
    source = _cold_source(tmp_path / "cold")
    fd = os.open(src / "big", os.O_WRONLY)
    times: dict[str, float] = {}

    def write() -> None:
        times["start"] = time.monotonic()
        os.pwrite(fd, source, 0)  # one call: the times are set at its start only
        times["end"] = time.monotonic()

    writer = threading.Thread(target=write)
    try:
        writer.start()
        while "start" not in times:
            time.sleep(0)
        time.sleep(0.005)  # into the call: its times set, its data still coming in
        record: dict[bytes, tuple[int, ...]] = {}
        signed = time.monotonic()
        copy_tree(src, shm / "dst", record=record)  # stats "big" first thing
    finally:
        writer.join()
        os.close(fd)
        source.close()
    if signed >= times["end"]:
        pytest.skip("the write ended before the precopy began (a very fast disk)")
    sync_delta(src, shm / "dst", record)  # as frozen: the writer is done
    assert (shm / "dst" / "big").read_bytes() == b"b" * SIZE, "the snapshot holds a torn copy"
