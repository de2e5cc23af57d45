"""``finish_in_thread``: a cancelled caller returns only once its thread's work is over
and undone (portable: no root needed). The real cases, with cgroups, launchers and a
frozen sandbox, are in test_launcher.py and test_checkpoint.py."""

from __future__ import annotations

import asyncio
import threading

import pytest

from corral.runtime.threadwork import finish_in_thread


async def test_a_cancelled_caller_waits_for_the_thread_and_undoes_what_it_made():
    made: list[str] = []
    entered, go = threading.Event(), threading.Event()

    def make() -> str:
        entered.set()
        go.wait(60)
        made.append("thing")
        return "thing"

    task = asyncio.create_task(finish_in_thread(make, on_cancel=made.remove))
    try:
        assert await asyncio.to_thread(entered.wait, 60)
        task.cancel()
        await asyncio.sleep(0.05)
        assert not task.done(), "the caller returned while its thread still ran"
        task.cancel()  # a second cancel does not cut the wait short either
        await asyncio.sleep(0.05)
        assert not task.done()
    finally:
        go.set()
    with pytest.raises(asyncio.CancelledError):
        await task
    assert made == [], "what the thread made after the cancel was not undone"


async def test_uncancelled_it_is_to_thread():
    undone: list[object] = []
    assert await finish_in_thread(lambda: 6 * 7, on_cancel=undone.append) == 42
    assert undone == []
    with pytest.raises(ZeroDivisionError):
        await finish_in_thread(lambda: 1 // 0)


async def test_a_thread_that_failed_has_nothing_to_undo():
    entered, go = threading.Event(), threading.Event()

    def fail() -> None:
        entered.set()
        go.wait(60)
        raise OSError("no room")

    undone: list[object] = []
    task = asyncio.create_task(finish_in_thread(fail, on_cancel=undone.append))
    assert await asyncio.to_thread(entered.wait, 60)
    task.cancel()
    go.set()
    with pytest.raises(asyncio.CancelledError):
        await task
    assert undone == []


async def test_a_batch_gives_each_caller_its_own_outcome_and_runs_at_its_size():
    """``ThreadBatch``: steps queued together share executor jobs of ``size`` steps; a
    step that raises fails its own caller only; a pool shut down meanwhile still runs
    them (asyncio's), so no caller waits for ever."""
    from concurrent.futures import ThreadPoolExecutor

    from corral.runtime.threadwork import ThreadBatch

    pool = ThreadPoolExecutor(2)
    batch = ThreadBatch(pool, size=3)
    threads: list[int] = []

    def step(i: int):
        def run() -> None:
            threads.append(threading.get_ident())
            if i == 4:
                raise OSError("step 4 fails")
        return run

    futs = [batch.run(step(i)) for i in range(7)]  # jobs of 3, 3, then 1 at the turn's end
    results = await asyncio.wait_for(asyncio.gather(*futs, return_exceptions=True), 30)
    assert [type(r).__name__ for r in results] == ["NoneType"] * 4 + ["OSError"] + ["NoneType"] * 2
    assert len(threads) == 7
    pool.shutdown()
    late = [batch.run(step(i)) for i in range(2)]
    assert await asyncio.wait_for(asyncio.gather(*late), 30) == [None, None]
