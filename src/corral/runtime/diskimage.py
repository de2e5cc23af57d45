"""A writable layer on disk: a sandbox's own ext4 image, bounded by ``disk_mb``.

By default a sandbox writes into a tmpfs (``storage="memory"``): the fastest layer, but
its pages are charged to the sandbox's memory cgroup, so a 128 MB sandbox is OOM-killed
writing 200 MB to ``/workspace`` although its ``disk_mb`` is 2048. With
``storage="disk"`` the writable layer is an ext4 filesystem in a sparse file of
``disk_mb`` under the sandbox's directory (``inodes`` files at most), which the launcher
mounts on a loop device in the sandbox's own mount namespace (``agent/launch.c``):
written data costs host disk, not memory, and a full layer is ``ENOSPC``
(:class:`~corral.errors.SandboxDiskFull` from the file API), never an OOM kill.

Made at create, with ``mkfs.ext4`` (e2fsprogs): no journal (the layer dies with its
sandbox; a snapshot copies files, not the image), inode tables left to the sparse
file's zeros (mounted ``noinit_itable``), nothing reserved for root. It costs tens of
milliseconds at create (``benchmarks/bench_disk_layer.py``), so memory stays the
default. The file is removed with the sandbox's directory.
"""

from __future__ import annotations

import os
import shutil
import subprocess
from pathlib import Path

from corral.errors import SandboxStartError, Unsupported

__all__ = ["IMAGE_NAME", "make_image"]

IMAGE_NAME = "disk.img"
INODE_SLACK = 16  # the root, lost+found and the launcher's own directories


def mkfs() -> str:
    """The ``mkfs.ext4`` to use; :class:`Unsupported` with what to install if none."""
    found = shutil.which("mkfs.ext4") or next(
        (p for p in ("/usr/sbin/mkfs.ext4", "/sbin/mkfs.ext4") if os.access(p, os.X_OK)), None)
    if not found:
        raise Unsupported("storage='disk' needs mkfs.ext4: install e2fsprogs "
                          "(or create the sandbox with storage='memory')")
    return found


def make_image(sandbox_dir: Path, *, disk_mb: int, inodes: int) -> Path:
    """A fresh, empty ext4 image of ``disk_mb`` MiB for ``inodes`` files in
    ``sandbox_dir`` (blocking: run it in a thread); its path."""
    image = sandbox_dir / IMAGE_NAME
    fd = os.open(image, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, 0o600)
    try:
        os.ftruncate(fd, disk_mb << 20)
    finally:
        os.close(fd)
    proc = subprocess.run(
        [mkfs(), "-q", "-F", "-t", "ext4", "-N", str(inodes + INODE_SLACK), "-m", "0",
         "-O", "^has_journal", "-E", "lazy_itable_init=1,nodiscard,root_owner=0:0",
         str(image)],
        capture_output=True, text=True,
    )
    if proc.returncode != 0:
        image.unlink(missing_ok=True)
        raise SandboxStartError(
            f"could not make the disk of the sandbox in {sandbox_dir.name}: "
            f"{proc.stderr.strip()[-500:]}",
            details={"disk_mb": disk_mb, "inodes": inodes},
        )
    return image
