"""The blocking/asyncio bridge every blocking face of the SDK and RL toolkit uses."""

import asyncio
import os
import signal
import sys
import threading
import time

import pytest

import corral
from corral import _bridge
from corral._bridge import in_parallel, iterate_sync, run_sync, submit_blocking
from corral.errors import InvalidState


async def _thread_name() -> str:
    await asyncio.sleep(0)
    return threading.current_thread().name


def _portal_threads() -> list[threading.Thread]:
    return [t for t in threading.enumerate() if t.name == _bridge.PORTAL_THREAD_NAME]


def _wait_until(predicate, seconds: float = 10.0) -> bool:
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        if predicate():
            return True
        time.sleep(0.01)
    return predicate()


def test_run_sync_runs_on_one_portal_reused_across_calls_and_threads():
    assert run_sync(_thread_name()) == _bridge.PORTAL_THREAD_NAME
    first = _bridge.portal()
    from_threads = in_parallel([lambda: run_sync(_thread_name()) for _ in range(4)], limit=4)
    assert from_threads == [_bridge.PORTAL_THREAD_NAME] * 4
    assert _bridge.portal() is first
    assert len(_portal_threads()) == 1


def test_run_sync_inside_a_running_loop_works_on_the_portal():
    async def notebook_cell():
        return run_sync(_thread_name())

    assert asyncio.run(notebook_cell()) == _bridge.PORTAL_THREAD_NAME


def test_run_sync_from_the_portals_own_loop_is_a_clear_error_not_a_deadlock():
    async def inner():
        return 1

    async def callback_calling_the_blocking_api():
        coro = inner()
        with pytest.raises(InvalidState, match="use the async API"):
            run_sync(coro)
        return "refused"

    assert run_sync(callback_calling_the_blocking_api()) == "refused"


def test_exceptions_cross_intact_including_base_exceptions():
    err = KeyError("x")

    async def boom():
        raise err

    with pytest.raises(KeyError) as caught:
        run_sync(boom())
    assert caught.value is err

    async def leave():
        raise SystemExit(3)

    with pytest.raises(SystemExit) as exited:
        run_sync(leave())
    assert exited.value.code == 3
    # The portal survived both.
    assert run_sync(_thread_name()) == _bridge.PORTAL_THREAD_NAME

    async def notebook_cell():
        return run_sync(boom())

    with pytest.raises(KeyError):
        asyncio.run(notebook_cell())


def test_timeout_cancels_the_coroutine_and_waits_for_its_cleanup():
    state = {"cleaned": False}

    async def slow():
        try:
            await asyncio.sleep(60)
        finally:
            await asyncio.sleep(0.05)
            state["cleaned"] = True

    before = len(run_sync(_all_tasks()))
    with pytest.raises(TimeoutError, match="cancelled"):
        run_sync(slow(), timeout=0.1)
    assert state["cleaned"]
    assert len(run_sync(_all_tasks())) == before


async def _all_tasks() -> set:
    return {t for t in asyncio.all_tasks() if t is not asyncio.current_task()}


def test_ctrl_c_while_waiting_cancels_the_coroutine_and_leaks_no_task():
    if threading.current_thread() is not threading.main_thread():
        pytest.skip("signals reach the main thread only")
    state = {"started": threading.Event(), "cleaned": False}

    async def slow():
        state["started"].set()
        try:
            await asyncio.sleep(60)
        finally:
            state["cleaned"] = True

    def ctrl_c() -> None:
        # Only once the coroutine runs, however long that takes under load: a SIGINT
        # sent earlier would land before (or outside) the call it is meant to cancel.
        if state["started"].wait(600):
            os.kill(os.getpid(), signal.SIGINT)

    before = len(run_sync(_all_tasks()))
    # Python's own Ctrl-C handler, whatever an earlier test left installed
    handler = signal.signal(signal.SIGINT, signal.default_int_handler)
    timer = threading.Thread(target=ctrl_c)
    try:
        timer.start()
        with pytest.raises(KeyboardInterrupt):
            run_sync(slow())
    finally:
        timer.join()
        signal.signal(signal.SIGINT, handler)
    assert state["started"].is_set() and state["cleaned"]
    assert len(run_sync(_all_tasks())) == before


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

    before = len(run_sync(_all_tasks()))
    seen = []
    for x in iterate_sync(numbers, cleanup=cleanup):
        seen.append(x)
        if x == 2:
            break
    assert seen == [0, 1, 2]
    assert state["cleaned"] and state["made"] < 1000
    assert len(run_sync(_all_tasks())) == before


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


