"""The sandbox service: what every front-end does to sandboxes, with its rules.

The native HTTP routes, the Tensorlake and cwsandbox front-ends and the pools all
create, delete, stop and fork sandboxes through this one object, and nothing of
theirs reaches below it for those: the rules live here once.

- **Planning** (:meth:`SandboxService.plan`) turns a requested spec into the one that
  will run (a snapshot's spec fills the fields left out) and refuses it now, before
  it waits in the admission queue: an unknown snapshot or image, more than the host
  has, ``network="host"`` for a caller not allowed it.
- **Admission**: a create waits for admission control, which counts the memory the
  sandbox will really get; its place is given back when the sandbox is deleted or
  stopped, and so is a pool's place (:meth:`release`, the one bookkeeping step).
- **Fork** is one snapshot and ``n`` admitted creates from it, all or nothing (the
  engine's one fork, :func:`~corral.runtime.engine_snapshots.fork_from`).
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable, Callable, Iterable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from corral.errors import CorralError, Forbidden, NoGpuCapacity, SandboxNotFound
from corral.network_schema import NetworkInfo, NetworkPolicy
from corral.pool_schema import PoolInfo
from corral.runtime.distribution import is_reference
from corral.runtime.engine import Engine
from corral.runtime.engine_hibernate import HIBERNATED
from corral.runtime.engine_snapshots import Abandoned, fork_from
from corral.runtime.events import SandboxEnded, SandboxHibernated
from corral.runtime.gpus import tenant_view
from corral.runtime.image_pull import local_name, pull_image
from corral.runtime.pools import PoolManager
from corral.schema import (
    MAX_TIMEOUT_S,
    NetworkMode,
    SandboxInfo,
    SandboxSpec,
    SandboxState,
    SnapshotInfo,
)
from corral.server.admission import LIVE_STATES, Admission
from corral.server.caller import Caller
from corral.server.limits import (
    DAEMON_LIFETIME,
    TENANT_LIFETIME,
    capped_lifetime,
    check_create_lifetime,
    check_host_limits,
    check_total_lifetime,
)
from corral.server.reserved_tags import check_tags
from corral.server.tenants import Tenants

if TYPE_CHECKING:
    from corral.server.leases import Leases

__all__ = ["Abandoned", "CreateFinished", "SandboxService", "check_network",
           "uses_host_network_right"]


@dataclass(frozen=True)
class CreateFinished:
    """Announced on the engine's events when :meth:`SandboxService.create` ends:
    ``result`` is ``"ok"``, an error's ``code`` or ``"cancelled"``; the times are
    ``time.monotonic()`` (``admitted``: None if it never got past admission)."""

    result: str
    began: float
    admitted: float | None
    ended: float


def owned_by(spec: SandboxSpec, caller: Caller) -> SandboxSpec:
    """``spec`` as ``caller`` makes it: a tenant's things are its own (the admin's
    keep the owner they name: a pool refills for its tenant)."""
    if caller.name is None or spec.tenant == caller.name:
        return spec
    return spec.model_copy(update={"tenant": caller.name})


def uses_host_network_right(spec: SandboxSpec) -> bool:
    """Whether ``spec``'s network needs the host-network right: the host's network, or
    a policy allowing a private, loopback or link-local range."""
    return spec.network == NetworkMode.HOST or (
        isinstance(spec.network, NetworkPolicy) and bool(spec.network.names_special()))


def check_network(spec: SandboxSpec, *, host_network: bool, admin: bool) -> None:
    """``network="host"`` hands a sandbox the host's network (its services, the cloud
    metadata address): only to a caller allowed it (see :meth:`SandboxService.plan`).
    A policy naming a private, loopback or link-local CIDR: only the admin's."""
    if spec.network == NetworkMode.HOST and not (host_network and admin):
        raise Forbidden(
            "network='host' gives the sandbox the host's network: over TCP it needs a "
            "daemon started with --allow-host-network and, for a tenant, a token made with "
            "`corral token create --allow-host-network` (the Unix socket may always ask); "
            "a tenant may ask for a policy {'allow': ['example.com', ...]} instead "
            "(docs/network.md)",
            details={"field": "network"},
        )
    if isinstance(spec.network, NetworkPolicy) and not admin and spec.network.names_special():
        raise Forbidden(
            f"network rules {spec.network.names_special()} name private, loopback or "
            "link-local addresses: only the admin may allow those; allow public names "
            "or addresses instead",
            details={"field": "network.allow"},
        )


