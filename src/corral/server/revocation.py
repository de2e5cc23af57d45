"""What revoking a tenant's token does, on every front-end, at once.

One routine (:class:`Revocation`) runs when a token is revoked on this daemon, and on
a Ray cluster when a daemon learns of a revoke made on another node:

1. every call the token opened ends (:meth:`~corral.server.door.Door.revoke`): exec
   streams, process output, ``logs?follow=1``, envd streams, the dashboard's live
   stream, cwsandbox gRPC calls; so do calls through per-sandbox tokens it minted
   (E2B's envd and Code Interpreter access tokens), which die with it anyway;
2. its pools go (nobody may use them, and their refills would go on);
3. its running sandboxes are stopped (``--on-revoke stop``, the default) or kept
   running for the admin (``--on-revoke keep``); with ``stop`` its client leases end
   too (``corral.server.leases``: the sandboxes a pool reserve took are deleted, as when
   a lease ends); with ``keep`` they end when no longer renewed.

Why stop by default: a revoked token is most often a leaked or abused one, and what it
started (a background process, a server in a sandbox, a sandbox with the host's
network) would otherwise go on working for whoever holds it until its lifetime ends.
Stopping keeps each sandbox's record and files (the admin can look, snapshot a stopped
sandbox's files or delete it); ``keep`` is for an admin who revokes a token to rotate
it while the jobs it started finish.
"""

from __future__ import annotations

import asyncio
import logging

from corral.errors import CorralError
from corral.server.admission import LIVE_STATES
from corral.server.caller import DAEMON
from corral.server.cluster_tenants import drop_pools
from corral.server.door import Door
from corral.server.service import SandboxService, uses_host_network_right

__all__ = ["ON_REVOKE", "Revocation"]

logger = logging.getLogger("corral.server")

ON_REVOKE = ("stop", "keep")
STOP_GRACE_S = 2.0


class Revocation:
    """Ends what a revoked token holds (see the module docstring)."""

    def __init__(self, door: Door, service: SandboxService, on_revoke: str = "stop") -> None:
        self.door = door
        self.service = service
        self.on_revoke = on_revoke

    async def __call__(self, name: str) -> None:
        """Tenant ``name``'s token is revoked: end its calls, its pools, its sandboxes."""
        closed = self.door.revoke(name)
        await drop_pools(self.service.pools, name)  # the daemon's own work
        if self.on_revoke == "stop" and self.service.leases is not None:
            # its leases end now, not a ttl later (up to a day): a reserve's sandboxes
            # are deleted with them, a token issued again under the name finds none
            await self.service.leases.end_tenant(name, "its tenant's token was revoked")
        stopped = await self._stop_sandboxes(name) if self.on_revoke == "stop" else 0
        logger.info("tenant %s revoked: %d open calls ended, %d sandboxes stopped",
                    name, closed, stopped)

    async def host_network_revoked(self, name: str) -> list[str]:
        """Tenant ``name`` lost its right to the host's network (``PATCH /v1/tokens``,
        ``allow_host_network: false``): its running sandboxes that use it (the host's
        network, or a policy allowing a private, loopback or link-local range, from a
        named network or its own) stop, whatever ``--on-revoke`` says, as a revoked
        token's would; their ids. New ones, forks and pool refills are refused."""
        live = self.service.list_sandboxes(DAEMON, states=LIVE_STATES, tenant=name)
        using = [i.id for i in live if uses_host_network_right(i.spec)]
        stopped = await self._stop_sandboxes(
            name, using, "its tenant's right to the host's network was taken back")
        logger.info("tenant %s lost its host-network right: %d sandboxes using it stopped",
                    name, stopped)
        return using

    async def _stop_sandboxes(self, name: str, ids: list[str] | None = None,
                              reason: str = "its tenant's token was revoked") -> int:
        """Stop them (``ids``, or all the tenant's) at once (each gets
        :data:`STOP_GRACE_S`); how many stopped."""
        async def stop(sandbox_id: str) -> bool:
            try:
                await self.service.stop(sandbox_id, DAEMON, grace=STOP_GRACE_S, reason=reason)
                return True
            except CorralError as exc:  # it ended meanwhile
                logger.debug("stopping %s of %s: %s", sandbox_id, name, exc.message)
                return False

        if ids is None:
            ids = [i.id for i in self.service.list_sandboxes(DAEMON, states=LIVE_STATES,
                                                             tenant=name)]
        return sum(await asyncio.gather(*(stop(i) for i in ids)))
