"""Admission control: how many sandboxes may start, live, and how much memory they get.

A create passes three caps (``max_starting`` sandboxes starting at once,
``max_sandboxes`` alive, ``max_memory_mb`` committed). One that does not fit waits in
a FIFO queue of at most ``queue_size`` entries for up to ``queue_timeout`` seconds;
past either bound it fails with :class:`~corral.errors.CapacityExceeded`, whose
``details["limit"]`` names the cap. What could never fit however long it waited (more
memory than ``max_memory_mb``, a fork of more copies than the caps allow at once) is an
:class:`~corral.errors.InvalidArgument` at once (:meth:`Admission.check_fits`)::

    admission = Admission(limits)
    engine.events.subscribe(SandboxEnded, lambda e: admission.release(e.sandbox_id))
    async with admission.admit(spec.memory_mb) as slot:
        info = await engine.create(spec)
        slot.commit(info.id)       # now it counts as alive until released
    ...
    admission.release(info.id)     # on delete / stop

A hibernated sandbox holds no process and no memory: it leaves the caps
(:meth:`Admission.asleep`) but keeps its place in its tenant's quota (hibernating is
no way for a tenant to hold more sandboxes, and its own quota never refuses its
resume). Its resume waits for room like a create (:meth:`Admission.readmit`) and fails
with :class:`~corral.errors.CapacityExceeded` past ``queue_timeout``, hibernated still.

Sandboxes the engine ends by itself (lifetime, idle timeout, a crash) free their
room when the engine announces it (:class:`~corral.runtime.events.SandboxEnded`,
wired by :class:`~corral.server.service.SandboxService`): nothing polls.
"""

from __future__ import annotations

import asyncio
from collections import Counter, deque
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator
from contextlib import asynccontextmanager, contextmanager
from dataclasses import dataclass

from corral.errors import CapacityExceeded, DaemonUnavailable, InvalidArgument, QuotaExceeded
from corral.schema import SandboxState
from corral.server.quotas import Hold, Quotas

QUOTA_RECHECK_S = 1.0
"""How often a create waiting for its tenant's quota looks again without being woken
(a cluster's book counts other nodes' sandboxes, whose ends it is not told of)."""

LIVE_STATES = (  # the states that count against the caps
    SandboxState.PENDING,
    SandboxState.RUNNING,
    SandboxState.PAUSED,
    SandboxState.STOPPING,
)


@dataclass(frozen=True)
class Limits:
    """The caps of one daemon (see :class:`corral.server.ServerSettings`)."""

    max_starting: int
    max_sandboxes: int
    max_memory_mb: int
    queue_size: int
    queue_timeout: float


@dataclass
class Slot:
    """A place to start one sandbox; :meth:`commit` the id once it exists."""

    memory_mb: int
    sandbox_id: str | None = None

    def commit(self, sandbox_id: str) -> None:
        self.sandbox_id = sandbox_id


@dataclass
class _Waiter:
    memory_mb: int
    granted: asyncio.Future[None]
    blocked_by: str | None = None


