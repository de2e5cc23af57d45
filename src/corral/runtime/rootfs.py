"""A sandbox's root filesystem: image layers below, a private writable layer on top.

    <sandbox_dir>/rw     tmpfs of ``disk_mb`` (the size cap of everything written)
    <sandbox_dir>/rw/upper, rw/work   overlayfs upper and work directories
    <sandbox_dir>/root   the overlay mount that becomes the sandbox's ``/``

The upper directory's root is owned by the sandbox's host uid, so the sandbox may
create top-level directories (``/app``); the image's own files belong to host root
and appear as ``nobody`` inside, so writing into the image fails with EACCES.
"""

from __future__ import annotations

import os
import shutil
from pathlib import Path

from corral.runtime import syscalls

AGENT_DIR = ".corral"  # in the sandbox: /.corral/agent


def mount_root(
    sandbox_dir: Path,
    lowers: list[Path],
    *,
    disk_mb: int,
    uid: int,
    gid: int,
    owned_dirs: list[str],
) -> Path:
    """Mount the sandbox's root and return it. On failure, nothing stays mounted."""
    rw, root = sandbox_dir / "rw", sandbox_dir / "root"
    sandbox_dir.mkdir(mode=0o711)
    rw.mkdir()
    root.mkdir()
    try:
        syscalls.mount(
            "corral-rw", str(rw), "tmpfs", syscalls.MS_NOSUID | syscalls.MS_NODEV,
            f"size={disk_mb}m,mode=0711",
        )
        upper, work = rw / "upper", rw / "work"
        upper.mkdir(mode=0o755)
        work.mkdir()
        os.chown(upper, uid, gid)
        (upper / AGENT_DIR).mkdir(mode=0o755)
        (upper / AGENT_DIR / "agent").touch(mode=0o755)  # the mount point of the agent
        for d in owned_dirs:
            _make_owned(upper, d, uid, gid)
        lowerdir = ":".join(str(p) for p in lowers)
        syscalls.mount(
            "corral-root", str(root), "overlay", syscalls.MS_NOSUID | syscalls.MS_NODEV,
            f"lowerdir={lowerdir},upperdir={upper},workdir={work}",
        )
    except BaseException:
        unmount_root(sandbox_dir)
        raise
    return root


def _make_owned(upper: Path, path: str, uid: int, gid: int) -> None:
    """Create ``path`` (absolute, in the sandbox) in the upper layer, owned by the sandbox."""
    parts = [p for p in path.split("/") if p]
    cur = upper
    for i, part in enumerate(parts):
        cur = cur / part
        if not cur.exists():
            cur.mkdir(mode=0o755)
            if i == len(parts) - 1:
                os.chown(cur, uid, gid)


def unmount_root(sandbox_dir: Path) -> None:
    """Unmount everything under ``sandbox_dir`` and remove it. Idempotent."""
    for point in syscalls.mounts_under(str(sandbox_dir)):
        syscalls.umount(point)
    shutil.rmtree(sandbox_dir, ignore_errors=True)
