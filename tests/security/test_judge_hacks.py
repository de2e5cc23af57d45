"""Attacks on the judges from the red-team pass of issue 24, as real completions.

Python tests: a solution that redefines a built-in the tests use, one that patches the
standard library in its process, one that reads back what the tests printed. stdin/
stdout tests: a program that looks for the expected output on disk, in /proc, in its
environment, in another test's files, or leaves a process behind to watch the
checker. Each earns nothing; where the attack is real against the old way, a control
shows it.
"""

from __future__ import annotations

import secrets

import pytest

import corral
from corral.rl import code_reward
from corral.rl.stdio import run_io_tests
from tests.conftest import requires_root

pytestmark = requires_root


def fence(code: str, lang: str = "python") -> str:
    return f"```{lang}\n{code}\n```"


def reward_of(daemon, code, tests, *, entry_point=None, grading="auto"):
    # 16 s a run, 8 a test: honest answers and controls must pass within them, loaded
    reward = code_reward("fraction", timeout=16, test_timeout=8, url=daemon.url, grading=grading)
    cols = {"entry_point": [entry_point]} if entry_point else {}
    got = reward(completions=[fence(code)], tests=[tests], **cols)
    return got[0], reward.last_outcomes[0]


# ------------------------------------------------------------------ built-ins

SHADOWS = [
    ("range that yields nothing", "range = lambda *a: []\ndef f(x):\n    return 0",
     ["for i in range(10):\n    assert f(i) == 2 * i"]),
    ("abs that is always 0", "abs = lambda x: 0\ndef f(x):\n    return 0.0",
     ["assert abs(f(2) - 4.0) < 1e-6"]),
    ("HumanEval check over range", "range = lambda *a: []\ndef f(x):\n    return 0",
     ["def check(candidate):\n    for i in range(1, 5):\n        assert candidate(i) == 2 * i\n"
      "check(f)"]),
    ("isinstance that says yes, to push the test in-process",
     "isinstance = lambda *a: True\ndef f(x):\n    return 'no'",
     ["assert isinstance(f(2), int) and f(2) == 4"]),
    ("all that is always True", "all = lambda xs: True\ndef f(x):\n    return 0",
     ["assert all(f(i) == i * 2 for i in [1, 2, 3])"]),
]


@pytest.mark.parametrize("name, code, tests", SHADOWS, ids=[s[0] for s in SHADOWS])
def test_a_builtin_the_solution_redefines_is_never_the_tests(daemon, name, code, tests):
    got, outcome = reward_of(daemon, code, tests, entry_point="f")
    assert got == 0.0, f"{name}: {outcome.reason}"
    assert outcome.report.grading == "isolated"
    # Without the task's name: not gradable (None), never a pass.
    got, outcome = reward_of(daemon, code, tests)
    assert got is None and outcome.verdicts == ["IE"], f"{name}: {outcome.reason}"


def test_a_patched_stdlib_module_is_the_judges_own(daemon):
    code = ("import math\nmath.isclose = lambda *a, **k: True\n"
            "import operator\noperator.eq = lambda a, b: True\ndef f(x):\n    return 0.0")
    tests = ["assert math.isclose(f(2), 4.0)", "assert operator.eq(f(2), 4.0)"]
    got, outcome = reward_of(daemon, code, tests, entry_point="f")
    assert got == 0.0, outcome.reason
    weak, _ = reward_of(daemon, code, tests, grading="in_process")
    assert weak == 1.0, "control: in its own process the patch works"


# ------------------------------------------------------------- test output

READ_BACK = r"""
import os, re
def f():
    data = b""
    for fd in (1, 2):
        try:
            data += os.pread(fd, 1 << 16, 0)
        except OSError:
            pass
    m = re.search(rb"expected=(\d+)", data)
    return int(m.group(1)) if m else -1
"""


def test_the_solution_cannot_read_what_the_tests_print(daemon):
    secret = secrets.randbelow(10 ** 12) + 10 ** 12
    tests = [f"want = {secret}\nprint('expected=%d' % want, flush=True)\nassert f() == want"]
    got, outcome = reward_of(daemon, READ_BACK, tests, entry_point="f")
    assert got == 0.0, outcome.reason
    assert f"expected={secret}" in outcome.report.output  # the print was kept, apart


