"""A tenant as the daemon knows it: its name, quotas and rights (no token)."""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Any

__all__ = ["ADMIN_NAME", "Tenant"]

ADMIN_NAME = "admin"  # how logs and metrics name the admin: no tenant may take the name


@dataclass(frozen=True)
class Tenant:
    """A tenant token's name, quotas (None: only the daemon's caps) and rights."""

    name: str
    max_sandboxes: int | None = None
    max_memory_mb: int | None = None
    max_cpus: float | None = None
    allow_images: bool = False
    created_at: float = 0.0
    max_lifetime: float | None = None  # seconds from create; below the daemon's --max-lifetime
    max_snapshot_mb: int | None = None  # its snapshots' layers on disk (server/quotas.py)
    max_builds: int | None = None  # image builds at once (None: DEFAULT_MAX_BUILDS)
    allow_host_network: bool = False  # network="host" (with the daemon's --allow-host-network)
    max_gpus: int | None = None  # GPUs held at once; None: none (GPUs are given per token)

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)
