"""Tenants on a Ray cluster: one registry for every node's daemon, kept in Ray's KV.

A daemon that ``corral cluster up`` started (it has ``--node`` and ``CORRAL_RAY_GCS``)
takes its tenants from the cluster's registry (:mod:`corral.cluster.tenant_registry`),
not from its own SQLite: ``corral token create|ls|revoke`` through any daemon (``ray://``
as the admin) makes a token valid on every node, on nodes that join later and on
daemons Ray restarts, which load the registry before they accept a tenant token.

- **Only hashes travel.** The token is made by the daemon serving the admin's request
  and is in its reply alone; the KV and the other daemons get its SHA-256.
- **Every node reads it.** Each daemon reloads the registry every :data:`REFRESH_S`;
  a create or revoke also tells every other daemon to reload at once
  (``POST /v1/peer/tenants/refresh``, with the cluster's peer credential).
- **Revoke fails closed.** A daemon accepts tenant tokens only while its copy is
  younger than :data:`LEASE_S` (counted from when its last successful read began);
  past that, every tenant token is refused there (401 saying why; the admin's token
  still works). So a revoke first writes the tombstone, then asks every daemon to
  reload; if one does not confirm (unreachable, partitioned), the revoke waits out the
  lease and names the node: by then that daemon has either read the tombstone or
  stopped accepting tenant tokens.
"""

from __future__ import annotations

import asyncio
import logging
import os
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any, TypeVar

import httpx

from corral.cluster import _ray, tenant_registry
from corral.cluster.bringup import read_entries
from corral.cluster.proof import Pins, async_proven_client, pins_of
from corral.errors import CorralError, DaemonUnavailable, InvalidArgument
from corral.runtime.engine import Engine
from corral.runtime.pools import PoolManager
from corral.server.cluster_quotas import ClusterQuotas
from corral.server.quotas import Quotas
from corral.server.settings import ServerSettings
from corral.server.tenants import (
    Tenant,
    check_new_tenant,
    check_updates,
    name_of_revoked,
    name_taken,
    new_token,
    no_tenant,
    token_digest,
)

logger = logging.getLogger("corral.server")
T = TypeVar("T")

GCS_ENV = "CORRAL_RAY_GCS"  # set by `corral cluster up` (cluster/node.py): its KV
REFRESH_S = 2.0
LEASE_S = 10.0
"""How long a daemon trusts its copy of the registry without reading it again."""
PEER_TIMEOUT_S = 5.0


def _tenant(entry: dict[str, Any]) -> Tenant:
    def num(key: str, kind: type) -> Any:
        value = entry.get(key)
        return None if value is None else kind(value)

    return Tenant(str(entry["name"]), num("max_sandboxes", int), num("max_memory_mb", int),
                  num("max_cpus", float), bool(entry.get("allow_images")),
                  float(entry.get("created_at") or 0.0), num("max_lifetime", float),
                  num("max_snapshot_mb", int), num("max_builds", int),
                  bool(entry.get("allow_host_network")), num("max_gpus", int))


def lease_clock() -> float:
    """Seconds on the clock a registry copy's lease runs on: CLOCK_BOOTTIME, which
    (unlike ``time.monotonic``) goes on while the host is suspended, so a node that
    wakes up holds no copy it could not have refreshed meanwhile."""
    return time.clock_gettime(time.CLOCK_BOOTTIME)


@dataclass
class _Copy:
    """One read of the registry."""

    started: float  # lease_clock() when the read began
    by_hash: dict[bytes, Tenant] = field(default_factory=dict)
    by_name: dict[str, Tenant] = field(default_factory=dict)
    revoked: set[str] = field(default_factory=set)


