"""How many CRIU dumps and restores one engine runs at once, and in what order.

A checkpoint's dump runs in the daemon's own cgroup, outside the sandbox's CPU and
memory limits, and a restore reads its whole image back: a tenant that hibernates,
resumes and forks in a loop could keep every core of the host busy with CRIU. Each
dump (checkpoint, hibernate, a live fork) and each restore (resume, a create from a
live snapshot) takes a place in :class:`CriuGate` first; past ``limit`` they queue.
Waiters are served round-robin across tenants (the admin counts as one), so one
tenant's hundred hibernates queue behind each other, not in front of another
tenant's one; and one tenant holds at most ``limit - 1`` places (with more than one),
so another's dump or restore finds one free rather than waiting for a long dump.

``CORRAL_CRIU_CONCURRENCY`` (read by :func:`criu_concurrency` when the engine is made):
the number of places; default half the CPUs the daemon may run on, at least one.
"""

from __future__ import annotations

import asyncio
import os
from collections import deque
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager

from corral.errors import InvalidArgument

__all__ = ["CRIU_CONCURRENCY_ENV", "CriuGate", "criu_concurrency"]

CRIU_CONCURRENCY_ENV = "CORRAL_CRIU_CONCURRENCY"


def criu_concurrency() -> int:
    """The gate's size: ``$CORRAL_CRIU_CONCURRENCY``, else half the usable CPUs (>= 1)."""
    raw = os.environ.get(CRIU_CONCURRENCY_ENV, "").strip()
    if raw:
        try:
            value = int(raw)
        except ValueError:
            value = 0
        if value < 1:
            raise InvalidArgument(f"{CRIU_CONCURRENCY_ENV}={raw!r}: give a whole number "
                                  "of CRIU dumps and restores at once, 1 or more")
        return value
    return max(1, len(os.sched_getaffinity(0)) // 2)


class CriuGate:
    """At most ``limit`` holders at once; waiters served round-robin across tenants."""

    def __init__(self, limit: int) -> None:
        if limit < 1:
            raise ValueError("a CRIU gate needs at least one place")
        self.limit = limit
        self.running = 0
        self.peak = 0  # the most holders seen at once (what the tests check)
        self._queues: dict[str, deque[asyncio.Future[None]]] = {}
        self._turns: deque[str] = deque()  # tenants with waiters, in turn order
        self.per_tenant = max(1, limit - 1)  # places one tenant may hold at once
        self._mine: dict[str, tuple[asyncio.Semaphore, int]] = {}  # tenant -> (its cap, users)

    @property
    def waiting(self) -> int:
        return sum(len(q) for q in self._queues.values())

    @asynccontextmanager
    async def place(self, tenant: str | None) -> AsyncIterator[None]:
        """Hold one place while the block runs (waiting for one first, if none is free)."""
        key = tenant or ""
        cap, users = self._mine.get(key) or (asyncio.Semaphore(self.per_tenant), 0)
        self._mine[key] = (cap, users + 1)
        try:
            async with cap:  # its own turn first: then one of everyone's places
                async with self._place(key):
                    yield
        finally:
            cap, users = self._mine[key]
            if users == 1:
                del self._mine[key]
            else:
                self._mine[key] = (cap, users - 1)

    @asynccontextmanager
    async def _place(self, key: str) -> AsyncIterator[None]:
        if self.running < self.limit and not self._turns:
            self.running += 1
        else:
            waiter: asyncio.Future[None] = asyncio.get_running_loop().create_future()
            queue = self._queues.get(key)
            if queue is None:
                queue = self._queues[key] = deque()
                self._turns.append(key)
            queue.append(waiter)
            try:
                await waiter  # handed a place by a holder's end (running unchanged)
            except BaseException:
                if waiter.done() and not waiter.cancelled():
                    self._hand_on()  # it was handed one as it was cancelled: pass it on
                else:
                    self._forget(key, waiter)
                raise
        self.peak = max(self.peak, self.running)
        try:
            yield
        finally:
            self._hand_on()

    def _hand_on(self) -> None:
        """A holder ended: give its place to the next tenant's first waiter, or free it."""
        while self._turns:
            key = self._turns.popleft()
            queue = self._queues[key]
            waiter = queue.popleft()
            if queue:
                self._turns.append(key)  # its next waiter, after the other tenants'
            else:
                del self._queues[key]
            if not waiter.done():
                waiter.set_result(None)
                return
        self.running -= 1

    def _forget(self, key: str, waiter: asyncio.Future[None]) -> None:
        queue = self._queues.get(key)
        if queue is None or waiter not in queue:
            return
        queue.remove(waiter)
        if not queue:
            del self._queues[key]
            self._turns.remove(key)
