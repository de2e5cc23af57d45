"""Handles, wait and as_completed: on plain functions, then on real sandboxes."""

from __future__ import annotations

import threading
import time

import pytest

import corral


def test_submit_and_result():
    h = corral.submit(sum, [1, 2, 3])
    assert h.result(timeout=5) == 6 and h.done() and h.exception() is None
    assert "sum" in repr(h) and "done" in repr(h)
    failing = corral.submit(int, "x")
    with pytest.raises(ValueError):
        failing.result(timeout=5)
    assert isinstance(failing.exception(), ValueError) and "failed" in repr(failing)


def test_wait_num_returns_and_timeout():
    gate = threading.Event()
    quick = [corral.submit(time.sleep, 0.01 * i) for i in range(3)]
    blocked = corral.submit(gate.wait, 30)
    try:
        done, pending = corral.wait([blocked, *quick], num_returns=2, timeout=10)
        assert len(done) == 2 and all(h in quick for h in done)
        assert pending[0] is blocked and len(pending) == 2
        done, pending = corral.wait([blocked], timeout=0.1)
        assert (done, pending) == ([], [blocked])
        with pytest.raises(corral.InvalidArgument):
            corral.wait(quick, num_returns=4)
        with pytest.raises(TimeoutError):
            list(corral.as_completed([blocked], timeout=0.1))
    finally:
        gate.set()
    assert blocked.result(timeout=5) is True


def test_as_completed_yields_fastest_first():
    handles = [corral.submit(lambda d=d: (time.sleep(d), d)[1], d) for d in (0.3, 0.0, 0.15)]
    assert [h.result() for h in corral.as_completed(handles, timeout=10)] == [0.0, 0.15, 0.3]
    seen = []
    handles[0].add_done_callback(seen.append)
    assert seen == [handles[0]]


def test_fan_out_on_real_sandboxes(client):
    """Create many sandboxes, run code in each, collect results as they finish."""
    creating = [corral.Sandbox.create_future(memory_mb=64, tags=["fanout"], client=client) for _ in range(12)]
    sandboxes = [h.result(timeout=120) for h in creating]
    try:
        assert all(isinstance(sb, corral.Sandbox) for sb in sandboxes)
        runs = {sb.exec_future(["python3", "-c", f"print({i} ** 2)"], timeout=30): i
                for i, sb in enumerate(sandboxes)}
        assert all("exec" in h.label for h in runs)
        got = {runs[h]: h.result().stdout for h in corral.as_completed(runs, timeout=120)}
        assert got == {i: f"{i ** 2}\n" for i in range(12)}
        done, pending = corral.wait([sb.exec_future("true") for sb in sandboxes], num_returns=5, timeout=60)
        assert len(done) == 5 and all(h.result().ok for h in done)
        corral.wait(pending, timeout=60)
    finally:
        corral.wait([corral.submit(sb.delete) for sb in sandboxes], timeout=120)


def test_submit_one_function_per_completion(client):
    def score(code: str) -> float:
        with corral.Sandbox.create(memory_mb=64, client=client) as sb:
            sb.files.write("solution.py", code)
            return 1.0 if sb.exec(["python3", "solution.py"], timeout=10).stdout == "ok\n" else 0.0

    handles = [corral.submit(score, code) for code in ["print('ok')", "print('no')", "1/0"]]
    assert [h.result(timeout=120) for h in handles] == [1.0, 0.0, 0.0]
