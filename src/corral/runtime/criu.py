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

import subprocess
from dataclasses import dataclass
from pathlib import Path

from corral.errors import Unsupported

MIN_VERSION = (4, 2)
PATCH_LEVEL = 1  # = scripts/build_criu.sh's PATCH_LEVEL
BUILD = "run scripts/build_criu.sh as root (make install runs it)"
CHECK_TIMEOUT_S = 60.0


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
