"""The one bridge between blocking and asyncio code, for the SDK and the RL toolkit.

corral's work is asyncio underneath; its blocking faces (``evaluate``,
``CodeReward.evaluate``, ``run_episodes``, the vector env, ``corral.submit`` and the
``*_future`` methods) cross over here, and only here, on one event loop: an anyio
blocking portal (:func:`anyio.from_thread.start_blocking_portal`) whose thread is
started on first use and lives as long as the process. So the rules are the same
everywhere:

- :func:`run_sync` runs a coroutine on the portal's loop and waits for it. From a
  thread that runs an event loop of its own (a notebook cell, an async trainer) it
  works too: that loop waits, the coroutine runs on the portal's. From a coroutine
  that itself runs on the portal (a blocking corral call inside a callback of an
  async one) it raises :class:`~corral.errors.InvalidState` instead of deadlocking:
  use the async API there.
- A :exc:`KeyboardInterrupt` (Ctrl-C) or a ``timeout`` while waiting cancels the
  coroutine and waits for its cleanup before the exception reaches the caller, so
  nothing it started outlives the call; any other exception (including a
  ``BaseException`` such as ``SystemExit``) is raised in the caller as it was raised.
- :func:`iterate_sync` turns an async generator into a blocking iterator whose items
  arrive while the generator still runs; leaving the loop early (``break``, an
  exception, Ctrl-C) cancels the generator and waits for its cleanup.
- :func:`submit_blocking` runs a blocking function on the portal's worker threads (at
  most ``CORRAL_MAX_WORKERS`` at once) and hands back a
  :class:`concurrent.futures.Future`; :func:`in_parallel` runs several and returns
  each one's result or exception, in order.

The portal survives ``fork``: a child that uses the bridge starts a portal of its own
(the parent's thread does not exist there). At interpreter exit the portal stops
before non-daemon threads are joined: blocking calls already running finish, queued
ones and coroutines still running are cancelled.

Environment variables (read here, when the portal starts):

- ``CORRAL_MAX_WORKERS``: worker threads for blocking calls (``corral.submit``, the
  ``*_future`` methods), i.e. calls running at once (default 64); further calls wait.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import os
import queue
import threading
from collections.abc import AsyncIterator, Callable, Coroutine, Iterator, Sequence
from dataclasses import dataclass
from typing import Any, TypeVar

import anyio
import anyio.to_thread
from anyio.from_thread import BlockingPortal, start_blocking_portal

from corral.errors import InvalidArgument, InvalidState

T = TypeVar("T")

DEFAULT_MAX_WORKERS = 64
DEFAULT_PARALLEL = 16
PORTAL_THREAD_NAME = "corral-portal"


@dataclass
class _Portal:
    pid: int
    portal: BlockingPortal
    context: contextlib.AbstractContextManager[BlockingPortal]
    workers: anyio.CapacityLimiter
    thread_id: int
    loop: asyncio.AbstractEventLoop
    tasks: set[asyncio.Task[Any]]

    def spawn(self, call: _Call) -> concurrent.futures.Future[Any]:
        """Start ``call`` on the loop (one hop, no waiting); its future ends when the
        coroutine has ended, cleanup included."""
        done = call.future

        def report(task: asyncio.Task[Any]) -> None:
            self.tasks.discard(task)
            call.close()
            if task.cancelled():
                call.cancelled()
            elif (exc := task.exception()) is not None:
                done.set_exception(exc)
            else:
                done.set_result(task.result())

        def start() -> None:
            task = call.task = self.loop.create_task(call.run())
            self.tasks.add(task)
            task.add_done_callback(report)

        self.loop.call_soon_threadsafe(start)
        return done


# The process's portal, started on first use; a forked child starts its own.
_lock = threading.Lock()
_current: list[_Portal] = []
_hooks_installed: list[bool] = []
_orphans: list[_Portal] = []


def _max_workers() -> int:
    raw = os.environ.get("CORRAL_MAX_WORKERS") or str(DEFAULT_MAX_WORKERS)
    if not raw.isdigit() or int(raw) < 1:
        raise InvalidArgument(f"CORRAL_MAX_WORKERS must be a positive integer, got {raw!r}")
    return int(raw)


def _forget_after_fork() -> None:
    # The child has the parent's objects but not its portal thread; it may also have
    # inherited ``_lock`` held by a thread that does not exist here.
    # The parent's portal objects are kept, never collected: closing its context
    # manager would wait for a thread that is not there.
    global _lock
    _lock = threading.Lock()
    _orphans.extend(_current)
    _current.clear()


def _stop_at_exit() -> None:
    with _lock:
        if not _current or _current[0].pid != os.getpid():
            return
        state = _current.pop()
    # Cancel what still runs on the loop (a blocking call already on a worker thread
    # finishes: threads cannot be interrupted), then join the portal's thread.
    with contextlib.suppress(Exception):
        state.portal.call(state.portal.stop, True)
    with contextlib.suppress(Exception):
        state.context.__exit__(None, None, None)


def _install_hooks() -> None:
    if _hooks_installed:
        return
    _hooks_installed.append(True)
    os.register_at_fork(after_in_child=_forget_after_fork)
    # Before threading joins non-daemon threads (anyio's idle workers are ones): an
    # ``atexit`` hook would run after that join and never be reached.
    register = getattr(threading, "_register_atexit", None)
    if register is not None:
        register(_stop_at_exit)
    else:  # pragma: no cover - CPython has had it since 3.9
        import atexit

        atexit.register(_stop_at_exit)


def _portal() -> _Portal:
    with _lock:
        if _current and _current[0].pid == os.getpid():
            return _current[0]
        _current.clear()
        workers = _max_workers()
        context = start_blocking_portal(name=PORTAL_THREAD_NAME)
        portal = context.__enter__()
        limiter = portal.call(anyio.CapacityLimiter, workers)
        thread_id = portal.call(threading.get_ident)
        loop = portal.call(asyncio.get_running_loop)
        _install_hooks()
        _current.append(_Portal(os.getpid(), portal, context, limiter, thread_id, loop, set()))
        return _current[0]


def portal() -> BlockingPortal:
    """The process's portal (started if needed), for code that needs more than
    :func:`run_sync`."""
    return _portal().portal


def on_portal_thread() -> bool:
    """True in a coroutine or callback running on the portal's loop."""
    state = _current[0] if _current else None
    return state is not None and state.pid == os.getpid() and state.thread_id == threading.get_ident()


