"""A program judged on stdin/stdout disturbs its judge (corral/guest/io_judge.py).

The program runs as the judge's uid, so it may SIGSTOP the judge (its parent) or lower
the judge's scheduling (``setpriority``, ``SCHED_IDLE``). A stopped or starved judge
no longer polls the program's memory: a program that stopped it, held 100 MiB in
/dev/shm under a 64 MiB limit, gave it back and resumed it was judged AC. Now a judge
disturbed while a program runs fails that case (``RE``, saying so), whatever its output.
"""

from __future__ import annotations

import pytest

import corral
from corral.rl.stdio import run_io_tests
from tests.conftest import requires_root

pytestmark = requires_root

PROGRAM = r"""
import os, signal
judge = os.getppid()
DISTURB
with open("/dev/shm/big", "wb") as f:  # over the case's 64 MiB, for a moment
    for _ in range(100):
        f.write(b"x" * (1 << 20))
os.unlink("/dev/shm/big")
UNDO
print(int(input()) * 2)
"""
WAYS = {
    "stop": ("os.kill(judge, signal.SIGSTOP)", "os.kill(judge, signal.SIGCONT)"),
    "tstp": ("os.kill(judge, signal.SIGTSTP)", "os.kill(judge, signal.SIGCONT)"),
    "idle": ("os.sched_setscheduler(judge, os.SCHED_IDLE, os.sched_param(0))", ""),
    "nice": ("os.setpriority(os.PRIO_PROCESS, judge, 19)", ""),
}
CASE = [{"input": "21\n", "output": "42\n"}]


@pytest.fixture(scope="module")
def sb(daemon):
    with corral.Client(daemon.url) as client:
        with corral.Sandbox.create(client=client, memory_mb=1024) as made:
            yield made


def judged(sb, disturb: str, undo: str) -> corral.rl.TestReport:
    code = PROGRAM.replace("DISTURB", disturb).replace("UNDO", undo)
    return run_io_tests(sb, CASE, code=code, memory_mb=64, time_limit=5)


@pytest.mark.parametrize("way", sorted(WAYS))
def test_a_program_that_disturbs_its_judge_fails_the_case(sb, way):
    r = judged(sb, *WAYS[way])
    assert r.status == "ok" and r.verdicts == ["RE"], (r.verdicts, r.errors)
    assert "the judge" in r.errors[0]


def test_the_same_program_undisturbed_is_over_its_memory(sb):
    r = judged(sb, "", "")
    assert r.verdicts == ["MLE"], (r.verdicts, r.errors)
    honest = run_io_tests(sb, CASE, code="print(int(input()) * 2)", memory_mb=64)
    assert honest.verdicts == ["AC"], honest.errors
