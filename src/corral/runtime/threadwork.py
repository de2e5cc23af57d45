"""Blocking work in a thread whose effect a cancellation does not orphan.

Cancelling ``await asyncio.to_thread(fn)`` cancels only the await: the thread runs on,
and what ``fn`` makes (a cgroup, a directory, a held lock) lands after its caller has
given up on it, with nobody left to remove it. A ``close()`` that cancels such a caller
and returns at once then leaves that behind (a ``slot-…`` cgroup after a clean daemon
stop). :func:`finish_in_thread` keeps a cancelled caller until ``fn`` has ended and its
effect is undone, so whoever awaits the caller's task knows the work is over.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable
from typing import TypeVar

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
