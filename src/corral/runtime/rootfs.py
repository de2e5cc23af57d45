"""A sandbox's root filesystem: image layers below, a private writable layer on top.

The mounts are made by the launcher (``agent/launch.c``) in the sandbox's own mount
namespace, on top of two empty host directories::

    <sandbox_dir>/rw     tmpfs of ``disk_mb`` and ``inodes`` (``size=``/``nr_inodes=``:
                         the caps of everything written)
    <sandbox_dir>/rw/upper, rw/work   overlayfs upper and work directories
    <sandbox_dir>/rw/N   the Nth lower layer: a read-only clone, idmapped so that the
                         layers' canonical owner is the sandbox's uid (:mod:`.uids`)
    <sandbox_dir>/root   the overlay mount that becomes the sandbox's ``/``

The overlay is mounted with paths relative to ``<sandbox_dir>``, so its options, which
the sandbox reads in ``/proc/self/mountinfo``, name no host path.

The host never sees these mounts, so they cannot leak: they vanish with the last
process of the sandbox. The upper directory's root is host root's, mode 1777 (like
``/tmp``), so the sandbox may create top-level directories (``/app``) but never
unlink or replace an entry it did not make (``/lib64``, ``/bin``); the image's own
files belong to host root and appear as ``nobody`` inside, so writing into the
image fails with EACCES.
"""

from __future__ import annotations

import os
from pathlib import Path

from corral.runtime import syscalls
from corral.runtime.treecopy import INODE_SLACK, discard_tree

AGENT_DIR = ".corral"  # in the sandbox: /.corral/agent
# mount(2) copies one page of options, its NUL included: with very many lower layers,
# they must be squashed into fewer.
MAX_MOUNT_DATA = 4095


def overlay_data_len(n_lowers: int) -> int:
    """The length of the overlay options the launcher mounts with (``launch.c``), for
    ``n_lowers`` layers besides the agent's."""
    lowerdir = ":".join(f"rw/{i}" for i in range(n_lowers + 1))
    return len(f"lowerdir={lowerdir},upperdir=rw/upper,workdir=rw/work")


def inode_args(inodes: int) -> list[str]:
    """The launcher's ``--inodes N``: the writable tmpfs's ``nr_inodes``, the sandbox's
    inode limit plus the tmpfs's own directories."""
    return ["--inodes", str(inodes + INODE_SLACK)]


def remove_dirs(sandbox_dir: Path) -> None:
    """Remove a sandbox's (empty) host directories; fall back to a full clean-up."""
    try:
        for sub in ("rw", "root"):
            try:
                os.rmdir(sandbox_dir / sub)
            except FileNotFoundError:
                pass
        os.rmdir(sandbox_dir)
    except FileNotFoundError:
        pass
    except OSError:
        unmount_root(sandbox_dir)


def unmount_root(sandbox_dir: Path) -> None:
    """Unmount anything under ``sandbox_dir`` and remove it. Idempotent."""
    for point in syscalls.mounts_under(str(sandbox_dir)):
        syscalls.umount(point)
    discard_tree(sandbox_dir)  # iterative: what the sandbox wrote may be thousands deep
