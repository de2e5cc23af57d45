"""Pre-started judges (``code_reward(..., prestart=N)``, corral/rl/_prestart.py): a
completion judged by one gets a sandbox no other completion touched, and nothing one
completion leaves (files, environment, processes, imported modules) reaches the next;
a judge that waited in the pool still counts its budget from its request; the pool is
refilled after a batch and deleted on ``close``."""

from __future__ import annotations

import copy
import dataclasses
import pickle
import time

import pytest

import corral
from corral.rl import code_reward
from corral.rl._prestart import MAX_IDLE_S
from tests.conftest import requires_root

pytestmark = requires_root


def fence(code: str) -> str:
    return f"```python\n{code}\n```"


# Leaves every kind of state it can behind: files (in /tmp, home, the working
# directory), its environment, a process in a session of its own, a module of its own
# in sys.modules and an attribute on a standard one.
LEAVE_STATE = r"""
import json, os, subprocess, sys, types
for d in ("/tmp", os.path.expanduser("~"), os.getcwd()):
    try:
        with open(os.path.join(d, "corral-mark"), "w") as fh:
            fh.write("left")
    except OSError:
        pass
os.environ["CORRAL_MARK"] = "left"
subprocess.Popen(["sleep", "600"], start_new_session=True, stdin=subprocess.DEVNULL,
                 stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
sys.modules["corral_mark"] = types.ModuleType("corral_mark")
json.CORRAL_MARK = "left"
"""

# What the next completion finds of it: every item must be absent for f() == 1.
FIND_STATE = r"""
import json, os, sys
def f():
    found = []
    for d in ("/tmp", os.path.expanduser("~"), os.getcwd()):
        if os.path.exists(os.path.join(d, "corral-mark")):
            found.append("file in " + d)
    if os.environ.get("CORRAL_MARK"):
        found.append("env")
    for pid in os.listdir("/proc"):
        try:
            with open("/proc/%s/cmdline" % pid, "rb") as fh:
                if fh.read().startswith(b"sleep"):
                    found.append("process")
        except OSError:
            pass
    if "corral_mark" in sys.modules:
        found.append("module")
    if hasattr(json, "CORRAL_MARK"):
        found.append("json attribute")
    return 1 if not found else found
"""


def test_no_state_crosses_between_completions(daemon, client):
    reward = code_reward("binary", timeout=20, url=daemon.url, concurrency=1, prestart=2)
    try:
        assert reward.prestart() == 2
        # One completion leaves state, the next looks for it: the first sandbox and its
        # judge are never handed to the second.
        got = reward(completions=[fence(LEAVE_STATE + "def f():\n    return 1"),
                                  fence(FIND_STATE)],
                     tests=[["assert f() == 1"], ["assert f() == 1"]])
        first, second = reward.last_outcomes
        assert got == [1.0, 1.0], second.report and second.report.errors
        assert first.sandbox_id != second.sandbox_id
        assert reward.stats.prestarted == 2
        # The control: in one sandbox, the finder does see what was left.
        got = reward(completions=[fence(LEAVE_STATE + FIND_STATE)], tests=[["assert f() == 1"]])
        assert got == [0.0], "the finder must see state left in its own sandbox"
    finally:
        reward.close()


def test_a_judge_that_waited_counts_its_budget_from_the_request(daemon, client):
    # (12 s and 8 s: the right completion must pass within them on a loaded host, where
    # 5 s and 3 s were not always enough; the loop never ends, so it still times out)
    reward = code_reward("fraction", timeout=12, test_timeout=8, url=daemon.url, prestart=2)
    try:
        assert reward.prestart() == 2
        time.sleep(12.5)  # longer than the run's whole timeout, waiting in the pool
        start = time.monotonic()
        got = reward(completions=[fence("def f(x):\n    return 2 * x"),
                                  fence("def f(x):\n    while True:\n        pass")],
                     tests=[["assert f(2) == 4"], ["assert f(2) == 4"]])
        assert got == [1.0, 0.0]
        assert reward.stats.prestarted == 2
        assert time.monotonic() - start < 60  # the loop was stopped, not waited out
    finally:
        reward.close()


def test_the_pool_refills_after_a_batch_and_old_judges_are_not_used(daemon, client):
    reward = code_reward("binary", timeout=10, url=daemon.url, prestart=2)
    try:
        reward(completions=[fence("def f():\n    return 1")], tests=[["assert f() == 1"]])
        assert reward.stats.prestarted == 0  # nothing started before the first batch
        assert reward.prestart() == 2  # the background refill, or this call, filled it
        pool = reward._pool
        assert pool is not None and len(pool) == 2
        old = pool._ready[0]
        pool._ready[0] = dataclasses.replace(old, born=old.born - MAX_IDLE_S)
        got = reward(completions=[fence("def f():\n    return 1")], tests=[["assert f() == 1"]])
        assert got == [1.0] and reward.stats.prestarted == 1
        assert reward.last_outcomes[0].sandbox_id != old.sandbox.id
        assert reward.prestart() == 2  # deletes the stale one, starts another
        assert old.sandbox.id not in {e.sandbox.id for e in pool._ready}
        # A fill before a batch replaces a judge too old to serve, not the batch.
        aged = pool._ready[0]
        pool._ready[0] = dataclasses.replace(aged, born=aged.born - MAX_IDLE_S)
        assert reward.prestart() == 2
        assert aged.sandbox.id not in {e.sandbox.id for e in pool._ready}
        with pytest.raises(corral.SandboxNotFound):
            corral.Sandbox.connect(aged.sandbox.id, client=client)
        # A copy (pickled to a worker, deep-copied) never shares a waiting judge.
        for twin in (copy.deepcopy(reward), pickle.loads(pickle.dumps(reward))):
            assert len(twin._pool) == 0 and len(pool) == 2
    finally:
        reward.close()
    assert len(reward._pool) == 0


def test_prestart_is_validated_and_off_for_in_process_grading(daemon):
    with pytest.raises(Exception, match="prestart must be"):
        code_reward(prestart=-1)
    assert code_reward(prestart=4, grading="in_process", url=daemon.url).prestart() == 0


def test_a_judge_whose_sandbox_went_away_costs_a_retry_not_a_reward(daemon, client):
    reward = code_reward("binary", timeout=10, url=daemon.url, prestart=1, concurrency=1)
    try:
        assert reward.prestart() == 1
        corral.Sandbox.connect(reward._pool._ready[0].sandbox.id, client=client).delete()
        got = reward(completions=[fence("def f():\n    return 1")], tests=[["assert f() == 1"]])
        assert got == [1.0] and reward.last_outcomes[0].attempts == 2
    finally:
        reward.close()