class ClusterTokenStore:
    """The cluster's tenants as this daemon last read them (a
    :class:`~corral.server.tenants.TenantStore`). Reads are in memory; :meth:`reload`
    and the writes are blocking calls to Ray's GCS (run them on a thread)."""

    def __init__(self, gcs: Any) -> None:
        self._gcs = gcs
        self._copy: _Copy | None = None

    # ----------------------------------------------------------- reading (loop)

    def fresh(self) -> bool:
        copy = self._copy
        return copy is not None and lease_clock() - copy.started < LEASE_S

    def unavailable(self) -> str | None:
        """Why tenant tokens are refused here now (None: they are not)."""
        if self.fresh():
            return None
        return ("this node's corral daemon could not read the cluster's tenant registry "
                f"(Ray's GCS) for {LEASE_S:g} s, so it refuses every tenant token until it "
                "can (the cluster's own token still works); see `corral cluster status`")

    def lookup(self, token: str) -> Tenant | None:
        copy = self._copy
        if copy is None or not self.fresh():
            return None  # fail closed: a revoke may not have reached this node
        return copy.by_hash.get(token_digest(token))

    def get(self, name: str) -> Tenant | None:
        copy = self._copy
        return None if copy is None else copy.by_name.get(name)

    def list(self) -> list[Tenant]:
        copy = self._copy
        return [] if copy is None else sorted(copy.by_name.values(), key=lambda t: t.name)

    def revoked(self, name: str) -> bool:
        copy = self._copy
        return copy is not None and name in copy.revoked and name not in copy.by_name

    # ----------------------------------------------------- the GCS (blocking)

    def reload(self) -> set[str]:
        """Read the registry again; the names revoked since the last read."""
        started = lease_clock()
        entries = tenant_registry.read_all(self._gcs)
        copy = _Copy(started)
        for name, entry in entries.items():
            if not tenant_registry.is_alive(entry):
                copy.revoked.add(name)
                continue
            try:
                tenant, digest = _tenant(entry), bytes.fromhex(entry["token_sha256"])
            except (TypeError, ValueError, KeyError):
                logger.warning("the cluster's tenant registry has a bad entry %r", name[:80])
                continue
            copy.by_hash[digest] = tenant
            copy.by_name[name] = tenant
        old = self._copy
        if old is not None and old.started > started:
            return set()  # a read that began later was applied already
        self._copy = copy
        return copy.revoked - (old.revoked if old is not None else set())

    def create(self, name: str, *, allow_images: bool = False,
               allow_host_network: bool = False, **quotas: Any) -> tuple[Tenant, str]:
        """A new tenant of the cluster and its token (only its hash is written);
        ``quotas``: names of :data:`~corral.server.tenants.QUOTAS`."""
        check_new_tenant(name, **quotas)
        token = new_token()
        tenant = Tenant(name, allow_images=allow_images, created_at=time.time(),
                        allow_host_network=allow_host_network, **quotas)
        record = {**tenant.to_dict(), "token_sha256": token_digest(token).hex()}
        if not tenant_registry.add(self._gcs, record):
            held = tenant_registry.get(self._gcs, name)
            if held is not None and not tenant_registry.is_alive(held):
                raise name_of_revoked(name)
            raise name_taken(name)
        self.reload()
        return tenant, token

    def update(self, name: str, changes: dict[str, Any]) -> Tenant:
        """Set quotas of a tenant in the registry (as :meth:`TokenStore.update`)."""
        check_updates(changes)
        held = tenant_registry.get(self._gcs, name)
        if held is None or not tenant_registry.is_alive(held):
            raise no_tenant(name)
        tenant_registry.replace(self._gcs, {**held, **changes})
        self.reload()
        found = self.get(name)
        if found is None:  # revoked meanwhile
            raise no_tenant(name)
        return found

    def revoke(self, name: str) -> None:
        """Write the tenant's tombstone (:class:`NotFound` if it has no token)."""
        held = tenant_registry.get(self._gcs, name)
        if held is None or not tenant_registry.is_alive(held):
            raise no_tenant(name)
        tenant_registry.revoke(self._gcs, name)


