"""Blocking work in a thread whose effect a cancellation does not orphan.

Cancelling ``await asyncio.to_thread(fn)`` cancels only the await: the thread runs on,
and what ``fn`` makes (a cgroup, a directory, a held lock) lands after its caller has
given up on it, with nobody left to remove it. A ``close()`` that cancels such a caller
and returns at once then leaves that behind (a ``slot-…`` cgroup after a clean daemon
stop). :func:`finish_in_thread` keeps a cancelled caller until ``fn`` has ended and its
effect is undone, so whoever awaits the caller's task knows the work is over.

:class:`ThreadBatch` runs many callers' short blocking steps a batch to a job.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable
from typing import TYPE_CHECKING, TypeVar

if TYPE_CHECKING:
    from concurrent.futures import Executor

log = logging.getLogger("corral.runtime")

T = TypeVar("T")


async def finish_in_thread(fn: Callable[[], T], *,
                           on_cancel: Callable[[T], object] | None = None) -> T:
    """``fn()`` run in a thread, like :func:`asyncio.to_thread`; but when the caller is
    cancelled meanwhile, it still waits for ``fn`` to end (through further
    cancellations too), then passes what ``fn`` returned to ``on_cancel`` (in a thread:
    undo it, or hand it on), and only then re-raises the :class:`CancelledError`."""
    work = asyncio.ensure_future(asyncio.to_thread(fn))
    try:
        return await asyncio.shield(work)
    except asyncio.CancelledError:
        await _to_the_end(work)
        if on_cancel is not None and not work.cancelled() and work.exception() is None:
            undo = asyncio.ensure_future(asyncio.to_thread(on_cancel, work.result()))
            await _to_the_end(undo)
            if not undo.cancelled() and undo.exception() is not None:
                log.warning("could not undo the work of a cancelled call: %s", undo.exception())
        raise


async def _to_the_end(work: asyncio.Future[T]) -> None:
    """Wait until ``work`` is done, whatever cancels the waiter meanwhile (the caller
    re-raises its cancellation afterwards: none is lost)."""
    while not work.done():
        try:
            await asyncio.wait({work})
        except asyncio.CancelledError:
            continue


class ThreadBatch:
    """Short blocking steps of many callers, run in an executor a few at a time.

    One executor job per step costs the event loop a submit, a wake-up of the loop from
    the thread and a future's callbacks each (a mass teardown: a thousand of each). Here
    up to ``size`` steps queued together share one job, and each caller gets a future
    of its own, done when its step is (its exception, if it raised). A batch goes to the
    executor once it holds ``size`` steps, or at the end of the loop turn that queued
    its first: the first steps start before a long run of callers has finished queuing.
    """

    def __init__(self, executor: Executor, size: int) -> None:
        self._executor = executor
        self._size = size
        self._queued: list[tuple[Callable[[], object], asyncio.Future[None]]] = []

    def run(self, fn: Callable[[], object]) -> asyncio.Future[None]:
        loop = asyncio.get_running_loop()
        fut: asyncio.Future[None] = loop.create_future()
        if not self._queued:
            loop.call_soon(self._flush)
        self._queued.append((fn, fut))
        if len(self._queued) >= self._size:
            self._flush()
        return fut

    def _flush(self) -> None:
        steps, self._queued = self._queued, []
        if not steps:
            return
        loop = asyncio.get_running_loop()
        try:
            job = loop.run_in_executor(self._executor, _run_all, steps)
        except RuntimeError:  # its pool was shut down (the engine closing): asyncio's
            job = loop.run_in_executor(None, _run_all, steps)
        job.add_done_callback(lambda done: _settle(steps, done))


def _run_all(steps: list[tuple[Callable[[], object], asyncio.Future[None]]]
             ) -> list[BaseException | None]:
    errors: list[BaseException | None] = []
    for fn, _ in steps:
        try:
            fn()
            errors.append(None)
        except Exception as exc:  # one step's failure is its caller's, not its neighbours'
            errors.append(exc)
    return errors


def _settle(steps: list[tuple[Callable[[], object], asyncio.Future[None]]],
            job: asyncio.Future[list[BaseException | None]]) -> None:
    if job.cancelled():
        for _, fut in steps:
            fut.cancel()
        return
    failed = job.exception()
    errors = job.result() if failed is None else [failed] * len(steps)
    for (_, fut), err in zip(steps, errors, strict=True):
        if fut.done():  # its caller gave up waiting
            continue
        if err is None:
            fut.set_result(None)
        else:
            fut.set_exception(err)