# ------------------------------------------------------------ honest shapes

HONEST = '''
import sys
LIMIT = 10
def greet(name):
    print("hello", name)
def main():
    n = int(input())
    xs = list(map(int, sys.stdin.readline().split()))
    print(n * sum(xs))
def capped(x):
    return min(x, LIMIT)
class Point:
    def __init__(self, x, y):
        self.x, self.y = x, y
def mid(a, b):
    return Point((a.x + b.x) / 2, (a.y + b.y) / 2)
def ask():
    return input().upper()
'''

HONEST_TESTS = [
    "import io, contextlib\nbuf = io.StringIO()\nwith contextlib.redirect_stdout(buf):\n"
    "    greet('ann')\nassert buf.getvalue() == 'hello ann\\n'",
    "import io, sys, contextlib\nsys.stdin = io.StringIO('3\\n1 2 3\\n')\nout = io.StringIO()\n"
    "with contextlib.redirect_stdout(out):\n    main()\nassert out.getvalue().strip() == '18'\n"
    "sys.stdin = sys.__stdin__",
    "from unittest import mock\nimport io\nwith mock.patch('sys.stdin', io.StringIO('2\\n5\\n')):\n"
    "    import contextlib\n    o = io.StringIO()\n    with contextlib.redirect_stdout(o):\n"
    "        main()\nassert o.getvalue() == '10\\n'",
    "assert mid(Point(0, 0), Point(2, 4)) == Point(1.0, 2.0)",
    "import solution\nsolution.LIMIT = 3\nassert capped(7) == 3",
    "import solution\nfrom unittest import mock\nwith mock.patch.object(solution, 'LIMIT', 4):\n"
    "    assert capped(7) == 4\nassert capped(70) == 3",  # the value test 4 set, restored
    "from unittest import mock\nwith mock.patch('builtins.input', return_value='abc'):\n"
    "    assert ask() == 'ABC'",
]


def test_honest_solutions_of_every_shape_score_one(daemon):
    reward = code_reward("fraction", timeout=10, url=daemon.url)
    got = reward(completions=[fence(HONEST)], tests=[HONEST_TESTS])
    outcome = reward.last_outcomes[0]
    assert got == [1.0], outcome.report.feedback()
    # Compared objects of its own class, and the test that patches input(): flagged.
    assert outcome.report.grading == "in_process"
    assert outcome.report.in_process_tests == (3, 6)


# ----------------------------------------------------------- stdin/stdout

FINDER = r"""
import os, re, sys, time
PAT = re.compile(rb"corral-secret-[0-9a-f]{32}")
found = set()
def scan(blob):
    found.update(m.decode() for m in PAT.findall(blob))
def read(path):
    try:  # non-blocking: a pipe's other end may never write
        fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK)
    except OSError:
        return
    try:
        scan(os.read(fd, 1 << 20))
    except OSError:
        pass
    finally:
        os.close(fd)
for v in os.environ.values():
    scan(v.encode())
for pid in os.listdir("/proc"):
    if pid.isdigit():
        for what in ("cmdline", "environ", "mem", "fd/0", "fd/1", "fd/3", "fd/4", "fd/5"):
            read(f"/proc/{pid}/{what}")
for root, dirs, files in os.walk("/"):
    if root.startswith(("/proc", "/sys", "/usr", "/dev")):
        dirs[:] = []
        continue
    for name in files:
        read(os.path.join(root, name))
read("/tmp/stash")
# Leave a watcher behind for the next test and for the checker's files.
if os.fork() == 0:
    os.setsid()
    if os.fork() == 0:
        end = time.time() + 20
        while time.time() < end:
            for root, dirs, files in os.walk("/tmp"):
                for name in files:
                    read(os.path.join(root, name))
            if found:
                with open("/tmp/stash", "ab") as fh:
                    fh.write(" ".join(found).encode() + b"\n")
            time.sleep(0.001)
    os._exit(0)
sys.stdout.write(" ".join(sorted(found)) or "nothing")
"""