class SandboxService:
    """Create, delete, stop and fork sandboxes under admission control and pools."""

    def __init__(
        self, engine: Engine, admission: Admission, tenants: Tenants | None = None,
        *, max_lifetime: float = MAX_TIMEOUT_S,
    ) -> None:
        self.engine = engine
        self.max_lifetime = max_lifetime  # --max-lifetime: bounds every create's timeout
        self.admission = admission
        self.tenants = tenants  # tokens and quotas (server/tenants.py); None: no tenants
        self.leases: Leases | None = None  # client leases (server/leases.py), set by the app
        self.pools = PoolManager(engine, create=self._refill, delete=self._delete_admitted)
        engine.events.subscribe(SandboxEnded, self._ended)
        # a hibernated sandbox leaves the caps; its resume waits for room like a create
        engine.events.subscribe(SandboxHibernated, lambda e: admission.asleep(e.sandbox_id))
        engine.resume_gate = lambda info: admission.readmit(
            info.id, info.spec.memory_mb, tenant=info.spec.tenant)

    def count_adopted(self) -> None:
        """Count the sandboxes the engine adopted from the daemon before it (live
        restore) against the caps and their tenants' quotas (at the daemon's start)."""
        for info in self.engine.list(state=LIVE_STATES, owner=None):  # the daemon's own work
            gpus = len(self.engine.gpus.held_by(info.id))
            asleep = info.reason == HIBERNATED  # in its tenant's quota, not the caps
            if asleep:  # none held while it sleeps; its resume takes them
                gpus = self.engine.gpus.count(info.spec.gpus)
            self.admission.adopt(info.id, info.spec.memory_mb, info.spec.tenant, info.spec.cpus,
                                 gpus, asleep=asleep)

    def _ended(self, event: SandboxEnded) -> None:
        """However a sandbox ended (its lifetime, a crash, a delete), its places are free."""
        self.release(event.sandbox_id)

    # ---------------------------------------------------------------- tenants
    # Ownership is one rule (runtime/ownership.py): every verb here takes the Caller the
    # door resolved and passes its owner to the engine explicitly (the engine's lookups
    # by id and lists then show only what that tenant owns); nothing is ambient.

    def lifetime_limit(self, owner: str | None) -> tuple[float, str]:
        """The longest total lifetime, from create, that ``owner``'s sandboxes (None:
        the admin's) may have, and whose maximum it is: the daemon's
        ``--max-lifetime``, or the tenant's if that is lower."""
        tenant = self.tenants.quota_of(owner) if self.tenants else None
        if tenant is not None and tenant.max_lifetime is not None \
                and tenant.max_lifetime < self.max_lifetime:
            return tenant.max_lifetime, TENANT_LIFETIME
        return self.max_lifetime, DAEMON_LIFETIME

    def list_sandboxes(
        self, caller: Caller, *, tags: Sequence[str] = (),
        states: Sequence[SandboxState | str] | None = None, tenant: str | None = None,
    ) -> list[SandboxInfo]:
        """The caller's sandboxes (the admin's: all, or only ``tenant``'s)."""
        found = self.engine.list(tags=tags, state=states, owner=caller.name)
        return found if tenant is None else [i for i in found if i.spec.tenant == tenant]

    @staticmethod
    def own(caller: Caller, infos: Iterable[SandboxInfo]) -> list[SandboxInfo]:
        """Those of ``infos`` ``caller`` itself owns (the admin: its own, not its
        tenants'): what a lookup by name or metadata may resolve to."""
        return [i for i in infos if i.spec.tenant == caller.name]

    def list_snapshots(self, caller: Caller) -> list[SnapshotInfo]:
        """The caller's snapshots (the admin's: all)."""
        return self.engine.list_snapshots(owner=caller.name)

    def list_pools(self, caller: Caller) -> list[PoolInfo]:
        """The caller's pools (the admin's: all)."""
        return self.pools.list_pools(owner=caller.name)

    # ----------------------------------------------------------------- create

    async def with_image(self, spec: SandboxSpec, caller: Caller) -> SandboxSpec:
        """``spec`` with a registry reference as its image (``host/repo:tag``) replaced
        by the local image it was pulled as, pulling it on first use (concurrent first
        uses pull once). Only the admin makes the daemon reach a registry: a tenant may
        name a reference the admin (or ``corral image pull``) already pulled."""
        if not is_reference(spec.image):
            return spec
        store = self.engine.images
        name = local_name(spec.image)
        if caller.name is not None and not store.exists(name):
            raise Forbidden(
                f"image {spec.image} is not pulled yet, and tenants do not make the daemon "
                "reach registries: ask the admin to `corral image pull` it",
                details={"image": spec.image})
        image = await asyncio.to_thread(pull_image, store, spec.image, if_missing=True)
        return spec.model_copy(update={"image": image.name})

    def plan(
        self, spec: SandboxSpec, caller: Caller, *, host_network: bool = False,
        frontend: str = "native",
    ) -> SandboxSpec:
        """The spec that will run for ``caller`` (from the door), or the typed error it
        would meet, before queueing.

        ``host_network``: whether this caller may have ``network="host"`` (the daemon
        was started with ``--allow-host-network``, or it asks on the Unix socket).
        ``frontend``: which front-end asks; only its own reserved tags may be set
        (:mod:`corral.server.reserved_tags`).
        """
        try:
            check_tags(spec.tags, frontend)
            check_create_lifetime(spec, *self.lifetime_limit(caller.name))  # --max-lifetime
            if self.leases is not None:  # a lease tag: a live lease of the caller's
                self.leases.check_tags(spec.tags, caller.name)
            # SnapshotNotFound now, not after queueing; NetworkNotFound now, checked below
            spec = self.engine.resolve_spec(spec, owner=caller.name)
            spec = self.engine.resolve_network(spec, owner=caller.name)
            self.engine.images.get(spec.image)  # ImageNotFound now, too
            check_host_limits(spec)
            check_network(spec, host_network=host_network, admin=caller.may_use_host_network)
        except CorralError as exc:  # a create refused: counted like one that failed
            now = time.monotonic()
            self.engine.events.emit(CreateFinished(exc.code, now, None, now))
            raise
        return spec

    async def _wait_for_gpus(self, spec: SandboxSpec, wait: float | None) -> None:
        """Wait up to ``wait`` (capped by ``queue_timeout``) for the GPUs ``spec`` asks
        for; a tenant with ``queue_size`` creates waiting already is refused at once."""
        limits = self.admission.limits
        with self.admission.gpu_wait(spec.tenant) as may_wait:
            try:
                await self.engine.gpus.wait_for_room(
                    spec.gpus, shared=spec.gpu_shared,
                    timeout=0.0 if wait is None or not may_wait else min(wait, limits.queue_timeout))
            except NoGpuCapacity as exc:
                if wait is None or may_wait:
                    raise
                raise NoGpuCapacity(
                    f"{exc.message} (not waited for: tenant {spec.tenant!r} has "
                    f"{limits.queue_size} creates waiting already, the daemon's queue_size)",
                    details={**exc.details, "waiting": limits.queue_size}) from None

    async def _refill(self, spec: SandboxSpec) -> SandboxInfo:
        """A pool's refill: the daemon's work, for the pool's owner (``spec.tenant``)."""
        return await self.create(spec, Caller.on_behalf_of(spec.tenant))

    async def create(
        self, spec: SandboxSpec, caller: Caller, *, wait: float | None = None,
    ) -> SandboxInfo:
        """Create a sandbox for ``caller`` once admission control lets it start (a
        pool's refills too): a tenant's sandbox is its own, whatever ``spec.tenant`` says.

        A ``snapshot`` is resolved first, so admission counts the memory it will get.
        ``wait``: the caller's deadline for the wait for room or for its tenant's quota
        (default and cap: the daemon's ``queue_timeout``).
        """
        began, admitted, result = time.monotonic(), None, "internal"
        try:  # a tenant's own
            spec = owned_by(self.engine.resolve_spec(spec, owner=caller.name), caller)
            # a fork's or a refill's network (a create's was checked by plan): against
            # the owner's rights as they are now (a right taken back refuses them)
            spec = self.engine.resolve_network(spec, owner=caller.name)
            self._check_host_right(spec, caller)
            # a default or inherited one; the owner's limit (a pool refills as the daemon)
            spec = capped_lifetime(spec, self.lifetime_limit(spec.tenant)[0])
            check_host_limits(spec)
            n_gpus = self.engine.gpus.count(spec.gpus)  # a tenant's: its token's max_gpus
            # its quota first (QuotaExceeded at max_gpus), then, none free, a wait (as for
            # a quota) for a GPU sandbox to end
            async with self.admission.admit(
                spec.memory_mb, tenant=spec.tenant, cpus=spec.cpus, wait=wait, gpus=n_gpus,
                then=(lambda: self._wait_for_gpus(spec, wait)) if n_gpus else None,
            ) as slot:
                admitted = time.monotonic()
                self._check_host_right(spec, caller)  # taken back while it waited: refused
                created = await self.engine.create(spec, owner=caller.name)
                slot.commit(created.id)
            await self._still_entitled(created.id, spec, caller)
            result = "ok"
        except NoGpuCapacity as exc:
            result = exc.code
            if caller.name is None:  # the admin sees which GPUs are free
                raise
            raise tenant_view(exc) from None
        except CorralError as exc:
            result = exc.code
            raise
        except asyncio.CancelledError:
            result = "cancelled"
            raise
        finally:  # metrics hear of every create, once (server/metrics.py)
            self.engine.events.emit(CreateFinished(result, began, admitted, time.monotonic()))
        if self._ended_already(created.id):  # it ended before it was counted
            self.admission.release(created.id)
        return created

    def _may_use_host_network(self, caller: Caller) -> bool:
        """The caller's host-network right as the registry says now: a tenant's (or the
        daemon's acting for one: a pool's refill), not as its token said when its request
        began (a right taken back while it waited: ``PATCH /v1/tokens``)."""
        if caller.name is None or self.tenants is None:
            return caller.may_use_host_network
        tenant = self.tenants.quota_of(caller.name)
        return tenant is not None and tenant.allow_host_network

    def _check_host_right(self, spec: SandboxSpec, caller: Caller) -> None:
        if uses_host_network_right(spec):
            check_network(spec, host_network=True, admin=self._may_use_host_network(caller))

    async def _still_entitled(self, sandbox_id: str, spec: SandboxSpec, caller: Caller) -> None:
        """The right checked once more after the sandbox started: one taken back while it
        started (after the revocation listed its tenant's sandboxes) ends it, refused."""
        try:
            self._check_host_right(spec, caller)
        except Forbidden:
            await self._delete_admitted(sandbox_id)
            raise

    def _ended_already(self, sandbox_id: str) -> bool:
        try:
            return self.engine.get(sandbox_id, owner=None).state.terminal
        except SandboxNotFound:
            return True

    def lifetime_left(self, info: SandboxInfo) -> float:
        """Seconds ``info``'s sandbox may still live under its owner's maximum."""
        return max(0.0, self.lifetime_limit(info.spec.tenant)[0] - (time.time() - info.created_at))

    async def set_timeout(self, sandbox_id: str, seconds: float, caller: Caller) -> SandboxInfo:
        """End the sandbox ``seconds`` from now, within its owner's maximum lifetime
        counted from its create: however often it is moved, a sandbox never outlives
        ``--max-lifetime`` (or its tenant's, if lower)."""
        info = self.engine.get(sandbox_id, owner=caller.name)  # SandboxNotFound: another's too
        limit, whose = self.lifetime_limit(info.spec.tenant)
        check_total_lifetime(info, seconds, limit, whose)
        return await self.engine.set_timeout(info.id, seconds, owner=caller.name)

    # ------------------------------------------------------------------- end

    async def _delete_admitted(self, sandbox_id: str, owner: str | None = None) -> bool:
        # False: none ``owner`` may see (another tenant's keeps its places); None: the
        # daemon's own work (a pool's sandbox)
        # its processes have exited when this returns; the rest of its teardown (cgroup,
        # mounts, directories: kernel waits) goes on in the background
        if not await self.engine.delete(sandbox_id, owner=owner, wait=False):
            return False
        self.admission.release(sandbox_id)
        return True

    async def delete(self, sandbox_id: str, caller: Caller) -> None:
        """Delete ``caller``'s sandbox (idempotent) and give its places back."""
        if await self._delete_admitted(sandbox_id, caller.name):
            self.pools.release(sandbox_id)

    async def update_network(
        self, sandbox_id: str, network: NetworkPolicy, caller: Caller,
    ) -> SandboxInfo:
        """A running policy sandbox's new policy (a tenant's may name no private range)."""
        spec = SandboxSpec.parse(network=network.model_dump())
        check_network(spec, host_network=False, admin=self._may_use_host_network(caller))
        return await self.engine.update_network(sandbox_id, network, owner=caller.name)

    def create_network(self, name: str, policy: NetworkPolicy, caller: Caller, *,
                       private: bool = False) -> NetworkInfo:
        """A named network (``corral.Network``) of the caller's: a tenant's may name no
        private range (as its sandboxes' policies may not)."""
        check_network(SandboxSpec.parse(network=policy.model_dump()), host_network=False,
                      admin=self._may_use_host_network(caller))
        return self.engine.create_network(name, policy, private=private, owner=caller.name)

    async def stop(
        self, sandbox_id: str, caller: Caller, *, grace: float,
        reason: str = "stopped by request",
    ) -> SandboxInfo:
        """Stop ``caller``'s sandbox (its record stays) and give its places back."""
        stopped = await self.engine.stop(sandbox_id, grace=grace, reason=reason,
                                         owner=caller.name)
        self.release(stopped.id)
        return stopped

    def release(self, sandbox_id: str) -> None:
        """The sandbox ended: its admission place and its pool place are free."""
        self.admission.release(sandbox_id)
        self.pools.release(sandbox_id)

    # ------------------------------------------------------------------- fork

    async def fork(
        self,
        sandbox_id: str,
        n: int,
        caller: Caller,
        *,
        tags: Sequence[str] | None = None,
        abandoned: Callable[[], Awaitable[bool]] | None = None,
        frontend: str = "native",
        live: bool | None = None,
        each: bool = False,
    ) -> list[Any]:
        """``n`` new sandboxes with this one's files and spec (``live``: its processes
        too), each created through admission control; all or nothing, or with ``each``
        one :class:`SandboxInfo` or exception per copy
        (:func:`~corral.runtime.engine_snapshots.fork_from`)."""
        check_tags(tags or (), frontend)  # the new ones' tags: reserved_tags

        async def create(spec: SandboxSpec) -> SandboxInfo:
            return await self.create(spec, caller)

        async def delete(sid: str) -> None:
            await self.delete(sid, caller)

        # n copies that could never be alive at once: a 400 now, before the snapshot
        self.admission.check_fits(self.engine.get(sandbox_id, owner=caller.name).spec.memory_mb, n)
        return await fork_from(self.engine, sandbox_id, n, create=create, delete=delete,
                               tags=tags, abandoned=abandoned, live=live, each=each,
                               owner=caller.name)