class _Carried(Exception):
    """A ``BaseException`` of the coroutine, carried to the caller (anyio would
    otherwise let it crash the portal's loop)."""

    def __init__(self, exc: BaseException) -> None:
        super().__init__(repr(exc))
        self.exc = exc


class _Call:
    """One coroutine on the portal, which the waiting thread can cancel.

    Cancelled the asyncio way (once, like ``Task.cancel``), not through an anyio
    cancel scope, whose cancellation would hit every ``await`` of the coroutine's
    cleanup too (deleting the sandboxes it made, say).
    """

    def __init__(self, coro: Coroutine[Any, Any, Any]) -> None:
        self._coro = coro
        self.task: asyncio.Task[Any] | None = None  # set on the loop when started
        self.future: concurrent.futures.Future[Any] = concurrent.futures.Future()

    async def run(self) -> Any:
        try:
            return await self._coro
        except (Exception, asyncio.CancelledError):
            raise
        except BaseException as exc:  # noqa: BLE001 - re-raised in the caller's thread
            raise _Carried(exc) from None

    def close(self) -> None:
        self._coro.close()  # a no-op once it ran; else no "never awaited" warning

    def cancelled(self) -> None:
        self.future.cancel()
        self.future.set_running_or_notify_cancel()  # wakes ``futures.wait``

    def _cancel(self) -> None:  # on the portal's loop
        if self.task is not None:
            self.task.cancel()
        else:  # interrupted before it was handed to the loop: it never will be
            self.close()
            self.cancelled()

    def cancel_and_wait(self, state: _Portal, future: concurrent.futures.Future[Any]) -> None:
        with contextlib.suppress(RuntimeError):  # the loop is closed: nothing runs
            state.loop.call_soon_threadsafe(self._cancel)
            concurrent.futures.wait([future])


def _refuse_on_portal_thread(what: str) -> None:
    if on_portal_thread():
        raise InvalidState(
            f"{what} was called from a coroutine running on corral's own event loop, "
            "where it would wait for itself forever; use the async API there "
            "(await the coroutine instead of calling the blocking function)"
        )