@pytest.fixture(scope="module")
def judge_sb(daemon):
    with corral.Client(daemon.url) as client:
        try:
            sb = corral.Sandbox.create(client=client, image="judge", memory_mb=1536)
        except corral.errors.ImageNotFound:
            pytest.skip("the judge built-in image is not built (make install)")
        with sb:
            yield sb


@pytest.mark.parametrize("checker", [None, "python", "program"])
def test_expected_outputs_are_nowhere_the_program_can_look(judge_sb, checker):
    secrets_ = ["corral-secret-" + secrets.token_hex(16) for _ in range(3)]
    tests = [{"input": "x\n", "output": s} for s in secrets_]
    spec = None
    if checker == "python":
        spec = {"kind": "python", "source": "def check(i, o, e):\n    return o.strip() == e.strip()\n"}
    elif checker == "program":
        spec = {"kind": "program", "language": "c", "source": (
            "#include <stdio.h>\n#include <string.h>\n#include <unistd.h>\n"
            "int main(int c,char**v){char a[256]={0},b[256]={0};FILE*o=fopen(v[2],\"r\"),"
            "*e=fopen(v[3],\"r\");fscanf(o,\"%255s\",a);fscanf(e,\"%255s\",b);usleep(200000);"
            "return strcmp(a,b)?1:0;}\n")}
    r = run_io_tests(judge_sb, tests, code=FINDER, language="python", time_limit=5,
                     checker=spec)
    assert r.status == "ok", r.reason
    assert r.verdicts == ["WA"] * 3, (r.verdicts, r.errors)
    leftover = judge_sb.exec("cat /tmp/stash 2>/dev/null; ls /tmp").stdout
    assert "corral-secret-" not in leftover


def test_cpu_time_not_wall_time_decides_a_tle(judge_sb):
    # A program that sleeps uses no CPU: under its wall guard it is not a TLE.
    r = run_io_tests(judge_sb, [{"input": "", "output": "ok"}],
                     code="import time\ntime.sleep(1.2)\nprint('ok')", time_limit=1)
    assert r.verdicts == ["AC"], r.errors


def test_a_task_function_the_solution_does_not_define_is_not_the_builtin(daemon):
    # HumanEval-style task named like a built-in; the completion defines nothing.
    tests = ["def check(candidate):\n    assert candidate([1, 5, 2]) == 5\ncheck(max)"]
    got, outcome = reward_of(daemon, "print('hi')", tests, entry_point="max")
    assert got == 0.0 and "defines no 'max'" in outcome.report.errors[0], outcome.reason


REPLACE_CHECKER = r"""
import os, stat
for root, dirs, files in os.walk("/tmp"):
    for name in files:
        path = os.path.join(root, name)
        try:
            if os.stat(path).st_mode & stat.S_IXUSR and name != "main.py":
                with open(path, "w") as f:
                    f.write("#!/bin/sh\nexit 0\n")
        except OSError:
            pass
print("garbage")
"""


def test_the_checker_program_cannot_be_replaced(judge_sb):
    checker = {"kind": "program", "language": "c", "source": (
        "#include <stdio.h>\n#include <string.h>\nint main(int c,char**v){char a[64]={0},"
        "b[64]={0};FILE*o=fopen(v[2],\"r\"),*e=fopen(v[3],\"r\");fscanf(o,\"%63s\",a);"
        "fscanf(e,\"%63s\",b);return strcmp(a,b)?1:0;}\n")}
    tests = [{"input": "", "output": "right"}] * 2
    r = run_io_tests(judge_sb, tests, code=REPLACE_CHECKER, checker=checker)
    assert r.verdicts == ["WA", "WA"], (r.verdicts, r.errors)


def test_a_program_that_waits_forever_is_a_tle(judge_sb):
    r = run_io_tests(judge_sb, [{"input": "", "output": "x"}],
                     code="import time\ntime.sleep(1000)", time_limit=0.5)
    assert r.verdicts == ["TLE"], r.errors
