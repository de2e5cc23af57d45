"""Per-tenant quotas, checked by admission control before a create waits for room.

A tenant token may carry ``max_sandboxes`` (alive and starting), ``max_memory_mb``
(the sum of their ``memory_mb``), ``max_cpus`` (the sum of their ``cpus``, each
counted as at least the 0.01 CPU the kernel gives it) and ``max_gpus`` (GPUs held;
none without it). A create that would pass one
and names its deadline (``POST /v1/sandboxes?wait=S``; the SDK always does) waits in
admission control (:meth:`corral.server.admission.Admission.admit`) for the tenant's
own sandboxes to end, up to that deadline (at most the daemon's ``queue_timeout``),
woken by :meth:`Quotas.freed`; then, or at once for a caller that named none, it is
refused with :class:`~corral.errors.QuotaExceeded` (429), naming the quota, its limit
and the current use. One sandbox above a quota by itself is refused at once. The check and
the reservation are one synchronous step on the event loop, so twenty concurrent
creates at a quota of five admit exactly five at a time.
Sandboxes of a tenant's pools carry the tenant and count like any other.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from dataclasses import dataclass

from corral.errors import QuotaExceeded
from corral.runtime.cgroups import effective_cpus
from corral.server.tenants import Tenant

__all__ = ["Hold", "Quotas", "Usage", "snapshot_quota"]


@dataclass
class Usage:
    """What one tenant holds: sandboxes alive or starting, their memory and CPUs."""

    sandboxes: int = 0
    memory_mb: int = 0
    cpus: float = 0.0
    gpus: int = 0

    def add(self, memory_mb: int, cpus: float, sign: int = 1, gpus: int = 0) -> None:
        self.sandboxes += sign
        self.memory_mb += sign * memory_mb
        self.cpus += sign * cpus
        self.gpus += sign * gpus


@dataclass
class Hold:
    """One create's place in its tenant's quota, from before it queues until it ends."""

    tenant: str
    memory_mb: int
    cpus: float
    gpus: int = 0


class Quotas:
    """The quota book of one daemon; ``quota_of`` reads a tenant's current quotas."""

    def __init__(self, quota_of: Callable[[str | None], Tenant | None]) -> None:
        self._quota_of = quota_of
        self._usage: dict[str, Usage] = {}
        self._held: dict[str, Hold] = {}  # sandbox id -> its hold
        self._freed: asyncio.Future[None] | None = None  # set when room is given back

    def usage(self, tenant: str) -> Usage:
        got = self._usage.get(tenant, Usage())
        return Usage(got.sandboxes, got.memory_mb, got.cpus, got.gpus)

    def hold(self, tenant: str | None, memory_mb: int, cpus: float,
             elsewhere: Usage | None = None, gpus: int = 0) -> Hold | None:
        """Reserve room for one sandbox, or raise :class:`QuotaExceeded` (None: no
        tenant); ``elsewhere``: what the tenant holds beyond this book (other nodes)."""
        if tenant is None:
            return None
        cpus = effective_cpus(cpus)  # what the kernel gives it, not less
        used = self._usage.setdefault(tenant, Usage())
        check(tenant, self._quota_of(tenant), total(used, elsewhere), memory_mb, cpus, gpus)
        used.add(memory_mb, cpus, gpus=gpus)
        return Hold(tenant, memory_mb, cpus, gpus)

    def alone_over(self, tenant: str | None, memory_mb: int, cpus: float,
                   gpus: int = 0) -> QuotaExceeded | None:
        """The refusal one sandbox would meet with nothing else of its tenant alive
        (waiting could never help), or None."""
        if tenant is None:
            return None
        try:
            check(tenant, self._quota_of(tenant), Usage(), memory_mb, effective_cpus(cpus), gpus)
        except QuotaExceeded as exc:
            return exc
        return None

    async def acquire(self, tenant: str | None, memory_mb: int, cpus: float,
                      gpus: int = 0) -> Hold | None:
        """:meth:`hold`, as admission control asks for it (a cluster's book may have to
        ask the other nodes: :class:`~corral.server.cluster_quotas.ClusterQuotas`)."""
        return self.hold(tenant, memory_mb, cpus, gpus=gpus)

    def settle(self, hold: Hold | None, sandbox_id: str | None) -> None:
        """The create ended: keep the hold for the sandbox made, or give it back."""
        if hold is None:
            return
        if sandbox_id is None:
            self._give_back(hold)
            self._wake()
        else:
            self._held[sandbox_id] = hold

    def adopt(self, tenant: str | None, memory_mb: int, cpus: float, sandbox_id: str,
              gpus: int = 0) -> None:
        """Count a sandbox that exists already (adopted after a restart), unchecked."""
        if tenant is None:
            return
        cpus = effective_cpus(cpus)
        self._usage.setdefault(tenant, Usage()).add(memory_mb, cpus, gpus=gpus)
        self._held[sandbox_id] = Hold(tenant, memory_mb, cpus, gpus)

    def release(self, sandbox_id: str) -> None:
        """The sandbox ended or was deleted: its tenant's room is free again."""
        hold = self._held.pop(sandbox_id, None)
        if hold is not None:
            self._give_back(hold)
            self._wake()

    async def freed(self, timeout: float) -> None:
        """Return once a hold is given back (a sandbox ended, a create failed), or
        after ``timeout`` seconds. Waiters wake in the order they came."""
        if self._freed is None or self._freed.done():
            self._freed = asyncio.get_running_loop().create_future()
        await asyncio.wait({self._freed}, timeout=timeout)

    def _wake(self) -> None:
        # only real releases wake waiters: a cluster's book gives back its own failed
        # tries too, and waking on those would spin every waiter
        if self._freed is not None and not self._freed.done():
            self._freed.set_result(None)

    def holds(self, sandbox_id: str) -> bool:
        """Whether a tenant's quota counts this sandbox."""
        return sandbox_id in self._held

    def local(self) -> dict[str, Usage]:
        """What this book holds, per tenant (copies)."""
        return {t: Usage(u.sandboxes, u.memory_mb, u.cpus, u.gpus) for t, u in self._usage.items()}

    def _give_back(self, hold: Hold) -> None:
        used = self._usage[hold.tenant]
        used.add(hold.memory_mb, hold.cpus, -1, hold.gpus)
        if used.sandboxes <= 0:
            del self._usage[hold.tenant]