def run_sync(coro: Coroutine[Any, Any, T], *, timeout: float | None = None) -> T:
    """Run ``coro`` on the portal and wait for its result (at most ``timeout`` s).

    On timeout or Ctrl-C the coroutine is cancelled and its cleanup awaited before
    :class:`TimeoutError` / :exc:`KeyboardInterrupt` is raised here.
    """
    try:
        _refuse_on_portal_thread("a blocking corral function")
        state = _portal()
    except BaseException:
        coro.close()
        raise
    call = _Call(coro)
    future = call.future
    try:
        state.spawn(call)
        return future.result(timeout)
    except concurrent.futures.TimeoutError:
        call.cancel_and_wait(state, future)
        raise TimeoutError(f"the call did not finish within {timeout} s and was cancelled") from None
    except _Carried as carried:
        raise carried.exc from None
    except concurrent.futures.CancelledError:
        # Cancelled from the portal's side: the portal stopped (interpreter exit).
        raise InvalidState("corral's event loop stopped while the call was running") from None
    except BaseException:
        if not future.done():
            call.cancel_and_wait(state, future)
        raise


def iterate_sync(
    make: Callable[[], AsyncIterator[T]],
    *,
    cleanup: Callable[[], Coroutine[Any, Any, Any]] | None = None,
) -> Iterator[T]:
    """Items of the async iterator ``make()`` as they come, in the caller's thread.

    ``make`` is called on the portal's loop; ``cleanup`` (if given) is awaited there
    after the iteration ends, however it ends. An exception of the iterator is raised
    here; leaving early cancels it and waits for its cleanup.
    """
    _refuse_on_portal_thread("a blocking corral iterator")
    items: queue.SimpleQueue[tuple[bool, Any]] = queue.SimpleQueue()

    async def pump() -> None:
        try:
            async for item in make():
                items.put((True, item))
        finally:
            if cleanup is not None:
                await cleanup()

    state = _portal()
    call = _Call(pump())
    future = call.future
    future.add_done_callback(lambda _f: items.put((False, None)))
    try:
        state.spawn(call)
        while True:
            more, value = items.get()
            if not more:
                break
            yield value
        if future.cancelled():
            return
        try:
            future.result()
        except _Carried as carried:
            raise carried.exc from None
    finally:
        if not future.done():
            call.cancel_and_wait(state, future)


def submit_blocking(fn: Callable[[], T], *, bounded: bool = True) -> concurrent.futures.Future[T]:
    """Start ``fn()`` on one of the portal's worker threads.

    ``bounded=False`` does not count it against ``CORRAL_MAX_WORKERS``: for work that
    callers running on those workers wait for (an env used inside ``corral.submit``),
    which would otherwise wait for threads its own callers hold.

    The returned future stays pending until a worker starts the call, so
    :meth:`~concurrent.futures.Future.cancel` works until then, as with a
    :class:`~concurrent.futures.ThreadPoolExecutor`.
    """
    state = _portal()
    done: concurrent.futures.Future[T] = concurrent.futures.Future()

    def work() -> None:
        if not done.set_running_or_notify_cancel():
            return
        try:
            done.set_result(fn())
        except BaseException as exc:  # noqa: BLE001 - handed to whoever waits
            done.set_exception(exc)

    async def start() -> None:
        if not done.cancelled():
            limiter = state.workers if bounded else anyio.CapacityLimiter(1)
            await anyio.to_thread.run_sync(work, limiter=limiter)

    state.spawn(_Call(start()))
    return done


def in_parallel(calls: Sequence[Callable[[], Any]], *, limit: int = DEFAULT_PARALLEL) -> list[Any]:
    """Each blocking call's result or exception (not raised), in order, running at
    most ``limit`` at once on the portal's worker threads."""

    def attempt(call: Callable[[], Any]) -> Any:
        try:
            return call()
        except Exception as exc:  # noqa: BLE001 - returned to the caller, in order
            return exc

    if len(calls) <= 1:
        return [attempt(c) for c in calls]

    async def run_all() -> list[Any]:
        out: list[Any] = [None] * len(calls)
        limiter = anyio.CapacityLimiter(limit)

        async def one(i: int) -> None:
            out[i] = await anyio.to_thread.run_sync(attempt, calls[i], limiter=limiter)

        async with anyio.create_task_group() as group:
            for i in range(len(calls)):
                group.start_soon(one, i)
        return out

    return run_sync(run_all())
