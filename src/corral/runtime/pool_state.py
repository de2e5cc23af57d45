"""One warm pool's state: its ready, starting and handed-out sandboxes and its numbers
(:class:`~corral.runtime.pools.PoolManager` owns and drives them)."""

from __future__ import annotations

import asyncio
import statistics
import time
from collections import deque
from dataclasses import dataclass, field

from corral.errors import CapacityExceeded
from corral.pool_schema import PoolInfo, pool_tag
from corral.schema import SandboxSpec

WAIT_SAMPLES = 1024  # acquires the wait median is computed over


@dataclass(eq=False)
class PoolState:
    name: str
    spec: SandboxSpec  # with the pool's tag
    min_ready: int
    max_size: int
    created_at: float = field(default_factory=time.time)
    ready: deque[str] = field(default_factory=deque)
    acquired: set[str] = field(default_factory=set)  # handed out (or being checked)
    starting: set[asyncio.Task[None]] = field(default_factory=set)
    waiters: deque[asyncio.Future[str]] = field(default_factory=deque)
    wake: asyncio.Event = field(default_factory=asyncio.Event)
    task: asyncio.Task[None] | None = None
    closed: bool = False
    created: int = 0
    failed: int = 0
    discarded: int = 0
    acquires: int = 0
    waits_ms: deque[float] = field(default_factory=lambda: deque(maxlen=WAIT_SAMPLES))
    failures_in_a_row: int = 0
    retry_at: float = 0.0
    last_error: str | None = None
    ready_since: dict[str, float] = field(default_factory=dict)  # ready id → started_at
    answered: dict[str, float] = field(default_factory=dict)  # ready id → its agent's last answer (monotonic)
    checking: set[str] = field(default_factory=set)  # ready ids asked in the background now
    refill_timer: asyncio.TimerHandle | None = None  # a deferred refill (_schedule_refill)
    refill_due: float = 0.0  # loop time by which a deferred refill starts at the latest

    @property
    def tag(self) -> str:
        return pool_tag(self.name)

    @property
    def key(self) -> tuple[str, str]:
        """Its place among the pools: names are per owner."""
        return (self.spec.tenant or "", self.name)

    def waiting(self) -> int:
        """Acquires waiting for a sandbox not yet given to them."""
        return sum(not f.done() for f in self.waiters)

    def to_start(self, concurrency: int) -> int:
        """How many creates to start now: enough for ``min_ready`` plus every waiting
        acquire, within ``max_size`` and ``concurrency``."""
        pending = len(self.ready) + len(self.starting)
        wanted = self.min_ready + self.waiting() - pending
        room = self.max_size - len(self.acquired) - pending
        return max(0, min(wanted, room, concurrency - len(self.starting)))

    def info(self) -> PoolInfo:
        return PoolInfo(
            name=self.name,
            spec=self.spec,
            min_ready=self.min_ready,
            max_size=self.max_size,
            created_at=self.created_at,
            ready=len(self.ready),
            starting=len(self.starting),
            acquired=len(self.acquired),
            waiting=self.waiting(),
            created=self.created,
            failed=self.failed,
            discarded=self.discarded,
            acquires=self.acquires,
            acquire_wait_ms_p50=statistics.median(self.waits_ms) if self.waits_ms else None,
            last_error=self.last_error,
        )


def refill_now(pool: PoolState) -> None:
    pool.refill_timer = None
    pool.wake.set()


def exhausted(pool: PoolState, timeout: float) -> CapacityExceeded:
    if len(pool.acquired) >= pool.max_size:
        why = (
            f"all {pool.max_size} of its sandboxes (max_size) are handed out: delete the "
            "ones you are done with, raise max_size, or pass a longer timeout"
        )
    elif pool.failures_in_a_row and pool.last_error:
        why = f"creating its sandboxes fails: {pool.last_error}"
    else:
        why = "its sandboxes are still starting (the daemon is busy): pass a longer timeout"
    return CapacityExceeded(
        f"no sandbox of pool {pool.name!r} within {timeout:g} s: {why}",
        details={
            "pool": pool.name, "limit": "max_size", "value": pool.max_size,
            "acquired": len(pool.acquired), "timeout": timeout,
        },
    )
