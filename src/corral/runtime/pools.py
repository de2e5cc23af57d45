"""Warm pools: sandboxes started ahead of time and handed out one episode each.

A pool keeps ``min_ready`` sandboxes of one spec running and idle. :meth:`PoolManager.acquire`
takes the oldest ready one, checks that it is alive, and hands it out. From then on it
belongs to the caller, who deletes it after use: a pool never takes a sandbox back, so
nothing an episode leaves behind (files, processes, memory) reaches the next one. Ready
sandboxes are replaced in the background, a few at a time, backing off while creates
fail; a pool never has more than ``max_size`` sandboxes ready, starting and handed out.

Example::

    pools = PoolManager(engine)
    pools.create_pool("py", SandboxSpec(memory_mb=256), min_ready=8, max_size=64)
    info = await pools.acquire("py", timeout=10)   # running, tagged pool=py
    ...                                            # one episode in it
    await engine.delete(info.id)
    pools.release(info.id)                         # its place is free: one more may start
    await pools.close()                            # deletes every pool's ready sandboxes

A sandbox of a pool goes ``starting → ready → acquired`` and is then the caller's; a
ready one that fails the liveness check, ends by itself, or has waited half its lifetime
(``timeout`` runs from its start) is discarded (deleted) and replaced.

Liveness, without waking the agent at hand-out: a ready sandbox has run nothing since
its agent last answered, so what can end it is outside it (an OOM kill, a kill from the
host), and an agent that exits has its end of the channel closed by the kernel at that
moment. An acquire therefore asks the kernel (:meth:`Engine.agent_connected
<corral.runtime.engine_queries.QueryOps.agent_connected>`: running, channel open and
idle; microseconds) when the agent answered within :data:`TRUSTED_S`; otherwise it asks
the agent itself (a file ``stat`` of ``/``, a round trip: on a busy host the wake-up of
an idle agent costs milliseconds). While idle, every ready sandbox is asked in the
background each :data:`RECHECK_S` (one that does not answer within
:data:`LIVENESS_TIMEOUT_S` is discarded), so one whose agent stopped answering without
exiting is found without an acquire paying for it.

Pools live in memory, in the process that runs the manager (the daemon): they are not
in the registry and do not survive a restart. Their ready sandboxes die with the engine
anyway; whoever made a pool makes it again (the SDK's ``corral.Pool`` does so itself).
"""

from __future__ import annotations

import asyncio
import builtins
import logging
import secrets
import time
from collections import deque
from collections.abc import Awaitable, Callable

from corral.errors import CorralError, InvalidState, NotFound, QuotaExceeded
from corral.pool_schema import PoolDetail, PoolInfo, PoolSpec, pool_tag
from corral.runtime.engine import Engine
from corral.runtime.events import PoolAcquired, SandboxEnded, StateChanged
from corral.runtime.namespaces import pick
from corral.runtime.ownership import UNSET, OwnerArg
from corral.runtime.pool_state import PoolState, exhausted, refill_now
from corral.schema import SandboxInfo, SandboxSpec, SandboxState, validate_model

logger = logging.getLogger("corral.pools")

DEFAULT_REFILL_CONCURRENCY = 4  # creates one pool runs at once (admission caps the total)
LIVENESS_TIMEOUT_S = 2.0  # a ready sandbox whose agent does not answer by then is dead
RECHECK_S = 10.0  # a ready sandbox's agent is asked in the background this often
TRUSTED_S = 30.0  # an agent that answered this recently is checked by the kernel alone
REFILL_DELAY_S = 0.005  # quiet after the last hand-out before replacements start (_schedule_refill)
REFILL_MAX_DEFER_S = 0.05  # ... but never deferred longer than this in a stream of acquires
BACKOFF_BASE_S = 0.25  # the wait after a failed create, doubling per failure in a row
BACKOFF_MAX_S = 30.0
MAX_POOLS_PER_TENANT = 64  # a tenant's pools (each a task and state here, even at min_ready 0)

CreateFn = Callable[[SandboxSpec], Awaitable[SandboxInfo]]
DeleteFn = Callable[[str], Awaitable[object]]


