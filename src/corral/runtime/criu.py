"""The CRIU binary live checkpoints use (docs/live.md), and whether it works here.

``scripts/build_criu.sh`` (run by ``make install``) builds CRIU >= :data:`MIN_VERSION`
from Debian sid's source package and caches it as ``CACHE/criu/<version>/criu``: Debian
12's own criu (3.17) fails on kernels >= 6.13 (their split vvar area). Nothing here
builds or installs: :func:`find` reads the cache, :func:`check` runs ``criu check``.
"""

from __future__ import annotations

import subprocess
from dataclasses import dataclass
from pathlib import Path

from corral.errors import Unsupported

MIN_VERSION = (4, 2)
BUILD = "run scripts/build_criu.sh as root (make install runs it)"
CHECK_TIMEOUT_S = 60.0


def _version(text: str) -> tuple[int, ...] | None:
    try:
        return tuple(int(x) for x in text.split("."))
    except ValueError:
        return None


@dataclass(frozen=True)
class Criu:
    path: Path
    version: tuple[int, ...]

    @property
    def version_text(self) -> str:
        return ".".join(map(str, self.version))


def find(cache_dir: Path) -> Criu | None:
    """The newest cached CRIU >= :data:`MIN_VERSION`, or None."""
    found: list[Criu] = []
    root = Path(cache_dir) / "criu"
    if not root.is_dir():
        return None
    for d in root.iterdir():
        version = _version(d.name)
        binary = d / "criu"
        if version is not None and version >= MIN_VERSION and binary.is_file():
            found.append(Criu(binary, version))
    return max(found, key=lambda c: c.version, default=None)


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