class ClusterTenancy:
    """This daemon's part in the cluster's tenants: the registry's copy, the quotas
    counted across nodes, and telling the other daemons of a change."""

    def __init__(self, gcs_address: str, node_id: str, token: str | None,
                 capacity: dict[str, Any] | None = None) -> None:
        self.node_id = node_id
        self._token = token
        self.gcs = _ray.gcs(gcs_address)
        self.store = ClusterTokenStore(self.gcs)
        # set by the app: what a revoke does here (server/revocation.py)
        self.on_revoked: Callable[[str], Awaitable[None]] | None = None
        self._quotas: ClusterQuotas | None = None
        try:
            self.store.reload()  # before the first request: a restarted daemon knows them
            tenant_registry.publish_capacity(self.gcs, node_id, capacity or {})
        except Exception as exc:  # the GCS is away: tenant tokens wait for it (fail closed)
            logger.warning("could not read the cluster's tenant registry yet: %s", exc)

    def capacities(self) -> dict[str, dict[str, Any]]:
        """Blocking: each node's caps, as its daemon wrote them at start."""
        return tenant_registry.read_capacities(self.gcs)

    def quotas(self, quota_of: Any) -> Quotas:
        self._quotas = ClusterQuotas(quota_of, self.gcs, self.node_id)
        return self._quotas

    async def run(self) -> None:
        """Reload the registry and the nodes' quota use every :data:`REFRESH_S`."""
        while True:
            await asyncio.sleep(REFRESH_S)
            try:
                await self.refresh()
            except Exception as exc:  # the GCS may come back: try again next time
                logger.warning("could not refresh the cluster's tenants: %s", exc)

    async def refresh(self) -> None:
        """Read the registry now; a tenant revoked since loses its calls, pools and
        sandboxes here (:attr:`on_revoked`)."""
        gone = await asyncio.to_thread(self.store.reload)
        if self._quotas is not None:
            await asyncio.to_thread(self._quotas.sync, *self._quotas.book())
        for name in sorted(gone):
            if self.on_revoked is not None:
                await self.on_revoked(name)

    # ----------------------------------------------------------- the admin

    async def create(self, **fields: Any) -> tuple[Tenant, str]:
        made: tuple[Tenant, str] = await on_gcs(lambda: self.store.create(**fields))
        await self.tell_peers(None)  # best effort: the others read it within REFRESH_S
        return made

    async def update(self, name: str, changes: dict[str, Any]) -> Tenant:
        tenant: Tenant = await on_gcs(lambda: self.store.update(name, changes))
        await self.tell_peers(None)  # best effort: the others read it within REFRESH_S
        return tenant

    async def revoke(self, name: str) -> dict[str, Any]:
        """Revoke everywhere; which nodes confirmed, which did not (and the lease waited)."""
        await on_gcs(lambda: self.store.revoke(name))
        written = time.monotonic()
        await self.refresh()
        confirmed, unconfirmed = await self.tell_peers(name)
        if unconfirmed:  # fail closed: past the lease they refuse it, or read the tombstone
            await asyncio.sleep(max(0.0, written + LEASE_S - time.monotonic()))
        return {"name": name, "confirmed": [self.node_id, *confirmed],
                "unconfirmed": unconfirmed, "lease_s": LEASE_S}

    async def tell_peers(self, name: str | None) -> tuple[list[str], list[dict[str, str]]]:
        """Ask every other node's daemon to reload; the nodes that confirmed (that
        ``name`` is revoked there, if given) and those that did not, with why."""
        peers, pins = await on_gcs(self._peers_pinned)
        headers = {"Authorization": f"Bearer {self._token}"} if self._token else {}

        async def one(http: httpx.AsyncClient, url: str) -> str | None:
            try:
                reply = await http.post(url + "/v1/peer/tenants/refresh",
                                        json={"name": name}, headers=headers)
            except httpx.HTTPError as exc:
                return f"{type(exc).__name__}: {exc}"
            if reply.status_code != 200:
                return f"HTTP {reply.status_code}"
            if name is not None and not reply.json().get("revoked"):
                return "it still knows the token"
            return None

        # each peer proves who it is before the peer credential is sent (cluster/proof.py)
        async with async_proven_client(pins, timeout=PEER_TIMEOUT_S) as http:
            errors = await asyncio.gather(*(one(http, url) for url in peers.values()))
        confirmed = [n for n, e in zip(peers, errors, strict=True) if e is None]
        unconfirmed = [{"node": n, "url": peers[n], "error": e}
                       for n, e in zip(peers, errors, strict=True) if e is not None]
        return confirmed, unconfirmed

    def peers(self) -> dict[str, str]:
        """``{node id: daemon URL}`` of every other alive node's daemon."""
        return self._peers_pinned()[0]

    def _peers_pinned(self) -> tuple[dict[str, str], Pins]:
        states = _ray.node_states(self.gcs)
        entries = {n: e for n, e in read_entries(self.gcs).items()
                   if n != self.node_id and states.get(n, {}).get("alive")}
        return {n: str(e["url"]) for n, e in entries.items()}, pins_of(entries.values())


async def on_gcs(call: Callable[[], T]) -> T:
    """``call()`` (blocking calls to Ray's GCS) on a thread; a GCS that does not answer
    is :class:`DaemonUnavailable` saying so (corral's own errors pass unchanged)."""
    try:
        return await asyncio.to_thread(call)
    except CorralError:
        raise
    except Exception as exc:
        raise DaemonUnavailable(
            f"this daemon cannot reach its Ray cluster's GCS ({type(exc).__name__}: "
            f"{str(exc)[:200]}): retry, and see `corral cluster status`") from None


async def drop_pools(pools: PoolManager | None, name: str) -> None:
    """A revoked tenant's pools go (nobody may use them, and their refills would go on)."""
    if pools is None:
        return
    for pool in pools.list_pools(owner=None):  # the daemon's own work: every owner's
        if pool.spec.tenant == name:
            await pools.delete_owned(name, pool.name)  # its own: names are per tenant


def open_tenancy(settings: ServerSettings, engine: Engine) -> ClusterTenancy | None:
    """This daemon's :class:`ClusterTenancy` if it serves a node of a Ray cluster
    (``--node`` and ``CORRAL_RAY_GCS``, as ``corral cluster up`` starts it), else None
    (its tenants are in its own registry)."""
    gcs = os.environ.get(GCS_ENV)
    if not gcs or settings.node is None:
        return None
    if not settings.token:
        raise InvalidArgument("a daemon of a cluster needs the cluster's token (CORRAL_TOKEN)")
    try:
        capacity = {"max_sandboxes": settings.max_sandboxes,
                    "max_memory_mb": settings.max_memory_mb,
                    "max_starting": settings.max_starting}
        # its peers are told of a change with the peer credential (server/peer_auth.py)
        return ClusterTenancy(gcs, settings.node, settings.peer_token or settings.token,
                              capacity)
    except DaemonUnavailable as exc:
        raise DaemonUnavailable(f"the daemon of node {settings.node} cannot reach its Ray "
                                f"cluster's GCS at {gcs}: {exc}") from None
