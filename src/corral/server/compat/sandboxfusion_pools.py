"""The SandboxFusion front-end's warm pools, bounded in number and in idle time.

A pool is made on the first request of its shape (image, memory size) and keeps
``CORRAL_FUSION_WARM`` sandboxes running. A stream of requests of ever new shapes (a
hostile client's ``memory_limit_MB`` 17, 18, 19, ...) must not pin sandboxes forever:

- at most :data:`MAX_POOLS` pools exist at once, at most :data:`MAX_POOLS_PER_OWNER` of
  them one tenant's (or the admin's): one tenant's shapes cannot take every pool from
  the others; a shape past either runs in a plain sandbox (created for the request,
  deleted after it), no pool made;
- a pool no request used for ``CORRAL_FUSION_POOL_IDLE`` seconds (default 300) is
  deleted with its ready sandboxes, by a sweeper task that runs while pools exist
  (every :data:`SWEEP_EVERY_S` at most) and before a new pool is made; its place is
  free for the next shape. Sandboxes already handed out are their requests' to delete.
"""

from __future__ import annotations

import asyncio
import logging
import time
from typing import TYPE_CHECKING

from corral.errors import CorralError

if TYPE_CHECKING:
    from corral.runtime.pools import PoolManager

logger = logging.getLogger("corral.server")

MAX_POOLS = 8  # pools the front-end makes; more (image, memory) pairs get plain creates
MAX_POOLS_PER_OWNER = 2  # of them, one tenant's (the admin's)
SWEEP_EVERY_S = 30.0

Shape = tuple[str | None, str, int]  # (tenant, image, memory_mb): a tenant's pools are its own


class FusionPools:
    """Which pool serves which shape, when each was last used, and their sweeper."""

    def __init__(self, idle_s: float, max_pools: int = MAX_POOLS,
                 per_owner: int = MAX_POOLS_PER_OWNER) -> None:
        self.idle_s = idle_s
        self.max_pools = max_pools
        self.per_owner = per_owner
        self.names: dict[Shape, str] = {}
        self.used: dict[Shape, float] = {}
        self._sweeper: asyncio.Task[None] | None = None

    def get(self, shape: Shape) -> str | None:
        """The pool of ``shape``, marked used now, or None."""
        name = self.names.get(shape)
        if name is not None:
            self.used[shape] = time.monotonic()
        return name

    def has_room(self, owner: str | None = None) -> bool:
        """Whether a new pool of ``owner`` (a tenant; None: the admin) may be made."""
        mine = sum(1 for shape in self.names if (shape[0] or None) == owner)
        return len(self.names) < self.max_pools and mine < self.per_owner

    def add(self, shape: Shape, name: str, manager: PoolManager) -> None:
        self.names[shape] = name
        self.used[shape] = time.monotonic()
        if self._sweeper is None or self._sweeper.done():
            self._sweeper = asyncio.get_running_loop().create_task(  # the daemon's, not a tenant's
                self._sweep_loop(manager))

    def forget(self, shape: Shape) -> None:
        self.names.pop(shape, None)
        self.used.pop(shape, None)

    async def sweep(self, manager: PoolManager) -> list[str]:
        """Delete the pools idle for ``idle_s`` or more; their names."""
        now = time.monotonic()
        idle = [s for s, t in self.used.items() if now - t >= self.idle_s]
        gone = []
        for shape in idle:
            name = self.names.get(shape)
            self.forget(shape)
            if name is None:  # another sweep (the sweeper's, a request's) took it
                continue
            try:  # the shape's tenant's pool of that name (names are per tenant), as the
                # daemon: the caller's tenant may not see another's idle pool
                await manager.delete_owned(shape[0] or None, name)
            except CorralError as exc:  # a sandbox that would not go: the pool is gone
                logger.warning("deleting the idle pool %s: %s", name, exc.message)
            gone.append(name)
        return gone

    async def _sweep_loop(self, manager: PoolManager) -> None:
        while self.names:
            await asyncio.sleep(min(SWEEP_EVERY_S, max(self.idle_s / 4, 0.1)))
            try:
                await self.sweep(manager)
            except Exception:  # noqa: BLE001 - the sweeper keeps going; retried next round
                logger.exception("sweeping the SandboxFusion pools")