def test_in_parallel_respects_its_limit():
    running, peak, lock = [0], [0], threading.Lock()

    def call():
        with lock:
            running[0] += 1
            peak[0] = max(peak[0], running[0])
        time.sleep(0.02)
        with lock:
            running[0] -= 1

    in_parallel([call] * 8, limit=3)
    assert 1 <= peak[0] <= 3


def test_submitted_calls_can_be_cancelled_until_they_start():
    gate = threading.Event()
    started = threading.Event()

    def hold():
        started.set()
        gate.wait(10)
        return "held"

    first = submit_blocking(hold)
    assert started.wait(10)
    assert not first.cancel()  # already running
    gate.set()
    assert first.result(10) == "held"


def test_handles_run_on_the_portals_workers_and_carry_exceptions():
    def who():
        return threading.current_thread().name

    def fail():
        raise ZeroDivisionError("x")

    ok, bad = corral.submit(who), corral.submit(fail)
    assert ok.result(timeout=10) != threading.current_thread().name
    with pytest.raises(ZeroDivisionError):
        bad.result(timeout=10)
    assert run_sync(_thread_name()) == _bridge.PORTAL_THREAD_NAME


def _run_script(tmp_path, text: str) -> str:
    import subprocess

    script = tmp_path / "script.py"
    script.write_text(text)
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(sys.path))
    out = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=60, env=env)
    assert out.returncode == 0, out.stderr
    return out.stdout


@pytest.mark.skipif(not hasattr(os, "fork"), reason="needs fork")
def test_a_forked_child_gets_a_portal_of_its_own(tmp_path):
    # In a fresh interpreter: pytest's own threads make fork in-process a gamble.
    out = _run_script(tmp_path, (
        "import os, threading, corral\n"
        "from corral import _bridge\n"
        "from corral._bridge import run_sync\n"
        "async def name():\n    return threading.current_thread().name\n"
        "assert run_sync(name()) == _bridge.PORTAL_THREAD_NAME\n"
        "assert corral.submit(lambda: 3).result(timeout=10) == 3\n"
        "parent = _bridge.portal()\n"
        "pid = os.fork()\n"
        "if pid == 0:\n"
        "    ok = run_sync(name()) == _bridge.PORTAL_THREAD_NAME and _bridge.portal() is not parent\n"
        "    ok = ok and corral.submit(lambda: 7).result(timeout=10) == 7\n"
        "    print('child ok' if ok else 'child wrong', flush=True)\n"
        "    os._exit(0 if ok else 1)\n"
        "_, status = os.waitpid(pid, 0)\n"
        "assert os.waitstatus_to_exitcode(status) == 0\n"
        "assert run_sync(name()) == _bridge.PORTAL_THREAD_NAME and _bridge.portal() is parent\n"
        "print('parent ok')\n"
    ))
    assert out == "child ok\nparent ok\n"


def test_the_portal_stops_at_interpreter_exit_without_hanging(tmp_path):
    out = _run_script(tmp_path, (
        "import corral, time\n"
        "from corral._bridge import run_sync\n"
        "async def one():\n    return 1\n"
        "assert run_sync(one()) == 1\n"
        "assert corral.submit(lambda: 2).result(timeout=10) == 2\n"
        "h = corral.submit(time.sleep, 0.2)\n"
        "print('bye', flush=True)\n"
    ))
    assert out == "bye\n"
