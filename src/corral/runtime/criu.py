"""The CRIU binary live checkpoints use (docs/live.md), and whether it works here.

``scripts/build_criu.sh`` (run by ``make install``) builds CRIU >= :data:`MIN_VERSION`
from Debian sid's source package with corral's patches (``scripts/criu/*.patch``) and
caches it as ``CACHE/criu/<version>-corral<PATCH_LEVEL>/criu``: Debian 12's own criu
(3.17) fails on kernels >= 6.13 (their split vvar area). Nothing here builds or
installs: :func:`find` reads the cache, :func:`check` runs ``criu check``.

The patch: CRIU's check that a tree's namespaces belong to its user namespace opens
their ``/proc`` files from inside that namespace, which a restored copy's pid 1 (not
dumpable, its memory map the host's) refuses: without it a restored copy cannot be
checkpointed again. A build without it (an older cache, ``<version>`` alone) still
dumps and restores sandboxes made by bubblewrap.
"""

from __future__ import annotations

import os
import subprocess
from dataclasses import dataclass
from pathlib import Path

from corral.errors import Unsupported
from corral.runtime.syscalls import TMPFS_MAGIC, fs_type

MIN_VERSION = (4, 2)
PATCH_LEVEL = 1  # = scripts/build_criu.sh's PATCH_LEVEL
BUILD = "run scripts/build_criu.sh as root (make install runs it)"
CHECK_TIMEOUT_S = 60.0
KDAT_TMP = "criu.kdat.tmp"  # where root's CRIU writes its kernel probes before keeping them


def _version(text: str) -> tuple[tuple[int, ...], int] | None:
    """``4.2.1-corral1`` -> ((4, 2, 1), 1); ``4.2.1`` -> ((4, 2, 1), 0)."""
    base, sep, level = text.partition("-corral")
    try:
        return tuple(int(x) for x in base.split(".")), int(level) if sep else 0
    except ValueError:
        return None


@dataclass(frozen=True)
class Criu:
    path: Path
    version: tuple[int, ...]
    patch_level: int = 0  # corral's patches in it (scripts/criu)

    @property
    def redumps(self) -> bool:
        """Whether it can checkpoint a copy it restored (module doc)."""
        return self.patch_level >= PATCH_LEVEL

    @property
    def version_text(self) -> str:
        return ".".join(map(str, self.version))


def find(cache_dir: Path) -> Criu | None:
    """The cached CRIU >= :data:`MIN_VERSION` to use, or None: a build with corral's
    patches first, then the newest."""
    found: list[Criu] = []
    root = Path(cache_dir) / "criu"
    if not root.is_dir():
        return None
    for d in root.iterdir():
        parsed = _version(d.name)
        binary = d / "criu"
        if parsed is not None and parsed[0] >= MIN_VERSION and binary.is_file():
            found.append(Criu(binary, *parsed))
    return max(found, key=lambda c: (c.redumps, c.version, c.patch_level), default=None)


def check(criu: Criu) -> tuple[bool, str]:
    """Run ``criu check`` (as root): whether it passed, and its last lines of output."""
    try:
        proc = subprocess.run([str(criu.path), "check"], capture_output=True, text=True,
                              timeout=CHECK_TIMEOUT_S, check=False)
    except (OSError, subprocess.TimeoutExpired) as exc:
        return False, f"{type(exc).__name__}: {exc}"
    finally:
        drop_kdat_tmp()
    out = (proc.stdout + proc.stderr).strip().splitlines()
    return proc.returncode == 0, " | ".join(out[-3:])


def require(cache_dir: Path) -> Criu:
    """The cached CRIU, or :class:`Unsupported` saying how to get one."""
    criu = find(cache_dir)
    if criu is None:
        need = ".".join(map(str, MIN_VERSION))
        raise Unsupported(
            f"live checkpoints need CRIU >= {need}, and none is cached under "
            f"{Path(cache_dir) / 'criu'}: {BUILD}",
            details={"cause": "criu_missing"},
        )
    return criu


def drop_kdat_tmp(run: Path = Path("/run")) -> bool:
    """Remove the ``criu.kdat.tmp`` root's CRIU leaves in ``run`` when that is no tmpfs;
    whether one was removed.

    CRIU (run as root: ``criu check``, a dump of a restored copy) writes its kernel
    probes to ``/run/criu.kdat.tmp`` and keeps them (renamed ``criu.kdat``) only on a
    tmpfs; elsewhere it gives up and leaves the file. There it is never used, by this
    CRIU or another (a CRIU writing one meanwhile gives up as well), so removing it
    disturbs nothing. On a tmpfs it may be another CRIU's, about to be renamed: kept."""
    path = run / KDAT_TMP
    try:
        if fs_type(str(run)) == TMPFS_MAGIC:
            return False
        os.unlink(path)
    except OSError:  # none, or not ours to remove
        return False
    return True

