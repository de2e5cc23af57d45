"""The blocking/asyncio bridge every blocking face of the SDK and RL toolkit uses."""

import asyncio
import threading

import pytest

from corral._bridge import in_parallel, iterate_sync, run_sync


async def _thread_name() -> str:
    await asyncio.sleep(0)
    return threading.current_thread().name


def test_run_sync_outside_a_loop_runs_here():
    assert run_sync(_thread_name()) == threading.current_thread().name


def test_run_sync_inside_a_running_loop_uses_a_thread_of_its_own():
    async def notebook_cell():
        return run_sync(_thread_name(), name="corral-test")

    assert asyncio.run(notebook_cell()) == "corral-test"


def test_run_sync_raises_the_coroutines_error_in_the_caller():
    async def boom():
        raise KeyError("x")

    async def notebook_cell():
        return run_sync(boom())

    with pytest.raises(KeyError):
        asyncio.run(notebook_cell())


def test_iterate_sync_yields_while_running_and_cleans_up_when_left_early():
    state = {"made": 0, "cleaned": False, "cancelled": False}

    async def numbers():
        try:
            for i in range(1000):
                state["made"] = i + 1
                yield i
                await asyncio.sleep(0.001)
        except asyncio.CancelledError:
            state["cancelled"] = True
            raise

    async def cleanup():
        state["cleaned"] = True

    seen = []
    for x in iterate_sync(numbers, cleanup=cleanup):
        seen.append(x)
        if x == 2:
            break
    assert seen == [0, 1, 2]
    assert state["cleaned"] and state["made"] < 1000


def test_iterate_sync_raises_the_iterators_error_after_its_items():
    async def items():
        yield 1
        raise ValueError("bad episode")

    it = iterate_sync(items)
    assert next(it) == 1
    with pytest.raises(ValueError, match="bad episode"):
        next(it)


def test_in_parallel_returns_results_and_exceptions_in_order():
    def fail():
        raise RuntimeError("no")

    out = in_parallel([lambda: 1, fail, lambda: 3], limit=2)
    assert out[0] == 1 and isinstance(out[1], RuntimeError) and out[2] == 3