def total(*parts: Usage | None) -> Usage:
    """The sum of ``parts``."""
    out = Usage()
    for part in parts:
        if part is not None:
            out.sandboxes += part.sandboxes
            out.memory_mb += part.memory_mb
            out.cpus += part.cpus
            out.gpus += part.gpus
    return out


def check(tenant: str, quota: Tenant | None, used: Usage, memory_mb: int, cpus: float,
          gpus: int = 0) -> None:
    """:class:`QuotaExceeded` if one more sandbox (``memory_mb``, ``cpus``, ``gpus``)
    would take ``tenant`` past a quota, with ``used`` in use already. GPUs are given per
    token: a tenant without ``max_gpus`` may hold none (one tenant's ``gpus="all"``
    would hold every GPU of the host)."""
    if quota is None:
        return
    for name, limit, now, asked in (
        ("max_sandboxes", quota.max_sandboxes, used.sandboxes, 1),
        ("max_memory_mb", quota.max_memory_mb, used.memory_mb, memory_mb),
        ("max_cpus", quota.max_cpus, used.cpus, cpus),
        *([("max_gpus", quota.max_gpus or 0, used.gpus, gpus)] if gpus else []),
    ):
        if limit is not None and now + asked > limit + 1e-9:
            raise QuotaExceeded(
                f"tenant {tenant!r} is over its {name} quota: the limit is {limit:g}, "
                f"{now:g} in use, {asked:g} asked: delete sandboxes or pools of this "
                "tenant, or ask the admin for a larger quota",
                details={"quota": name, "limit": limit, "used": now,
                         "requested": asked, "tenant": tenant},
            )


def snapshot_quota(quota_of: Callable[[str | None], Tenant | None]) -> Callable[[str | None], int | None]:
    """A tenant's snapshot disk quota in bytes (its token's ``max_snapshot_mb``), for
    :attr:`corral.runtime.snapshots.Snapshots.quota_of`: its snapshots' layers on disk,
    each layer once however many of its snapshots share it, checked before a snapshot
    is committed (nothing is kept on refusal). Counted from the registry: a restart
    keeps it."""
    def quota(owner: str | None) -> int | None:
        tenant = quota_of(owner)
        return None if tenant is None or tenant.max_snapshot_mb is None \
            else tenant.max_snapshot_mb << 20
    return quota