class PoolManager:
    """The warm pools of one engine. Lives on the engine's event loop.

    ``create`` and ``delete`` make and remove one sandbox (default: the engine's own);
    the daemon passes versions that go through its admission control, so refills never
    exceed its caps. ``concurrency`` bounds the creates one pool runs at once.
    """

    def __init__(
        self,
        engine: Engine,
        *,
        create: CreateFn | None = None,
        delete: DeleteFn | None = None,
        concurrency: int = DEFAULT_REFILL_CONCURRENCY,
    ) -> None:
        self._engine = engine
        self._create = create or self._engine_create
        self._delete = delete or self._engine_delete
        self._concurrency = max(1, concurrency)
        self._pools: dict[tuple[str, str], PoolState] = {}  # by (owner or "", name)
        self._tasks: set[asyncio.Task[None]] = set()
        self._closed = False
        self._unsubscribe = [
            engine.events.subscribe(SandboxEnded, self._ended),
            engine.events.subscribe(StateChanged, self._state_changed),
        ]

    async def _engine_create(self, spec: SandboxSpec) -> SandboxInfo:
        return await self._engine.create(spec, owner=spec.tenant)  # a refill: its owner's

    async def _engine_delete(self, sandbox_id: str) -> bool:
        return await self._engine.delete(sandbox_id, owner=None)  # the pool's own work

    # ------------------------------------------------------------------ pools

    def create_pool(
        self,
        name: str | None,
        spec: SandboxSpec,
        *,
        min_ready: int,
        max_size: int,
        owner: OwnerArg = UNSET,
    ) -> PoolInfo:
        """Make a pool and start filling it (needs a running event loop).

        ``name`` None picks one. :class:`~corral.errors.InvalidArgument` for a bad
        name or sizes, :class:`~corral.errors.InvalidState` if the name is taken,
        :class:`~corral.errors.ImageNotFound` if the image does not exist.
        """
        if self._closed:
            raise InvalidState("the pool manager is closed")
        fields = {"name": name, "spec": spec, "min_ready": min_ready, "max_size": max_size}
        checked = validate_model(PoolSpec, fields, "pool")
        name = checked.name or "pool-" + secrets.token_hex(4)
        spec = self._engine.owners.stamp(spec, owner)  # a tenant's pool and its sandboxes are its own
        key = (spec.tenant or "", name)  # names are per owner (.namespaces)
        if key in self._pools:
            raise InvalidState(
                f"a pool named {name!r} already exists: use it, delete it first, "
                "or choose another name",
                details={"pool": name},
            )
        self._check_count(spec.tenant)
        self._engine.images.get(spec.image)  # ImageNotFound now, not at every refill
        self._engine.resolve_spec(spec, owner=spec.tenant)  # SnapshotNotFound now: one its owner may see
        tagged = SandboxSpec.parse(spec.model_dump(), tags=[*spec.tags, pool_tag(name)])
        pool = PoolState(name, tagged, min_ready, max_size)
        # the loop is the daemon's work, each refill a create for the pool's owner
        pool.task = asyncio.get_running_loop().create_task(
            self._maintain(pool), name=f"corral-pool-{name}")
        self._pools[key] = pool
        logger.info("pool %s: min_ready %d, max_size %d", name, min_ready, max_size)
        return pool.info()

    def _check_count(self, tenant: str | None) -> None:
        """A tenant's pools are bounded (the admin's are not)."""
        if tenant is None:
            return
        mine = sum(1 for p in self._pools.values() if p.spec.tenant == tenant)
        if mine >= MAX_POOLS_PER_TENANT:
            raise QuotaExceeded(
                f"tenant {tenant!r} has {mine} pools, the most a tenant may have: delete "
                "pools it no longer uses",
                details={"quota": "pools", "limit": MAX_POOLS_PER_TENANT, "used": mine,
                         "requested": 1, "tenant": tenant},
            )

    def list_pools(self, *, owner: OwnerArg = UNSET) -> builtins.list[PoolInfo]:
        """``owner``'s pools (the admin's: all)."""
        acting = self._engine.owners.of(owner)
        return [p.info() for p in self._pools.values() if self._engine.owners.sees(p.spec, acting)]

    def details(self, *, owner: OwnerArg = UNSET) -> builtins.list[PoolDetail]:
        """:meth:`get_pool` of every pool ``owner`` sees (names may repeat for the
        admin: one per owner)."""
        acting = self._engine.owners.of(owner)
        return [self._detail(p) for p in self._pools.values()
                if self._engine.owners.sees(p.spec, acting)]

    def get_pool(self, name: str, *, owner: OwnerArg = UNSET) -> PoolDetail:
        return self._detail(self._get(name, owner))

    @staticmethod
    def _detail(pool: PoolState) -> PoolDetail:
        return PoolDetail(
            **pool.info().model_dump(),
            ready_ids=list(pool.ready),
            acquired_ids=sorted(pool.acquired),
        )

    async def delete_pool(self, name: str, *, owner: OwnerArg = UNSET) -> bool:
        """Stop filling the pool and delete its ready sandboxes; False if there was none.

        Sandboxes already handed out are left to their users. Acquires waiting on the
        pool fail with :class:`~corral.errors.NotFound`.
        """
        pool = self._lookup(name, owner)
        if pool is None:
            return False  # another tenant's: as if there were none
        return await self._drop(pool)

    async def delete_owned(self, owner: str | None, name: str) -> bool:
        """Delete ``owner``'s pool ``name`` (for the daemon's own work, which knows
        whose pool it means); False if there was none."""
        pool = self._pools.get((owner or "", name))
        return False if pool is None else await self._drop(pool)

    async def _drop(self, pool: PoolState) -> bool:
        if self._pools.get(pool.key) is not pool:
            return False
        name = pool.name
        del self._pools[pool.key]
        pool.closed = True
        if pool.refill_timer is not None:
            pool.refill_timer.cancel()
        gone = NotFound(
            f"pool {name!r} was deleted while this acquire waited", details={"pool": name}
        )
        for fut in pool.waiters:
            if not fut.done():
                fut.set_exception(gone)
                fut.exception()  # retrieved: its waiter may have left already
        tasks = [t for t in (pool.task, *pool.starting) if t is not None]
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        doomed, pool.ready = list(pool.ready), deque()
        await asyncio.gather(*(self._remove(sid) for sid in doomed))
        logger.info("pool %s deleted (%d ready sandboxes removed)", name, len(doomed))
        return True

    async def close(self) -> None:
        """Delete every pool (and its ready sandboxes); later calls do nothing."""
        self._closed = True
        await asyncio.gather(*(self._drop(p) for p in list(self._pools.values())))
        await asyncio.gather(*list(self._tasks), return_exceptions=True)
        for unsubscribe in self._unsubscribe:
            unsubscribe()

    def owns(self, owner: str | None, name: str) -> bool:
        """Whether ``owner`` (None: the admin) has a pool named ``name``."""
        return (owner or "", name) in self._pools

    def _lookup(self, name: str, owner: OwnerArg, *, exact: bool = False) -> PoolState | None:
        """The pool named ``name`` in ``owner``'s namespace (.namespaces);
        ``exact``: ``owner``'s own only (the admin's too)."""
        acting = self._engine.owners.of(owner)
        if exact:
            return self._pools.get((acting or "", name))
        return pick("pool", name, acting,
                    ((p.spec.tenant, p.name, p) for p in self._pools.values() if p.name == name))

    def _get(self, name: str, owner: OwnerArg, *, exact: bool = False) -> PoolState:
        pool = self._lookup(name, owner, exact=exact)
        if pool is None:  # another's: unknown
            raise NotFound(
                f"no pool {name!r}: it was never made, was deleted, or the daemon restarted "
                "(pools live in its memory): create it again",
                details={"pool": name},
            )
        return pool

    # ---------------------------------------------------------------- acquire

    async def acquire(self, name: str, timeout: float, *, exact: bool = False,
                      owner: OwnerArg = UNSET) -> SandboxInfo:
        """Hand out a live sandbox of ``owner``'s pool, waiting up to ``timeout`` seconds
        (``exact``: of ``owner``'s own pool, never a tenant's for the admin).

        With none ready, one is made at once if the pool is below ``max_size``;
        otherwise the acquire waits for a place to free (a handed-out sandbox deleted).
        :class:`~corral.errors.CapacityExceeded` if none came in time.
        """
        pool = self._get(name, owner, exact=exact)
        began = time.perf_counter()
        deadline = time.monotonic() + timeout
        while True:
            if pool.ready:
                sid = pool.ready.popleft()
                pool.acquired.add(sid)
            else:
                sid = await self._wait(pool, deadline, timeout)
            try:
                info = await self._alive(pool, sid)
            except BaseException:  # cancelled while checking: it goes back, unharmed
                self._give_back(pool, sid)
                raise
            if info is not None:
                return self._handed(pool, sid, info, began)
            logger.info("pool %s: ready sandbox %s is dead; discarded", name, sid)
            pool.acquired.discard(sid)
            self._discard(pool, sid)

    def acquire_now(self, name: str, *, owner: OwnerArg = UNSET) -> SandboxInfo | None:
        """:meth:`acquire` when it needs no wait: the pool's next ready sandbox if its
        agent answered within :data:`TRUSTED_S` and the kernel's view of it is clean
        (what :meth:`_alive` trusts without asking), handed out the same way; else None
        and nothing changed (:meth:`acquire` then waits, or asks the agent). Synchronous:
        a caller needs no task, and no turn of the loop, for it."""
        pool = self._get(name, owner)
        if not pool.ready:
            return None
        sid = pool.ready[0]
        answered = pool.answered.get(sid)
        if answered is None or time.monotonic() - answered >= TRUSTED_S \
                or not self._engine.agent_connected(sid):
            return None
        try:
            info = self._engine.get(sid, owner=None)
        except CorralError:
            return None
        if info.state != SandboxState.RUNNING:
            return None
        pool.ready.popleft()
        del pool.answered[sid]
        pool.acquired.add(sid)
        return self._handed(pool, sid, info, time.perf_counter())

    def _handed(self, pool: PoolState, sid: str, info: SandboxInfo, began: float) -> SandboxInfo:
        """``sid`` (checked alive: ``info``) handed out: counted, announced, refilled."""
        pool.acquires += 1
        waited = time.perf_counter() - began
        pool.waits_ms.append(waited * 1000)
        self._engine.events.emit(PoolAcquired(pool.name, sid, waited))
        self._schedule_refill(pool)
        return info

    async def take_ready(self, name: str, count: int, *,
                         owner: OwnerArg = UNSET) -> builtins.list[SandboxInfo]:
        """Up to ``count`` live sandboxes of ``owner``'s pool among those ready now (none
        waited for, maybe none), each handed out as by :meth:`acquire`: a client's
        reserve (``corral.server.pool_reserve``) hands them out later, one at a time."""
        pool = self._get(name, owner)
        began = time.perf_counter()
        taken: builtins.list[SandboxInfo] = []
        while pool.ready and len(taken) < count:
            sid = pool.ready.popleft()
            pool.acquired.add(sid)
            try:
                info = await self._alive(pool, sid)
            except BaseException:  # cancelled: this one goes back; those taken are the caller's
                self._give_back(pool, sid)
                raise
            if info is None:
                logger.info("pool %s: ready sandbox %s is dead; discarded", name, sid)
                pool.acquired.discard(sid)
                self._discard(pool, sid)
                continue
            taken.append(info)
            pool.acquires += 1
            pool.waits_ms.append((time.perf_counter() - began) * 1000)
            self._engine.events.emit(PoolAcquired(name, sid, time.perf_counter() - began))
        if taken:
            self._schedule_refill(pool)
        return taken

    @staticmethod
    def _schedule_refill(pool: PoolState) -> None:
        """One fewer ready: refill once the reply is on its way and the burst of acquires
        it belongs to has paused. A create's synchronous setup (a few ms of CPU on the
        loop: cgroup, launcher, warden, registry) would otherwise delay the acquires
        behind it. Deferred by :data:`REFILL_DELAY_S` after the last hand-out, at most
        :data:`REFILL_MAX_DEFER_S` after the first; at once when half the ready ones are
        gone (and an acquire that finds none ready wakes the refiller itself)."""
        loop = asyncio.get_running_loop()
        if len(pool.ready) <= pool.min_ready // 2:
            if pool.refill_timer is not None:
                pool.refill_timer.cancel()
                pool.refill_timer = None
            pool.wake.set()
            return
        now = loop.time()
        if pool.refill_timer is None:
            pool.refill_due = now + REFILL_MAX_DEFER_S
        else:
            pool.refill_timer.cancel()
        pool.refill_timer = loop.call_at(min(now + REFILL_DELAY_S, pool.refill_due),
                                         refill_now, pool)

    async def _alive(self, pool: PoolState, sid: str) -> SandboxInfo | None:
        """The sandbox's info if it is running and its agent is alive, else None: asked
        of the kernel if the agent answered within :data:`TRUSTED_S`, else (or if the
        kernel's view is not clean: a background check's request open, bytes unread, its
        end shut) of the agent."""
        answered = pool.answered.pop(sid, None)
        if answered is not None and time.monotonic() - answered < TRUSTED_S \
                and self._engine.agent_connected(sid):
            try:
                info = self._engine.get(sid, owner=None)
            except CorralError:
                return None
            return info if info.state == SandboxState.RUNNING else None
        return await self._ask(sid)

    async def _ask(self, sid: str) -> SandboxInfo | None:
        """The sandbox's info if its agent answers and it is running, else None."""
        try:
            async with asyncio.timeout(LIVENESS_TIMEOUT_S):  # no task, unlike wait_for
                await self._engine.stat(sid, "/", owner=None)  # the pool's own work
            info = self._engine.get(sid, owner=None)
        except (CorralError, OSError, asyncio.TimeoutError):
            # OSError: a request to an agent that just died can fail in the channel's
            # drain (ConnectionResetError) before the engine notices and says SandboxLost.
            return None
        return info if info.state == SandboxState.RUNNING else None

    async def _wait(self, pool: PoolState, deadline: float, timeout: float) -> str:
        """Queue for the next sandbox of the pool (the refiller is told to make one)."""
        remaining = deadline - time.monotonic()
        if remaining <= 0:
            raise exhausted(pool, timeout)
        fut: asyncio.Future[str] = asyncio.get_running_loop().create_future()
        pool.waiters.append(fut)
        pool.wake.set()
        try:
            await asyncio.wait({fut}, timeout=remaining)
        except asyncio.CancelledError:
            self._leave(pool, fut)
            raise
        if not fut.done():
            self._leave(pool, fut)
            raise exhausted(pool, timeout)
        return fut.result()  # NotFound if the pool was deleted meanwhile

    def _leave(self, pool: PoolState, fut: asyncio.Future[str]) -> None:
        """A waiter gave up: leave the queue, or give back the sandbox it was given."""
        if fut.done():
            if not fut.cancelled() and fut.exception() is None:
                self._give_back(pool, fut.result())
        else:
            fut.cancel()
            pool.waiters.remove(fut)
        pool.wake.set()

    def _give_back(self, pool: PoolState, sid: str) -> None:
        """An unused sandbox returns to the front of the ready queue (it ran nothing)."""
        pool.acquired.discard(sid)
        if pool.closed:
            self._discard(pool, sid)
            return
        pool.ready.appendleft(sid)
        self._hand_out(pool)

    def _hand_out(self, pool: PoolState) -> None:
        """Give ready sandboxes to waiting acquires, first come first served."""
        while pool.ready and pool.waiters:
            fut = pool.waiters.popleft()
            if fut.done():
                continue
            sid = pool.ready.popleft()
            pool.acquired.add(sid)
            fut.set_result(sid)

    def release(self, sandbox_id: str) -> None:
        """The sandbox was deleted or stopped: if a pool made it, its place is free."""
        for pool in self._pools.values():
            if sandbox_id in pool.acquired:
                pool.acquired.discard(sandbox_id)
            elif sandbox_id in pool.ready:
                pool.ready.remove(sandbox_id)
            else:
                continue
            pool.wake.set()
            return

    # ----------------------------------------------------------------- refill

    async def _maintain(self, pool: PoolState) -> None:
        """Keep ``min_ready`` ready (plus one per waiting acquire), within ``max_size``."""
        while not pool.closed:
            pool.wake.clear()
            delay = self._expire(pool)  # None: nothing to replace on a timer
            recheck = self._recheck(pool)
            if recheck is not None:
                delay = recheck if delay is None else min(delay, recheck)
            backoff = pool.retry_at - time.monotonic()
            if backoff > 0:
                delay = backoff if delay is None else min(delay, backoff)
            else:
                for _ in range(pool.to_start(self._concurrency)):
                    task = asyncio.create_task(self._start_one(pool))
                    pool.starting.add(task)
            try:  # a timeout, not wait_for: no task (three turns of the loop) per wake
                async with asyncio.timeout(delay):
                    await pool.wake.wait()
            except TimeoutError:
                pass

    async def _start_one(self, pool: PoolState) -> None:
        task = asyncio.current_task()
        try:  # a refill is its owner's create (spec.tenant): it sees only what its owner may
            info = await self._create(pool.spec)
        except Exception as exc:
            pool.failed += 1
            pool.failures_in_a_row += 1
            pool.last_error = exc.message if isinstance(exc, CorralError) else repr(exc)
            backoff = min(BACKOFF_MAX_S, BACKOFF_BASE_S * 2 ** (pool.failures_in_a_row - 1))
            pool.retry_at = time.monotonic() + backoff
            logger.warning(
                "pool %s: a create failed (%d in a row; next try in %.2g s): %s",
                pool.name, pool.failures_in_a_row, backoff, pool.last_error,
            )
            return
        finally:
            pool.starting.discard(task)
            pool.wake.set()
        pool.failures_in_a_row = 0
        pool.created += 1
        pool.ready.append(info.id)  # a closed pool deletes it when it sweeps
        pool.ready_since[info.id] = info.started_at or time.time()
        pool.answered[info.id] = time.monotonic()  # its READY: the agent just answered
        self._hand_out(pool)

    def _expire(self, pool: PoolState) -> float | None:
        """Replace ready sandboxes that have waited half their lifetime (``timeout``
        runs from their start: one handed out keeps at least half of it); the seconds
        until the next one will have, or None if none is ready."""
        half = pool.spec.timeout / 2
        now = time.time()
        ready = set(pool.ready)  # a deque: `in` on it made each wake O(ready²)
        pool.ready_since = {sid: t for sid, t in pool.ready_since.items() if sid in ready}
        for sid, started in list(pool.ready_since.items()):
            if started + half <= now:
                pool.ready.remove(sid)
                del pool.ready_since[sid]
                self._discard(pool, sid)
        if not pool.ready_since:
            return None
        return max(0.0, min(pool.ready_since.values()) + half - now)

    def _recheck(self, pool: PoolState) -> float | None:
        """Ask, in the background, each ready sandbox whose agent last answered
        :data:`RECHECK_S` ago or more; the seconds until the next is due (None: none)."""
        now = time.monotonic()
        ready = set(pool.ready)
        pool.answered = {sid: t for sid, t in pool.answered.items() if sid in ready}
        due: float | None = None
        for sid in pool.ready:
            if sid in pool.checking:
                continue
            left = pool.answered.get(sid, now - RECHECK_S) + RECHECK_S - now
            if left <= 0:
                pool.checking.add(sid)
                task = asyncio.get_running_loop().create_task(self._check_ready(pool, sid))
                self._tasks.add(task)
                task.add_done_callback(self._tasks.discard)
            elif due is None or left < due:
                due = left
        return due

    async def _check_ready(self, pool: PoolState, sid: str) -> None:
        try:
            info = await self._ask(sid)
        finally:
            pool.checking.discard(sid)
            pool.wake.set()  # the next check's time is computed again
        if sid not in pool.ready or pool.closed:  # handed out meanwhile: its acquire checks
            return
        if info is not None:
            pool.answered[sid] = time.monotonic()
            return
        logger.info("pool %s: ready sandbox %s did not answer; discarded", pool.name, sid)
        pool.ready.remove(sid)
        self._discard(pool, sid)

    def _ended(self, event: SandboxEnded) -> None:
        """A sandbox ended (its lifetime, a crash, a delete that bypassed the pool)."""
        self.release(event.sandbox_id)

    def _state_changed(self, event: StateChanged) -> None:
        """A ready sandbox someone paused or is stopping will not be handed out."""
        if event.new == SandboxState.RUNNING:
            return
        for pool in self._pools.values():
            if event.sandbox_id in pool.ready:
                pool.ready.remove(event.sandbox_id)
                if not event.new.terminal and event.new != SandboxState.STOPPING:
                    self._discard(pool, event.sandbox_id)
                pool.wake.set()
                return

    def _discard(self, pool: PoolState, sid: str) -> None:
        """Delete a sandbox the pool will not hand out, in the background."""
        pool.discarded += 1
        task = asyncio.get_running_loop().create_task(self._remove(sid))
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)
        pool.wake.set()

    async def _remove(self, sid: str) -> None:
        try:
            await self._delete(sid)
        except CorralError as exc:
            logger.warning("could not delete pool sandbox %s: %s", sid, exc.message)
