"""What a request handler finds: the engine, the sandbox service, the settings, and
the helpers every front-end shares for a client that hangs up.

Handlers of every surface (the native routes, process routes, the Tensorlake
front-end) take these from here, not from each other, so no front-end imports
another's private helpers and the import graph has no circles.
"""

from __future__ import annotations

import asyncio
import sys
from collections.abc import AsyncIterable, Awaitable, Callable, Coroutine
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
_EAGER_TASKS = sys.version_info >= (3, 12)  # asyncio.Task(..., eager_start=True)


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


class _HangUpWatch:
    """Calls ``on_hang_up`` once when the client hangs up (or its ``receive`` fails: as
    good as a hang-up), until :meth:`stop`. ``receive`` is stepped by hand and the
    future it waits on given a callback: no task, whose start and cancel would cost two
    turns of the loop per request. A ``receive`` that waits on anything but an asyncio
    future (another server's) is watched by a task as before."""

    __slots__ = ("_request", "_on_hang_up", "_peek", "_waiting", "_task")

    def __init__(self, request: Request, on_hang_up: Callable[[], None]) -> None:
        self._request, self._on_hang_up = request, on_hang_up
        self._peek: Coroutine[Any, Any, Any] | None = None
        self._waiting: asyncio.Future[Any] | None = None
        self._task: asyncio.Task[None] | None = None
        self._step()

    def _step(self, _: object = None) -> None:
        self._waiting = None
        while True:
            if self._peek is None:
                self._peek = self._request.receive()
            try:
                waits_on = self._peek.send(None)
            except StopIteration as got:
                self._peek = None
                if got.value.get("type") == "http.disconnect":
                    self._on_hang_up()
                    return
                continue  # a message nobody asked for (more body): wait for the next
            except BaseException:  # noqa: BLE001 (a failed receive: the client is gone)
                self._peek = None
                self._on_hang_up()
                return
            if asyncio.isfuture(waits_on):
                self._waiting = waits_on
                waits_on.add_done_callback(self._step)
                return
            self._peek.close()  # not an asyncio future: a task watches instead
            self._peek = None
            self._task = asyncio.ensure_future(_watch_disconnect(self._request))
            self._task.add_done_callback(self._task_done)
            return

    def _task_done(self, task: asyncio.Task[None]) -> None:
        if not task.cancelled():
            self._on_hang_up()

    def stop(self) -> None:
        """No more calls; the ``receive`` under way is closed (nothing is read)."""
        if self._waiting is not None:
            self._waiting.remove_done_callback(self._step)
            self._waiting = None
        if self._peek is not None:
            self._peek.close()
            self._peek = None
        if self._task is not None:
            self._task.remove_done_callback(self._task_done)
            self._task.cancel()


async def unless_disconnected(request: Request, work: Awaitable[T]) -> T:
    """Await ``work``, cancelling it if the client hangs up first (a queued create
    leaves the queue, a command is killed); then raise :class:`ClientDisconnect`."""
    return (await _race_disconnect(request, work, recheck=False))[0]


async def unless_gone(request: Request, work: Awaitable[SandboxInfo]) -> SandboxInfo:
    """``work`` gets a sandbox for the client; if the client left meanwhile, delete it."""
    got, gone = await _race_disconnect(request, work, recheck=True)
    return await _kept(request, got, gone)


async def kept_unless_gone(request: Request, got: SandboxInfo) -> SandboxInfo:
    """``got``, a sandbox taken for the client without waiting (no task: nothing to
    race); if the server has already read its hang-up, delete it."""
    return await _kept(request, got, _hung_up(request))


async def _kept(request: Request, got: SandboxInfo, gone: bool) -> SandboxInfo:
    if gone:  # it left just as the sandbox became ready
        await service(request).delete(got.id, caller_of(request))
        raise ClientDisconnect()
    return got


async def _race_disconnect(request: Request, work: Awaitable[T], *, recheck: bool) -> tuple[T, bool]:
    """``work``'s result, and whether the client had hung up by the time it came
    (``recheck``); :class:`ClientDisconnect` (``work`` cancelled) if it hung up first.

    ``work`` runs in a task of its own from its first step, raced against a watcher of
    the hang-up (:class:`_HangUpWatch`: no task) that cancels it. (Never a first step
    taken here and the rest in a task: a deadline the work enters in that step,
    ``asyncio.timeout`` or 3.12's ``wait_for``, belongs to the task it was entered in,
    and would cancel this caller instead of the work.)"""
    # The work gets a task of its own: a cancel of this one (a revoked token's cancel
    # scope cancels again every turn until the handler returns) must reach the work
    # once, so that its clean-up (a sandbox's delete, a command's kill) runs whole.
    woken = asyncio.get_running_loop().create_future()  # the work's end, or the hang-up
    left = False  # the client hung up (or its receive failed: as good as one)

    def wake(_: object = None) -> None:
        if not woken.done():
            woken.set_result(None)

    async def run() -> T:
        try:
            return await work
        finally:
            # woken in the work's last step: the task's done callback would take a
            # turn of the loop of its own before this one's
            wake()

    def on_hang_up() -> None:
        nonlocal left
        left = True
        wake()

    watch = _HangUpWatch(request, on_hang_up)  # (a hang-up already read: called now)
    if left:  # the work never starts
        watch.stop()
        _close_unawaited(work)
        raise ClientDisconnect()
    task = _work_task(run())
    task.add_done_callback(wake)
    try:
        await woken
    finally:
        watch.stop()
        task.remove_done_callback(wake)
        if not task.done():
            task.cancel()
            await asyncio.wait({task})  # let it clean up; never raises
    if task.cancelled():
        _close_unawaited(work)  # cancelled before its first step: never awaited
        raise ClientDisconnect()
    if left:
        return task.result(), True
    # a hang-up the server has already read, that the watcher had no turn to see
    return task.result(), recheck and _hung_up(request)


def _close_unawaited(work: Awaitable[Any]) -> None:
    """``work`` will never be awaited: a coroutine is closed unstarted; work already
    under way (a command started by its handler: ``StartedExec``) is ended by its
    ``close``. (A no-op for one that was awaited.)"""
    close = getattr(work, "close", None)
    if close is not None:
        close()


def _work_task(coro: Coroutine[Any, Any, T]) -> asyncio.Task[T]:
    """A task for a request's work. Where asyncio has eager tasks (Python 3.12+) its
    first step runs now, in the new task (a deadline entered there is the work's,
    never the caller's), saving a turn of the loop; on 3.11 it is scheduled."""
    if _EAGER_TASKS:
        return asyncio.Task(coro, loop=asyncio.get_running_loop(),
                            eager_start=True)  # type: ignore[call-arg,unused-ignore]
    return asyncio.ensure_future(coro)


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