class Admission:
    """Caps and a FIFO queue for sandbox creates. Lives on one event loop."""

    def __init__(self, limits: Limits, quotas: Quotas | None = None) -> None:
        self.limits = limits
        self.quotas = quotas or Quotas(lambda tenant: None)  # per tenant: server/quotas.py
        self._starting = 0
        self._starting_mb = 0
        # per owner (None: the admin), for a tenant's own view (GET /v1/info)
        self._starting_of: Counter[str | None] = Counter()
        self._queued_of: Counter[str | None] = Counter()
        self._admitted: dict[str, int] = {}
        self._queue: deque[_Waiter] = deque()
        self._quota_waiting: dict[str, int] = {}  # per tenant: creates waiting for its quota
        self._closed = False

    # ----------------------------------------------------------------- numbers

    @property
    def starting(self) -> int:
        """Creates admitted and still starting."""
        return self._starting

    @property
    def queued(self) -> int:
        """Creates waiting for room."""
        return len(self._queue)

    def starting_of(self, tenant: str | None) -> int:
        """Creates of ``tenant`` admitted and still starting."""
        return self._starting_of[tenant]

    def queued_of(self, tenant: str | None) -> int:
        """Creates of ``tenant`` waiting in the queue."""
        return self._queued_of[tenant]

    @property
    def alive(self) -> int:
        """Sandboxes counted against ``max_sandboxes`` (starting ones included)."""
        return len(self._admitted) + self._starting

    @property
    def committed_memory_mb(self) -> int:
        """Sum of ``memory_mb`` of live and starting sandboxes."""
        return sum(self._admitted.values()) + self._starting_mb

    # ------------------------------------------------------------------ admit

    def check_fits(self, memory_mb: int, n: int = 1) -> None:
        """:class:`InvalidArgument` if ``n`` sandboxes of ``memory_mb`` could never be
        alive at once under the caps, however long they waited (a 4xx: the request is
        wrong, a retry would fail the same way)."""
        caps = self.limits
        if n > caps.max_sandboxes:
            raise InvalidArgument(
                f"{n} sandboxes can never be alive at once under this daemon's "
                f"max_sandboxes of {caps.max_sandboxes}: ask for fewer",
                details={"errors": [{"field": "n", "message": "above max_sandboxes"}],
                         "limit": "max_sandboxes", "value": caps.max_sandboxes},
            )
        if memory_mb * n > caps.max_memory_mb:
            what = f"a sandbox of {memory_mb} MB" if n == 1 else f"{n} sandboxes of {memory_mb} MB"
            raise InvalidArgument(
                f"{what} can never fit under this daemon's max_memory_mb of "
                f"{caps.max_memory_mb}: ask for less memory",
                details={"errors": [{"field": "memory_mb", "message": "above max_memory_mb"}],
                         "limit": "max_memory_mb", "value": caps.max_memory_mb},
            )

    @asynccontextmanager
    async def admit(
        self, memory_mb: int, *, tenant: str | None = None, cpus: float = 0.0,
        wait: float | None = None, gpus: int = 0,
        then: Callable[[], Awaitable[None]] | None = None,
    ) -> AsyncIterator[Slot]:
        """Wait for room for a sandbox of ``memory_mb``; hold it while it starts.

        ``wait`` is the caller's deadline in seconds (capped by ``queue_timeout``) for
        both waits together: for room, and for a ``tenant`` at its quota, for its own
        sandboxes to end (see :meth:`_quota_hold`). ``None`` (a caller that did not say,
        as before there was a choice): room is waited for up to ``queue_timeout``, a
        quota is refused at once. ``then``: awaited once the quota is held, before the
        wait for room (a GPU create's wait for a free GPU: a tenant at its ``max_gpus``
        is told so, not that the host has no free GPU)."""
        if self._closed:
            raise _shutting_down()
        now = asyncio.get_running_loop().time()
        budget = self.limits.queue_timeout if wait is None else min(wait, self.limits.queue_timeout)
        deadline = now + max(0.0, budget)
        hold = await self._quota_hold(tenant, memory_mb, cpus, now if wait is None else deadline,
                                      gpus)
        slot = Slot(memory_mb)
        try:
            if then is not None:
                await then()
            async with self._admit(memory_mb, slot, deadline, tenant):
                yield slot
        finally:
            self.quotas.settle(hold, slot.sandbox_id)

    async def _quota_hold(
        self, tenant: str | None, memory_mb: int, cpus: float, deadline: float, gpus: int = 0
    ) -> Hold | None:
        """The tenant's quota hold for one more sandbox, waiting until ``deadline`` for
        its own sandboxes to end when it is at a quota (a reward function at quota 2
        with 16 completions waits its turn rather than fail 14 of them). What could
        never fit (one sandbox above the quota itself) is refused at once, and so is a
        create of a tenant that has ``queue_size`` creates waiting already (a tenant
        cannot park unbounded work on the daemon)."""
        loop = asyncio.get_running_loop()
        began, first = loop.time(), True
        while True:
            try:
                return await self.quotas.acquire(tenant, memory_mb, cpus, gpus)
            except QuotaExceeded as exc:
                remaining = deadline - loop.time()
                if self._closed:
                    raise _shutting_down() from None
                alone = self.quotas.alone_over(tenant, memory_mb, cpus, gpus)
                if alone is not None:
                    raise alone from None
                if remaining <= 0:
                    waited = loop.time() - began
                    if waited < 0.001:
                        raise
                    raise QuotaExceeded(f"{exc.message} (after waiting {waited:.3g} s for "
                                        "its own sandboxes to end)", details=exc.details) from None
                waiting = self._quota_waiting.get(tenant or "", 0)
                if first and waiting >= self.limits.queue_size:
                    raise  # as many of this tenant's creates wait as the queue holds
                first = False
                # a release of this book's holds wakes it; a cluster's other nodes
                # free room it hears of no other way: look again now and then
                self._quota_waiting[tenant or ""] = waiting + 1
                try:
                    await self.quotas.freed(min(remaining, QUOTA_RECHECK_S))
                finally:
                    left = self._quota_waiting[tenant or ""] - 1
                    if left:
                        self._quota_waiting[tenant or ""] = left
                    else:
                        del self._quota_waiting[tenant or ""]

    @contextmanager
    def gpu_wait(self, tenant: str | None) -> Iterator[bool]:
        """Whether one more of ``tenant``'s creates may wait for a free GPU: a tenant has
        at most ``queue_size`` creates waiting, for its quota and for GPUs together (the
        admin is not bounded). Counted as waiting while the block runs."""
        key = tenant or ""
        if tenant is not None and self._quota_waiting.get(key, 0) >= self.limits.queue_size:
            yield False
            return
        self._quota_waiting[key] = self._quota_waiting.get(key, 0) + 1
        try:
            yield True
        finally:
            left = self._quota_waiting[key] - 1
            if left:
                self._quota_waiting[key] = left
            else:
                del self._quota_waiting[key]

    @asynccontextmanager
    async def _admit(self, memory_mb: int, slot: Slot, deadline: float,
                     tenant: str | None) -> AsyncIterator[Slot]:
        if self._closed:
            raise _shutting_down()
        self.check_fits(memory_mb)
        if self._queue or self._blocked_by(memory_mb):
            self._queued_of[tenant] += 1
            try:
                await self._wait(memory_mb, deadline)
            finally:
                _drop(self._queued_of, tenant)
        else:
            self._reserve(memory_mb)
        self._starting_of[tenant] += 1
        try:
            yield slot
        finally:
            _drop(self._starting_of, tenant)
            self._starting -= 1
            self._starting_mb -= memory_mb
            if slot.sandbox_id is not None:
                self._admitted[slot.sandbox_id] = memory_mb
            self._pump()

    def adopt(self, sandbox_id: str, memory_mb: int, tenant: str | None, cpus: float,
              gpus: int = 0, *, asleep: bool = False) -> None:
        """Count a sandbox this daemon did not admit (adopted from the daemon before it:
        live restore), against the caps and its tenant's quota, without a check; a
        hibernated one (``asleep``) against its tenant's quota only."""
        if not asleep:
            self._admitted[sandbox_id] = memory_mb
        self.quotas.adopt(tenant, memory_mb, cpus, sandbox_id, gpus)

    def asleep(self, sandbox_id: str) -> None:
        """The sandbox hibernated: its place and memory under the caps are free until
        its resume takes them again (:meth:`readmit`); its tenant's quota still holds it."""
        if self._admitted.pop(sandbox_id, None) is not None:
            self._pump()

    @asynccontextmanager
    async def readmit(self, sandbox_id: str, memory_mb: int, *,
                      tenant: str | None = None) -> AsyncIterator[None]:
        """Room for hibernated ``sandbox_id`` to start again, waited for in the queue
        like a create's, up to ``queue_timeout`` (then :class:`CapacityExceeded`); it
        counts as alive once the block ends without an error, else the room is free."""
        if self._closed:
            raise _shutting_down()
        slot = Slot(memory_mb)
        deadline = asyncio.get_running_loop().time() + self.limits.queue_timeout
        async with self._admit(memory_mb, slot, deadline, tenant):
            yield
            slot.commit(sandbox_id)

    def release(self, sandbox_id: str) -> None:
        """The sandbox was stopped or deleted: its place and memory are free again."""
        self.quotas.release(sandbox_id)
        if self._admitted.pop(sandbox_id, None) is not None:
            self._pump()

    def close(self) -> None:
        """Refuse new creates and fail the queued ones (the daemon is stopping)."""
        self._closed = True
        while self._queue:
            waiter = self._queue.popleft()
            if not waiter.granted.done():
                waiter.granted.set_exception(_shutting_down())

    # -------------------------------------------------------------- internals

    def _reserve(self, memory_mb: int) -> None:
        self._starting += 1
        self._starting_mb += memory_mb

    def _over(self, memory_mb: int) -> str | None:
        lim = self.limits
        if self._starting >= lim.max_starting:
            return "max_starting"
        if self.alive >= lim.max_sandboxes:
            return "max_sandboxes"
        if self.committed_memory_mb + memory_mb > lim.max_memory_mb:
            return "max_memory_mb"
        return None

    def _blocked_by(self, memory_mb: int) -> str | None:
        """The cap a create of ``memory_mb`` would break now, or None if it fits."""
        return self._over(memory_mb)

    async def _wait(self, memory_mb: int, deadline: float) -> None:
        lim = self.limits
        if len(self._queue) >= lim.queue_size:
            raise CapacityExceeded(
                f"the admission queue is full ({lim.queue_size} creates already wait): "
                "retry later or raise --queue-size",
                details={"limit": "queue_size", "value": lim.queue_size},
            )
        waiter = _Waiter(memory_mb, asyncio.get_running_loop().create_future())
        self._queue.append(waiter)
        self._pump()
        try:
            timeout = max(0.0, deadline - asyncio.get_running_loop().time())
            await asyncio.wait({waiter.granted}, timeout=timeout)
        except asyncio.CancelledError:
            self._forget(waiter)
            raise
        if not waiter.granted.done():
            error = self._timed_out(waiter, timeout)
            self._forget(waiter)
            raise error
        waiter.granted.result()  # raises if the daemon is shutting down

    def _forget(self, waiter: _Waiter) -> None:
        """A waiter gave up: leave the queue, or give back what it was granted."""
        if waiter.granted.done():
            if not waiter.granted.cancelled() and waiter.granted.exception() is None:
                self._starting -= 1
                self._starting_mb -= waiter.memory_mb
        else:
            waiter.granted.cancel()
            self._queue.remove(waiter)
        self._pump()

    def _pump(self) -> None:
        """Admit queued creates, first come first served, while the head fits."""
        while self._queue:
            waiter = self._queue[0]
            limit = self._blocked_by(waiter.memory_mb)
            if limit is not None:
                waiter.blocked_by = limit
                return
            self._queue.popleft()
            self._reserve(waiter.memory_mb)
            waiter.granted.set_result(None)

    def _timed_out(self, waiter: _Waiter, waited: float) -> CapacityExceeded:
        # Behind others in the queue, what holds a create back is what blocks the head.
        lim = self.limits
        limit = waiter.blocked_by or self._queue[0].blocked_by or "max_starting"
        value = getattr(lim, limit)
        return CapacityExceeded(
            f"no room for a new sandbox within {waited:.3g} s: held back by "
            f"{limit} ({value}); delete sandboxes you no longer need, retry later, "
            "or raise the limit",
            details={"limit": limit, "value": value, "queue_timeout": lim.queue_timeout},
        )


def _drop(counter: Counter[str | None], key: str | None) -> None:
    counter[key] -= 1
    if counter[key] <= 0:
        del counter[key]


def _shutting_down() -> DaemonUnavailable:
    return DaemonUnavailable("the corral daemon is shutting down: retry against a new one")
