"""A tenant's quotas held across a Ray cluster: a tenant at its quota on node A cannot
create on node B.

Each daemon keeps its own book (:class:`~corral.server.quotas.Quotas`: exact among its
own creates) and writes what it holds for each tenant to the cluster's KV
(``tenant-usage:<node>``, :mod:`corral.cluster.tenant_registry`). A create of a
tenant that has a quota, on any node:

1. reserves in the local book (refused at once if this node's use alone passes);
2. **publishes** this node's book, the new reservation in it;
3. **then reads** every alive node's book and refuses (:class:`QuotaExceeded`, the
   reservation given back) if the sum passes a quota.

No overshoot: of two creates on different nodes, the one that read last read after
the other had published (each publishes before it reads), so it counted it. Nothing is
exact for free, though: two creates racing for the last place may both see each other
and both be refused. A refusal that other nodes' use decided is tried again after
:data:`RETRY_S` (twice), which also lets a delete just made on another node (published
at once, but asynchronously) be seen. Each create of such a tenant costs calls to
Ray's GCS (three, ~3 ms here: ``benchmarks/bench_cluster_tenants.py``); tenants
without quotas and the admin cost nothing. A daemon that restarts (its sandboxes lost)
writes its empty book at start; a node Ray marks dead stops counting at the next sync
(a few seconds) and its book is deleted then (Ray forgets old dead nodes: a book left
behind would count again), one that joins counts at once. If the GCS cannot be read,
a tenant with quotas cannot create (fail closed: :class:`DaemonUnavailable`).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import threading
from collections.abc import Callable
from typing import Any

from corral.cluster import _ray, tenant_registry
from corral.errors import DaemonUnavailable, QuotaExceeded
from corral.server.quotas import Hold, Quotas, Usage, check, total
from corral.server.tenants import Tenant

logger = logging.getLogger("corral.server")

RETRY_S = (0.05, 0.25)  # waits before the second and third look at the other nodes


def _limited(quota: Tenant | None) -> bool:
    return quota is not None and any(
        q is not None for q in (quota.max_sandboxes, quota.max_memory_mb, quota.max_cpus))


class ClusterQuotas(Quotas):
    """The quota book of one node of a cluster, checked against every node's."""

    def __init__(self, quota_of: Callable[[str | None], Tenant | None], gcs: Any,
                 node_id: str) -> None:
        super().__init__(quota_of)
        self._gcs = gcs
        self._node = node_id
        self._write_lock = threading.Lock()
        self._seq = self._written = 0  # the last book numbered, and the last written
        self._elsewhere: dict[str, Usage] = {}  # other alive nodes' sums, as last read
        self._dead: set[str] = set()  # Ray's dead nodes, as of the last sync
        with contextlib.suppress(Exception):  # a restarted daemon holds nothing yet
            self._write(*self.book())

    def usage(self, tenant: str) -> Usage:
        """What ``tenant`` holds on the whole cluster (other nodes as last read)."""
        return total(super().usage(tenant), self._elsewhere.get(tenant))

    async def acquire(self, tenant: str | None, memory_mb: int, cpus: float,
                      gpus: int = 0) -> Hold | None:
        quota = self._quota_of(tenant) if tenant is not None else None
        if tenant is None or not (_limited(quota) or gpus):
            hold = self.hold(tenant, memory_mb, cpus, gpus=gpus)
            if hold is not None:  # shown in `token ls` (the admin's are not counted)
                self._kick()
            return hold
        for attempt, wait in enumerate((0.0, *RETRY_S)):
            await asyncio.sleep(wait)
            hold = self.hold(tenant, memory_mb, cpus, gpus=gpus)  # this node's own use alone
            assert hold is not None
            try:
                elsewhere = await asyncio.to_thread(self._publish_and_read, tenant, *self.book())
            except BaseException as exc:  # a cancel too (its client hung up): give it back
                self._give_back(hold)
                self._kick()
                if not isinstance(exc, Exception):
                    raise
                raise DaemonUnavailable(
                    f"cannot check tenant {tenant!r}'s quotas across the cluster: Ray's GCS "
                    f"does not answer ({type(exc).__name__}); retry, or see `corral cluster "
                    "status`") from None
            before = total(super().usage(tenant), elsewhere)
            before.add(hold.memory_mb, hold.cpus, -1, hold.gpus)  # the cluster's but this
            try:
                check(tenant, quota, before, hold.memory_mb, hold.cpus, hold.gpus)
            except QuotaExceeded:
                self._give_back(hold)
                self._kick()
                if attempt == len(RETRY_S):
                    raise
                continue
            return hold
        raise AssertionError("unreachable")  # pragma: no cover

    def settle(self, hold: Hold | None, sandbox_id: str | None) -> None:
        super().settle(hold, sandbox_id)
        if hold is not None and sandbox_id is None:
            self._kick()  # a create that failed or was abandoned: its place, at once

    def release(self, sandbox_id: str) -> None:
        if self.holds(sandbox_id):
            super().release(sandbox_id)
            self._kick()  # at once: a create on another node may wait for this

    # --------------------------------------------------------------- the GCS

    def book(self) -> tuple[int, dict[str, list[float]]]:
        """This node's book as it is now, numbered (taken on the event loop, which
        alone changes it; written on a thread)."""
        self._seq += 1
        return self._seq, {t: [u.sandboxes, u.memory_mb, u.cpus, u.gpus]
                           for t, u in self.local().items()}

    def _kick(self) -> None:
        """Write this node's book now, on a thread."""
        try:
            loop = asyncio.get_running_loop()
        except RuntimeError:
            return  # the periodic sync writes it
        loop.run_in_executor(None, self._write_quietly, *self.book())

    def _write_quietly(self, seq: int, book: dict[str, list[float]]) -> None:
        try:
            self._write(seq, book)
        except Exception as exc:
            logger.debug("could not write this node's quota use: %s", exc)

    def _write(self, seq: int, book: dict[str, list[float]]) -> None:
        with self._write_lock:  # one write at a time, never of an older book than the last
            if seq > self._written:
                tenant_registry.publish_usage(self._gcs, self._node, book)
                self._written = seq

    def _publish_and_read(self, tenant: str, seq: int, book: dict[str, list[float]]) -> Usage:
        self._write(seq, book)  # (or a newer book, this create in it too, was written)
        self._read()
        return self._elsewhere.get(tenant, Usage())

    def _read(self) -> set[str]:
        """Sum the other alive nodes' books; the dead nodes that still have one."""
        books = tenant_registry.read_usage(self._gcs)
        dead = self._dead  # known dead; a node that joined since is counted
        elsewhere: dict[str, Usage] = {}
        for node, book in books.items():
            if node == self._node or node in dead:
                continue
            for tenant, used in book.items():
                try:  # [sandboxes, MB, CPUs, GPUs] (a node from before GPUs: three)
                    n, mb, c, g = (float(x) for x in [*used, 0][:4])
                except (TypeError, ValueError):
                    continue
                part = elsewhere.setdefault(tenant, Usage())
                part.sandboxes += int(n)
                part.memory_mb += int(mb)
                part.cpus += c
                part.gpus += int(g)
        self._elsewhere = elsewhere
        return dead & set(books)

    def sync(self, seq: int, book: dict[str, list[float]]) -> None:
        """Blocking: write this node's ``book`` (:meth:`book`), learn which nodes died,
        read the others' (every few seconds, for ``corral token ls``)."""
        self._write(seq, book)
        self._dead = {n for n, s in _ray.node_states(self._gcs).items() if not s["alive"]}
        for node in self._read():  # Ray forgets old dead nodes: their books would count again
            tenant_registry.drop_usage(self._gcs, node)

