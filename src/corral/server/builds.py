"""Image builds are admitted like sandboxes: a build may not use the host around its
tenant's quota or around admission control.

A build runs its steps one after another, each in a sandbox of the spec's
``memory_mb``, on ``cpus`` CPUs (all the host's for the admin; for a tenant with
``max_cpus``, no more than that). Before it starts, :meth:`BuildGate.admit`:

- refuses it at once if the host runs ``--max-builds`` builds already
  (:class:`~corral.errors.CapacityExceeded`, ``limit: max_builds``), or its tenant runs
  its own ``max_builds`` (default :data:`~corral.server.tenants.DEFAULT_MAX_BUILDS`;
  :class:`~corral.errors.QuotaExceeded`, ``quota: max_builds``);
- passes it through admission control as one sandbox of ``memory_mb`` (its tenant's
  ``max_sandboxes``/``max_memory_mb``/``max_cpus``, the host's caps and queue), held
  until the build ends however it ends (:meth:`BuildGate.release`).

What a build writes is bounded too: each step's layer by the spec's ``disk_mb`` and by
the host's disk reserve (:mod:`corral.runtime.image_build`).
"""

from __future__ import annotations

import secrets
from collections import Counter
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass

from starlette.requests import Request

from corral.errors import CapacityExceeded, QuotaExceeded
from corral.server import context as ctx
from corral.server.admission import Admission
from corral.server.tenants import DEFAULT_MAX_BUILDS, Tenant

__all__ = ["BuildGate", "BuildTicket", "builds_gate"]


@dataclass(frozen=True)
class BuildTicket:
    """One admitted build's place: ``id`` is what admission counts it under."""

    id: str
    owner: str | None


class BuildGate:
    """Builds at once, per host and per tenant, and their admission. One event loop."""

    def __init__(self, admission: Admission,
                 quota_of: Callable[[str | None], Tenant | None], max_builds: int) -> None:
        self.admission = admission
        self.max_builds = max_builds
        self._quota_of = quota_of
        self._running: Counter[str | None] = Counter()
        self._receiving: Counter[str | None] = Counter()  # contexts being uploaded

    @property
    def running(self) -> int:
        """Builds admitted and not yet released, all owners."""
        return sum(self._running.values())

    def running_of(self, owner: str | None) -> int:
        return self._running[owner]

    def cpus_for(self, owner: str | None, cores: float) -> float:
        """The CPUs a build's sandboxes get: ``cores``, or the tenant's ``max_cpus``."""
        quota = self._quota_of(owner)
        if quota is None or quota.max_cpus is None:
            return cores
        return max(0.01, min(cores, quota.max_cpus))

    @contextmanager
    def receiving(self, owner: str | None) -> Iterator[None]:
        """A build context being received (streamed to disk before its build is
        admitted, each up to --max-upload-bytes): counted with ``owner``'s builds, so no
        more contexts arrive at once than builds may run (before, any number did)."""
        self._check(owner)
        self._receiving[owner] += 1
        try:
            yield
        finally:
            self._receiving[owner] -= 1
            if self._receiving[owner] <= 0:
                del self._receiving[owner]

    def _check(self, owner: str | None) -> None:
        busy = self.running + sum(self._receiving.values())
        if busy >= self.max_builds:
            raise CapacityExceeded(
                f"this daemon runs or receives {busy} image builds already (--max-builds "
                f"{self.max_builds}): retry when one has finished",
                details={"limit": "max_builds", "value": self.max_builds},
            )
        if owner is not None:
            quota = self._quota_of(owner)
            limit = DEFAULT_MAX_BUILDS if quota is None or quota.max_builds is None \
                else quota.max_builds
            used = self._running[owner] + self._receiving[owner]
            if used >= limit:
                raise QuotaExceeded(
                    f"tenant {owner!r} is over its max_builds quota: the limit is {limit}, "
                    f"{used} running or being received: wait for its build to finish, or "
                    "ask the admin for more (corral token update --max-builds)",
                    details={"quota": "max_builds", "limit": limit,
                             "used": used, "requested": 1, "tenant": owner},
                )

    async def admit(self, owner: str | None, memory_mb: int, cpus: float) -> BuildTicket:
        """Room for one build of ``owner``, or the typed error saying which limit."""
        self._check(owner)
        ticket = BuildTicket("build-" + secrets.token_hex(6), owner)
        self._running[owner] += 1  # before waiting: the bounds hold for those queued too
        try:
            async with self.admission.admit(memory_mb, tenant=owner, cpus=cpus) as slot:
                slot.commit(ticket.id)  # counted like a live sandbox until released
        except BaseException:
            self._forget(owner)
            raise
        return ticket

    def release(self, ticket: BuildTicket) -> None:
        """The build ended (done, failed, cancelled): its places are free."""
        self.admission.release(ticket.id)
        self._forget(ticket.owner)

    def _forget(self, owner: str | None) -> None:
        self._running[owner] -= 1
        if self._running[owner] <= 0:
            del self._running[owner]


def builds_gate(request: Request) -> BuildGate:
    """The daemon's build gate, made on first use (one per app)."""
    state = request.app.state
    if not hasattr(state, "builds"):
        state.builds = BuildGate(ctx.admission(request), state.tenants.quota_of,
                                 ctx.settings(request).max_builds)
    gate: BuildGate = state.builds
    return gate
