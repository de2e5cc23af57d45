"""A warm pool: sandboxes the daemon keeps started, handed out one episode each."""

from __future__ import annotations

import secrets
import time
from collections import deque

import httpx
from typing_extensions import Self, Unpack  # typing's since 3.11 only

from corral.client import _validate
from corral.client._async._cleanup import AsyncCleanupOnExit
from corral.client._async._client import AsyncClient
from corral.client._async._sandbox import AsyncSandbox
from corral.client._async._spread import SPREAD
from corral.client._backends import AsyncBackend
from corral.client._config import exec_http_timeout
from corral.client._lease import Heartbeat
from corral.client._models import SpecOptions, spec_body
from corral.errors import InvalidArgument, InvalidState, LeaseNotFound, NotFound, SandboxTimeout
from corral.pool_schema import (
    DEFAULT_ACQUIRE_TIMEOUT_S,
    DEFAULT_MAX_SIZE,
    DEFAULT_MIN_READY,
    MAX_ACQUIRE_TIMEOUT_S,
    MAX_RESERVE,
    PoolInfo,
    PoolSpec,
    ReserveReply,
)
from corral.schema import SandboxInfo, validate_model

WAIT_READY_POLL_S = 0.05
DEFAULT_RESERVE_TTL_S = 30.0  # the reserve's lease: its sandboxes end this long after the process
RESERVE_MAX_AGE_S = 10.0  # a reserved sandbox not handed out by then is deleted, not handed out


