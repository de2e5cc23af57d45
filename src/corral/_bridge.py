"""The one bridge between blocking and asyncio code, for the SDK and the RL toolkit.

corral's work is asyncio underneath; its blocking faces (``evaluate``,
``CodeReward.evaluate``, ``run_episodes``, the vector env) cross over here, and only
here, so the rules are the same everywhere:

- :func:`run_sync` runs a coroutine to completion from blocking code. Called from a
  thread that already runs an event loop (a notebook cell, an async trainer), it
  runs the coroutine on a loop of its own in a worker thread instead of failing with
  "asyncio.run() cannot be called from a running event loop".
- :func:`iterate_sync` turns an async generator into a blocking iterator whose items
  arrive while the generator still runs (on its own loop in a daemon thread);
  leaving the loop early (``break``, an exception, Ctrl-C) cancels the generator and
  waits for its cleanup, so nothing it started outlives the iteration.
- :func:`in_parallel` runs blocking calls on at most ``limit`` threads and returns
  each one's result or exception, in order.
"""

from __future__ import annotations

import asyncio
import queue
import threading
from collections.abc import AsyncIterator, Callable, Coroutine, Iterator, Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import Any, TypeVar

T = TypeVar("T")

DEFAULT_PARALLEL = 16


def _running_loop() -> asyncio.AbstractEventLoop | None:
    try:
        return asyncio.get_running_loop()
    except RuntimeError:
        return None


def run_sync(coro: Coroutine[Any, Any, T], *, name: str = "corral-sync") -> T:
    """Run ``coro`` to completion from blocking code, even inside a running loop."""
    if _running_loop() is None:
        return asyncio.run(coro)
    box: dict[str, Any] = {}

    def target() -> None:
        try:
            box["value"] = asyncio.run(coro)
        except BaseException as exc:  # noqa: BLE001 - re-raised in the caller's thread
            box["error"] = exc

    thread = threading.Thread(target=target, name=name)
    thread.start()
    thread.join()
    if "error" in box:
        raise box["error"]
    return box["value"]


def iterate_sync(
    make: Callable[[], AsyncIterator[T]],
    *,
    cleanup: Callable[[], Coroutine[Any, Any, Any]] | None = None,
    name: str = "corral-iterate",
) -> Iterator[T]:
    """Items of the async iterator ``make()`` as they come, in the caller's thread.

    ``make`` is called on the worker's loop; ``cleanup`` (if given) is awaited there
    after the iteration ends, however it ends. An exception of the iterator is raised
    here; a cancellation (the caller left early) just ends the iteration.
    """
    items: queue.Queue[tuple[str, Any]] = queue.Queue()
    ready = threading.Event()
    handle: dict[str, Any] = {}

    async def pump() -> None:
        handle["loop"], handle["task"] = asyncio.get_running_loop(), asyncio.current_task()
        ready.set()
        try:
            async for item in make():
                items.put(("item", item))
        finally:
            if cleanup is not None:
                await cleanup()

    def main() -> None:
        try:
            asyncio.run(pump())
            items.put(("done", None))
        except BaseException as exc:  # noqa: BLE001 - re-raised in the caller's thread
            items.put(("error", exc))
        finally:
            ready.set()

    thread = threading.Thread(target=main, name=name, daemon=True)
    thread.start()
    ready.wait()
    try:
        while True:
            kind, value = items.get()
            if kind == "item":
                yield value
            elif kind == "error":
                if isinstance(value, asyncio.CancelledError):
                    return
                raise value
            else:
                return
    finally:
        if thread.is_alive() and "task" in handle:
            handle["loop"].call_soon_threadsafe(handle["task"].cancel)
        thread.join()


def in_parallel(calls: Sequence[Callable[[], Any]], *, limit: int = DEFAULT_PARALLEL) -> list[Any]:
    """Each blocking call's result or exception (not raised), in order."""

    def attempt(call: Callable[[], Any]) -> Any:
        try:
            return call()
        except Exception as exc:  # noqa: BLE001 - returned to the caller, in order
            return exc

    if len(calls) <= 1:
        return [attempt(c) for c in calls]
    with ThreadPoolExecutor(min(len(calls), limit), thread_name_prefix="corral-parallel") as pool:
        return list(pool.map(attempt, calls))
