"""What a request handler finds: the engine, the sandbox service, the settings, and
the helpers every front-end shares for a client that hangs up.

Handlers of every surface (the native routes, process routes, the Tensorlake
front-end) take these from here, not from each other, so no front-end imports
another's private helpers and the import graph has no circles.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterable, Awaitable, Coroutine, Generator
from typing import Any, TypeVar

from starlette.requests import ClientDisconnect, Request

from corral.errors import CorralError
from corral.runtime.engine import Engine
from corral.runtime.pools import PoolManager
from corral.schema import SandboxInfo
from corral.server.admission import Admission
from corral.server.caller import caller_of
from corral.server.door import Door
from corral.server.sandbox_verbs import SandboxVerbs
from corral.server.service import SandboxService
from corral.server.settings import ServerSettings

T = TypeVar("T")


def engine(request: Request) -> Engine:
    return request.app.state.engine


def service(request: Request) -> SandboxService:
    return request.app.state.service


def admission(request: Request) -> Admission:
    return service(request).admission


def pools(request: Request) -> PoolManager:
    return service(request).pools


def settings(request: Request) -> ServerSettings:
    return request.app.state.settings


def door(request: Request) -> Door:
    return request.app.state.door


def owner(request: Request) -> str | None:
    """The owner ``request``'s caller acts for (None: the admin; "" when no door saw
    it: nothing), passed to every engine call explicitly (runtime/ownership.py)."""
    return caller_of(request).name


def sandboxes(request: Request) -> SandboxVerbs:
    """The service's verbs on a sandbox (exec, processes, files, pause), for the
    request's caller (resolved by the door)."""
    return SandboxVerbs(engine(request), caller_of(request))


def host_network_allowed(request: Request) -> bool:
    """Whether this caller may give a sandbox ``network="host"``: the request came on
    the Unix socket (the daemon's owner), or the daemon allows it on TCP
    (``--allow-host-network``) and the caller has the right (the admin; a tenant
    whose token was made with ``--allow-host-network``)."""
    if door(request).on_socket(request.scope):
        return True
    return settings(request).allow_host_network and caller_of(request).may_use_host_network


class _Resumed(Awaitable[T]):
    """A coroutine that took its first step outside any task (``first``: what it waits
    for), resumed where it stopped by whoever awaits this: results and exceptions
    (a cancellation too) go on to it exactly as to an awaited coroutine."""

    __slots__ = ("_coro", "_first")

    def __init__(self, coro: Coroutine[Any, Any, T], first: Any) -> None:
        self._coro, self._first = coro, first

    def __await__(self) -> Generator[Any, Any, T]:
        coro, out = self._coro, self._first
        while True:
            try:
                value = yield out
            except GeneratorExit:
                coro.close()
                raise
            except BaseException as exc:  # noqa: BLE001 (passed on: a cancel too)
                try:
                    out = coro.throw(exc)
                except StopIteration as done:
                    return done.value
            else:
                try:
                    out = coro.send(value)
                except StopIteration as done:
                    return done.value


def _hung_up(request: Request) -> bool:
    """Whether the server has already read the client's hang-up (what a watcher would
    have been woken by), asked without waiting: ``receive`` answers at once if so."""
    peek = request.receive()
    try:
        peek.send(None)
    except StopIteration as got:
        return bool(got.value.get("type") == "http.disconnect")
    peek.close()  # it waits for a next message: none yet
    return False


async def _watch_disconnect(request: Request) -> None:
    while (await request.receive())["type"] != "http.disconnect":
        pass


async def unless_disconnected(request: Request, work: Awaitable[T]) -> T:
    """Await ``work``, cancelling it if the client hangs up first (a queued create
    leaves the queue, a command is killed); then raise :class:`ClientDisconnect`."""
    return (await _race_disconnect(request, work, recheck=False))[0]


async def unless_gone(request: Request, work: Awaitable[SandboxInfo]) -> SandboxInfo:
    """``work`` gets a sandbox for the client; if the client left meanwhile, delete it."""
    got, gone = await _race_disconnect(request, work, recheck=True)
    if gone:  # it left just as the sandbox became ready
        await service(request).delete(got.id, caller_of(request))
        raise ClientDisconnect()
    return got


async def _race_disconnect(request: Request, work: Awaitable[T], *, recheck: bool) -> tuple[T, bool]:
    """``work``'s result, and whether the client had hung up by the time it came
    (``recheck``); :class:`ClientDisconnect` (``work`` cancelled) if it hung up first.

    ``work`` takes its first step here: most often it finishes without waiting (a
    pool's ready sandbox) and needs neither a task nor a watcher (two tasks, a wait and
    a turn of the loop: ~0.1 ms of the daemon's CPU per call). Work that waits goes on
    in this task (no task of its own: fewer turns of the loop per exec), raced against
    a watcher of the hang-up, which cancels it."""
    if isinstance(work, Coroutine):
        try:
            first = work.send(None)
        except StopIteration as done:
            return done.value, recheck and _hung_up(request)
        work = _Resumed(work, first)
    current = asyncio.current_task()
    assert current is not None
    left = False  # the watcher ended (the hang-up read, or it failed: as good as one)

    def on_hang_up(watch: asyncio.Future[None]) -> None:
        nonlocal left
        if not watch.cancelled():
            left = True
            current.cancel()  # thrown into ``work`` where it waits

    watch = asyncio.ensure_future(_watch_disconnect(request))
    watch.add_done_callback(on_hang_up)
    try:
        result = await work
    except asyncio.CancelledError:
        if not left:
            raise  # the caller's own cancellation (a revoked token, a shutdown)
        _uncancel(current)
        raise ClientDisconnect() from None
    finally:
        watch.remove_done_callback(on_hang_up)
        watch.cancel()
    if left:  # the work took the cancellation and still ended: the client is gone
        _uncancel(current)
        return result, True
    # a hang-up the server has already read, that the watcher had no turn to see
    return result, recheck and _hung_up(request)


def _uncancel(task: asyncio.Task[Any]) -> None:
    """Take back this module's cancel of ``task`` (Python 3.11+ counts them: an
    ``asyncio.timeout`` further out would take it for its own)."""
    uncancel = getattr(task, "uncancel", None)
    if uncancel is not None:
        uncancel()


async def write_whole(
    request: Request, sandbox_id: str, path: str, pieces: AsyncIterable[bytes], *, mode: int = 0o644
) -> int:
    """Write ``pieces`` (an upload as it arrives) to ``path`` in the sandbox, for the
    request's caller; if it fails part-way (a bad piece, a full disk, the client
    leaving) the half-written file is removed. Returns the bytes written."""
    try:
        return await sandboxes(request).write_from(sandbox_id, path, pieces, mode=mode)
    except (CorralError, ClientDisconnect):
        await remove_partial(sandboxes(request), sandbox_id, path)
        raise


async def remove_partial(verbs: SandboxVerbs, sandbox_id: str, path: str) -> None:
    """After a failed upload, leave no half-written file behind (as its caller)."""
    try:
        if not (await verbs.stat(sandbox_id, path)).is_dir:
            await verbs.remove(sandbox_id, path)
    except CorralError:
        pass  # nothing was written, or the sandbox is gone