class AsyncPool(AsyncCleanupOnExit):
    """``min_ready`` sandboxes kept running on the daemon, ready to hand out at once.

    Every :meth:`acquire` hands out a sandbox that was checked to be alive; it is the
    caller's from then on and is deleted after use (``async with``), never handed out
    again, so nothing one episode leaves behind reaches the next. The daemon starts a
    replacement in the background, and never runs more than ``max_size`` sandboxes of
    the pool (ready, starting and handed out) at once.

    ``image`` and the other keyword arguments of :meth:`AsyncSandbox.create`
    (``memory_mb``, ``cpus``, ``timeout``, ``env``, ``tags``, ``snapshot`` — an
    :class:`AsyncSnapshot`, its id or name —, ...) make the sandboxes' spec. With ``name`` given and a pool of that name on the daemon, this object
    attaches to it (its settings win, see :attr:`info`); otherwise it creates the pool,
    when this object is built, except under asyncio (a constructor cannot await):
    then on entering the context or at the first call. Closing it, or leaving the
    context, deletes a pool it created, with its ready sandboxes. Pools live in the
    daemon's memory: if the daemon restarts, the next :meth:`acquire` of the object
    that created the pool makes it again. On a Ray cluster (``ray://``) a pool lives on
    one node: ``node`` (a node id) picks it, else this worker's own node or the first;
    with ``spread=True`` there is one on every node, each with its share of
    ``min_ready`` and ``max_size``, and an acquire is served by the node with the most
    ready (see :mod:`corral.client._async._spread`).

    ``reserve=N`` keeps up to ``N`` of the pool's sandboxes acquired for this object in
    advance, taken from the daemon in one call: :meth:`acquire` then hands one out with
    no round trip (the call that finds the reserve empty takes the next ``N``). They are
    held under a lease of this object's (renewed every ``reserve_ttl / 3`` s by a thread):
    closing the pool, or this process dying (``reserve_ttl`` s later), deletes every
    sandbox the reserve took, those handed out and in use too. Each is still handed to one
    caller only, counts against the tenant's quota from its create, and is deleted after
    use, never returned; one kept unused for :data:`RESERVE_MAX_AGE_S` is deleted instead
    of handed out. Not with ``spread=True``.

    Example::

        async with corral.AsyncPool(image="python", memory_mb=256, min_ready=8) as pool:
            async with await pool.acquire(timeout=10) as sb:
                r = await sb.exec(["python3", "-c", "print(6*7)"])
            stats = await pool.stats()
            print(stats.ready, stats.acquire_wait_ms_p50)
    """

    def __init__(
        self,
        image: str | None = None,
        *,
        min_ready: int = DEFAULT_MIN_READY,
        max_size: int = DEFAULT_MAX_SIZE,
        name: str | None = None,
        node: str | None = None,
        spread: bool = False,
        client: AsyncClient | None = None,
        reserve: int = 0,
        reserve_ttl: float = DEFAULT_RESERVE_TTL_S,
        **spec: Unpack[SpecOptions],
    ) -> None:
        fields = {
            "name": name or "pool-" + secrets.token_hex(4),
            "spec": spec_body({"image": image, **spec}),
            "min_ready": min_ready,
            "max_size": max_size,
        }
        # Only what was given goes to the daemon, so its defaults fill in the rest.
        self._body = validate_model(PoolSpec, fields, "pool").model_dump(
            mode="json", exclude_unset=True
        )
        self._client = client
        self._node = None if node is None else _validate.text("node", node)
        if spread:
            if node is not None:
                raise InvalidArgument("give node= (one node) or spread=True (every node), not both")
            self._node = SPREAD
        if _validate.integer("reserve", reserve, minimum=0) > MAX_RESERVE:
            raise _validate.invalid("reserve", f"at most {MAX_RESERVE}, got {reserve}")
        if reserve and spread:
            raise InvalidArgument("reserve= needs a pool on one node: leave out spread=True",
                                  details={"field": "reserve"})
        self._reserve_size = reserve
        self._reserve_ttl = _validate.timeout("reserve_ttl", reserve_ttl, optional=False,
                                              maximum=86400.0)
        if self._reserve_ttl < 1:
            raise _validate.invalid("reserve_ttl", f"at least 1 second, got {reserve_ttl!r}")
        self._reserve: deque[tuple[float, SandboxInfo]] = deque()  # (taken at, monotonic)
        self._reserve_lock = AsyncBackend.lock()
        self._heartbeat: Heartbeat | None = None
        self._stale: list[SandboxInfo] = []
        self._ids = {"name": self._body["name"]}
        self._info: PoolInfo | None = None
        self._created = False
        self._closed = False
        AsyncBackend.run_in_constructor(self._open)

    @property
    def name(self) -> str:
        return str(self._body["name"])

    @property
    def info(self) -> PoolInfo | None:
        """The pool's settings and numbers as last seen (None before it is opened)."""
        return self._info

    @property
    def owned(self) -> bool:
        """True if this object made the pool on the daemon (closing it deletes the pool);
        False if it attached to an existing one, or has not opened it yet."""
        return self._created

    @property
    def closed(self) -> bool:
        return self._closed

    @property
    def client(self) -> AsyncClient:
        if self._client is None:
            self._client = AsyncClient.default()
        return self._client

    async def _open(self) -> PoolInfo:
        """Create the pool on the daemon, or attach to the one of the same name."""
        try:
            response = await self.client.call("create_pool", json=self._body, node=self._node)
            self._created = True
        except InvalidState as exc:
            if exc.details.get("pool") != self.name:
                raise
            response = await self.client.call("get_pool", self._ids)
        self._info = PoolInfo.model_validate(response.json())
        return self._info

    async def _ensure_open(self) -> None:
        if self._closed:
            raise InvalidState(f"pool {self.name} is closed: make a new corral.Pool")
        if self._info is None:
            await self._open()

    async def acquire(self, *, timeout: float = DEFAULT_ACQUIRE_TIMEOUT_S) -> AsyncSandbox:
        """A live sandbox of the pool, yours to use once and delete (``async with``).

        Waits up to ``timeout`` seconds when none is ready (one is started at once if
        the pool is below ``max_size``); then raises
        :class:`~corral.errors.CapacityExceeded`.
        """
        timeout = _validate.timeout(
            "timeout", timeout, optional=False, maximum=MAX_ACQUIRE_TIMEOUT_S
        )
        await self._ensure_open()
        try:
            return await self._acquire_one(timeout)
        except NotFound as exc:
            if not self._created or exc.details.get("pool") != self.name:
                raise
            await self._open()  # the daemon restarted and forgot it: make it again
            return await self._acquire_one(timeout)

    async def _acquire_one(self, timeout: float) -> AsyncSandbox:
        if not self._reserve_size:
            return await self._acquire(timeout)
        reserved = await self._from_reserve()
        if reserved is not None:
            return reserved
        # none was ready: wait as a plain acquire does, held under the same lease
        return await self._acquire(timeout, lease=self._heartbeat_lease())

    async def _acquire(self, timeout: float, *, lease: str | None = None) -> AsyncSandbox:
        body: dict[str, object] = {"timeout": timeout}
        if lease is not None:
            body["lease"] = lease
        response = await self.client.call(
            "acquire_from_pool", self._ids, json=body, timeout=exec_http_timeout(timeout),
        )
        return AsyncSandbox(SandboxInfo.model_validate(response.json()), client=self.client)

    async def _from_reserve(self) -> AsyncSandbox | None:
        """A sandbox of the reserve (taking the next ones if it is empty), or None if
        the pool had none ready (the caller then waits in a plain acquire)."""
        info = self._pop_reserved()
        if info is None:
            async with self._reserve_lock:
                info = self._pop_reserved()  # another caller may have refilled it meanwhile
                if info is None:
                    await self._take_reserve()
                    info = self._pop_reserved()
        return None if info is None else AsyncSandbox(info, client=self.client)

    def _pop_reserved(self) -> SandboxInfo | None:
        """The oldest fresh reserved sandbox; stale ones are dropped (deleted later)."""
        if self._heartbeat is not None and self._heartbeat.may_have_expired():
            # the lease expired (or may have): the daemon deletes them, or, if not, we do
            self._stale.extend(info for _, info in self._reserve)
            self._reserve.clear()
        while True:
            try:
                taken_at, info = self._reserve.popleft()  # one caller each, threads too
            except IndexError:
                return None
            if time.monotonic() - taken_at < RESERVE_MAX_AGE_S:
                return info
            self._stale.append(info)

    async def _take_reserve(self) -> None:
        """Up to ``reserve`` ready sandboxes from the daemon, held under this pool's lease."""
        stale, self._stale = self._stale, []
        if stale:  # deleted, never handed out (their lease ends them anyway)
            await AsyncBackend.gather([AsyncSandbox(i, client=self.client).delete for i in stale])
        try:
            reply = await self._reserve_call()
        except LeaseNotFound:  # it expired (this process stood still past its ttl)
            if self._heartbeat is not None:
                self._heartbeat.stop()
                self._heartbeat = None
            reply = await self._reserve_call()
        now = time.monotonic()
        got = ReserveReply.model_validate(reply.json()).sandboxes
        self._reserve.extend((now, info) for info in got)

    async def _reserve_call(self) -> httpx.Response:
        """``reserve_from_pool`` under this pool's lease (taken first if it has none)."""
        if self._heartbeat is None or self._heartbeat.lost:
            reply = (await self.client.call(
                "create_lease", json={"ttl": self._reserve_ttl})).json()
            args = self.client.connect_args
            self._heartbeat = Heartbeat(args["url"], args["token"], reply["id"],
                                        self._reserve_ttl)
        return await self.client.call(
            "reserve_from_pool", self._ids,
            json={"count": self._reserve_size, "lease": self._heartbeat.lease_id})

    def _heartbeat_lease(self) -> str:
        if self._heartbeat is None:  # (taken by the reserve call just made)
            raise InvalidState(f"pool {self.name}: its reserve has no lease")
        return self._heartbeat.lease_id

    async def _drop_reserve(self) -> None:
        """Release the reserve's lease: the daemon deletes every sandbox it took."""
        self._reserve.clear()
        self._stale = []
        heartbeat, self._heartbeat = self._heartbeat, None
        if heartbeat is None:
            return
        heartbeat.stop()
        try:
            await self.client.call("release_lease", {"lease_id": heartbeat.lease_id})
        except LeaseNotFound:
            pass  # it expired: its sandboxes are gone already

    async def stats(self) -> PoolInfo:
        """The pool's numbers now: ready, starting, acquired, created, wait p50, ..."""
        await self._ensure_open()
        self._info = PoolInfo.model_validate((await self.client.call("get_pool", self._ids)).json())
        return self._info

    async def wait_ready(self, *, timeout: float = DEFAULT_ACQUIRE_TIMEOUT_S) -> PoolInfo:
        """Wait until the pool has ``min_ready`` sandboxes ready (to warm up before a
        burst of acquires); :class:`~corral.errors.SandboxTimeout` after ``timeout`` s."""
        deadline = time.monotonic() + timeout
        while True:
            stats = await self.stats()
            if stats.ready >= stats.min_ready:
                return stats
            if time.monotonic() >= deadline:
                failing = f"; creates fail: {stats.last_error}" if stats.failed else ""
                raise SandboxTimeout(
                    f"pool {self.name}: {stats.ready} of {stats.min_ready} sandboxes ready "
                    f"after {timeout:g} s{failing}",
                    details={"pool": self.name, "ready": stats.ready, "timeout": timeout},
                )
            await AsyncBackend.sleep(WAIT_READY_POLL_S)

    async def delete(self) -> None:
        """Delete the pool and its ready sandboxes, whoever created it (idempotent);
        sandboxes handed out stay with their users (except a reserve's: see the class)."""
        self._closed = True
        try:
            await self._drop_reserve()
        finally:
            await self.client.call("delete_pool", self._ids)

    async def close(self) -> None:
        """Delete the pool if this object created it; closing twice is fine."""
        if self._closed:
            return
        if self._created:
            await self.delete()
        else:
            await self._drop_reserve()
        self._closed = True

    async def __aenter__(self) -> Self:
        await self._ensure_open()
        return self

    async def _cleanup(self) -> None:
        await self.close()

    def __repr__(self) -> str:
        state = "closed" if self._closed else "open" if self._info else "not opened"
        return f"<{type(self).__name__} {self.name} {state}>"
