"""Where the engine keeps things on the host.

Environment variables (read only here):
- ``CORRAL_STATE_DIR``: registry, snapshot layers, per-sandbox mounts (default
  ``/var/lib/corral``).
- ``CORRAL_CACHE_DIR``: built images and the compiled agent, shared by every engine on
  the host (default ``/var/cache/corral``).
- ``CORRAL_RUN_DIR``: machine-wide locks of every engine on the host (the blocks of
  sandbox uids, :mod:`.uids`; the cgroups each engine holds, :mod:`.cgroup_sweep`); the
  same for all of them (default ``/run/corral``).
"""

from __future__ import annotations

import hashlib
import os
from dataclasses import dataclass
from pathlib import Path

DEFAULT_STATE_DIR = "/var/lib/corral"
DEFAULT_CACHE_DIR = "/var/cache/corral"
DEFAULT_RUN_DIR = "/run/corral"


def default_state_dir() -> Path:
    return Path(os.environ.get("CORRAL_STATE_DIR", DEFAULT_STATE_DIR))


def default_cache_dir() -> Path:
    return Path(os.environ.get("CORRAL_CACHE_DIR", DEFAULT_CACHE_DIR))


def uid_lock_dir() -> Path:
    """Where engines lock their blocks of sandbox uids (one directory per host)."""
    return Path(os.environ.get("CORRAL_RUN_DIR", DEFAULT_RUN_DIR)) / "uids"


def cgroup_lock_dir() -> Path:
    """Where engines lock the keys of their cgroups (one directory per host)."""
    return Path(os.environ.get("CORRAL_RUN_DIR", DEFAULT_RUN_DIR)) / "cgroups"


def share_dir(cache_dir: Path) -> Path:
    return Path(cache_dir) / "share"


@dataclass(frozen=True)
class Layout:
    """The directory layout of one engine (one state directory)."""

    state_dir: Path
    cache_dir: Path

    @classmethod
    def create(cls, state_dir: Path | None = None, cache_dir: Path | None = None) -> "Layout":
        layout = cls(
            Path(state_dir or default_state_dir()).absolute(),
            Path(cache_dir or default_cache_dir()).absolute(),
        )
        layout.slots_dir.mkdir(parents=True, exist_ok=True)
        for d in (layout.state_dir, layout.sandboxes_dir):
            d.mkdir(parents=True, exist_ok=True)
            # Traversable but not listable by the unprivileged sandbox uids: bwrap, run
            # as the sandbox's host uid, must reach its own root directory by path.
            os.chmod(d, 0o711)
        layout.images_dir.mkdir(parents=True, exist_ok=True)
        layout.bin_dir.mkdir(parents=True, exist_ok=True)
        layout.share_dir.mkdir(parents=True, exist_ok=True)
        # Images are root's only (overlay reads its lower layers with the mounter's
        # rights): no local user reaches an image's files, setuid or not. bwrap, as the
        # sandbox's uid, only needs to reach the agent and shared files by path.
        os.chmod(layout.images_dir, 0o700)
        for d in (layout.cache_dir, layout.bin_dir, layout.share_dir):
            os.chmod(d, 0o711)
        return layout

    @property
    def registry_path(self) -> Path:
        return self.state_dir / "registry.db"

    @property
    def sandboxes_dir(self) -> Path:
        return self.state_dir / "sandboxes"

    @property
    def slots_dir(self) -> Path:
        """Logs of warm launchers (bwrap's error output, read if a start fails)."""
        return self.state_dir / "slots"

    def sandbox_dir(self, sandbox_id: str) -> Path:
        return self.sandboxes_dir / sandbox_id

    @property
    def layers_dir(self) -> Path:
        """Committed snapshot layers: durable state, not cache (see :mod:`.layers`)."""
        return self.state_dir / "layers"

    @property
    def images_dir(self) -> Path:
        return self.cache_dir / "images"

    @property
    def bin_dir(self) -> Path:
        return self.cache_dir / "bin"

    @property
    def share_dir(self) -> Path:
        """Host files a sandbox's launcher copies in read-only (the build CA bundle)."""
        return share_dir(self.cache_dir)

    @property
    def engine_key(self) -> str:
        """A short name unique to this state directory, used to name its cgroups."""
        return "e" + hashlib.sha256(str(self.state_dir).encode()).hexdigest()[:10]
