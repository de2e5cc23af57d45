"""Red team of the precopy commit (corral.runtime.precopy): the record it keeps of
every entry's signature, on a tree made to make paths long.

A sandbox may make directories 4095 levels deep, each name 255 bytes, and put its
~131,000 entries at the bottom. The precopy's record was keyed by each entry's path:
a megabyte per entry there, gigabytes of the daemon's memory for one commit (measured
at 1,000 levels and 1,000 files: 367 MB of keys, 1.6 s). Keys are now 16-byte digests
chained from the directory's, and the delta still finds every change by path. Hard
links had the same cost in every commit (the copy and the layer's digest kept each
inode's first path: 124 MB for 500 inodes 1,000 levels down); they keep its place
(its directory's, shared). No root needed; the tree is on a tmpfs, as a sandbox's
writable layer is.
"""

from __future__ import annotations

import os
import tracemalloc
from pathlib import Path

from corral.runtime.layers import tree_digest
from corral.runtime.treecopy import copy_tree
from corral.runtime.treedelta import sync_delta

DEPTH, FILES = 600, 600
LINKS = 100  # inodes of two names each, at the bottom
NAME = "x" * 255



def _deep(root: Path) -> int:
    """The bottom directory's descriptor: ``DEPTH`` levels of 255-byte names, holding
    ``FILES`` files of 250-byte names."""
    fd = os.open(root, os.O_RDONLY)
    for _ in range(DEPTH):
        os.mkdir(NAME, dir_fd=fd)
        fd, old = os.open(NAME, os.O_RDONLY, dir_fd=fd), fd
        os.close(old)
    for i in range(FILES):
        os.close(os.open(f"{i:0250d}", os.O_CREAT | os.O_WRONLY, 0o644, dir_fd=fd))
    return fd


def test_the_record_of_a_deep_tree_stays_small_and_its_delta_right(shm):
    src, dst = shm / "src", shm / "dst"
    src.mkdir()
    bottom = _deep(src)
    try:
        record: dict[bytes, tuple[int, ...]] = {}
        copy_tree(src, dst, record=record)
        assert len(record) == 1 + DEPTH + FILES
        keys = sum(map(len, record))
        assert keys <= 16 * len(record), f"{keys} bytes of keys for {len(record)} entries"
        last = f"{FILES - 1:0250d}"
        with open(os.open(last, os.O_WRONLY, dir_fd=bottom), "wb") as f:
            f.write(b"changed at the bottom")
        os.unlink(f"{0:0250d}", dir_fd=bottom)
        assert sync_delta(src, dst, record) >= 2
    finally:
        os.close(bottom)
    assert tree_digest(dst) == tree_digest(src)


def test_hard_links_deep_down_cost_no_memory_per_level(shm):
    src, dst = shm / "src", shm / "dst"
    src.mkdir()
    bottom = _deep(src)
    try:
        for i in range(LINKS):  # each inode twice: a first name kept until the second
            os.link(f"{i:0250d}", f"l{i:0249d}", src_dir_fd=bottom, dst_dir_fd=bottom)
    finally:
        os.close(bottom)
    tracemalloc.start()
    try:
        copy_tree(src, dst)
        digest = tree_digest(src)
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    # a path per inode: LINKS * DEPTH * 256 bytes, ~15 MB here (twice: bytes and str)
    assert peak < 8 << 20, f"{peak >> 20} MB at the peak"
    assert tree_digest(dst) == digest  # linked as in the source
