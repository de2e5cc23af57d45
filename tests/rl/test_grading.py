"""The judge (docs/grading.md) on honest solutions: what crosses, what is flagged."""

from __future__ import annotations

import logging

import pytest

import corral
from corral.errors import InvalidArgument
from corral.rl import code_reward
from corral.rl.code import run_tests
from tests.conftest import requires_root

pytestmark = requires_root

SOLUTION = '''
import math
LIMIT = 7
def double(x):
    return 2 * x
def kinds():
    return [None, True, 3, 2.5, float("nan"), complex(1, 2), "s", b"\\x00b", (1, [2]),
            {"k": (1, 2)}, {1, 2}, frozenset({3}), 10 ** 40]
def sort_in_place(xs):
    xs.sort()
def fail(kind):
    raise {"value": ValueError, "key": KeyError, "own": type("Odd", (Exception,), {})}[kind]("no")
def count(n):
    yield from range(n)
class Stack:
    def __init__(self):
        self.items = []
    def push(self, x):
        self.items.append(x)
    def pop(self):
        return self.items.pop()
    def __len__(self):
        return len(self.items)
def slow(x):
    while True:
        pass
def apply(fn, x):
    return fn(x)
'''


@pytest.fixture(scope="module")
def sandbox(daemon):
    with corral.Client(daemon.url) as client, corral.Sandbox.create(client=client, memory_mb=256) as sb:
        yield sb


def judged(sb, tests, **kw):
    kw.setdefault("timeout", 10)
    return run_tests(sb, tests, code=SOLUTION, **kw)


def test_plain_data_crosses_exactly(sandbox):
    r = judged(sandbox, [
        "v = kinds()\n"
        "assert v[0] is None and v[1] is True and v[2] == 3 and v[3] == 2.5\n"
        "assert v[4] != v[4] and v[5] == 1+2j and v[6] == 's' and v[7] == b'\\x00b'\n"
        "assert v[8] == (1, [2]) and type(v[8]) is tuple and v[9] == {'k': (1, 2)}\n"
        "assert v[10] == {1, 2} and type(v[11]) is frozenset and v[12] == 10 ** 40\n",
        "assert double(21) == 42 and double('ab') == 'abab'",
        "assert LIMIT == 7",
        "from solution import double as d\nassert d(2) == 4",
        "import solution\nassert solution.double(3) == 6",
    ])
    assert r.tests == ["ok"] * 5, r.feedback()
    assert r.grading == "isolated" and r.in_process_tests == ()


def test_humaneval_style_check_and_wrong_answers(sandbox):
    r = judged(sandbox, [
        "def check(candidate):\n    assert candidate(1) == 2\n    assert candidate(5) == 10\n"
        "check(double)\n",
        "assert double(2) == 5",
    ])
    assert r.tests == ["ok", "error"] and "AssertionError" in r.errors[1]


def test_in_place_changes_exceptions_generators_and_objects(sandbox):
    r = judged(sandbox, [
        "xs = [3, 1, 2]\nassert sort_in_place(xs) is None\nassert xs == [1, 2, 3]",
        "try:\n    fail('value')\nexcept ValueError as e:\n    assert str(e) == 'no'\n"
        "else:\n    raise AssertionError('no exception')",
        "try:\n    fail('own')\nexcept Exception as e:\n    assert 'Odd' in str(e)",
        "assert list(count(3)) == [0, 1, 2]",
        "s = Stack()\ns.push(1)\ns.push('two')\nassert len(s) == 2\n"
        "assert s.pop() == 'two' and s.items == [1]",
        # Two of the solution's objects compare by class and state, flagged: the state
        # is what the solution's process reports (docs/grading.md).
        "assert Stack() == Stack()",
        "s = Stack()\ns.push(1)\nassert s != Stack()",
        "assert Stack() == []",  # one of its objects against plain data: fails, by design
    ])
    assert r.tests == ["ok"] * 7 + ["error"], r.feedback()
    assert "NotPlainData" in r.errors[7]
    assert r.grading == "in_process" and r.in_process_tests == (5, 6)


def test_a_looping_test_costs_that_test_only(sandbox):
    # 8 s: the test that passes must pass within it too, on a loaded host (0.5 s and
    # then 2 s were not always enough); the loop never ends, so it still times out.
    r = judged(sandbox, ["slow(1)", "assert double(1) == 2"], test_timeout=8, timeout=60)
    assert r.tests == ["timeout", "ok"], r.feedback()


def test_unsplittable_tests_are_flagged_or_refused(sandbox):
    tests = ["assert apply(lambda v: v + 1, 1) == 2", "assert double(1) == 2"]
    auto = judged(sandbox, tests)
    assert auto.tests == ["ok", "ok"]
    assert auto.grading == "in_process" and auto.in_process_tests == (0,)
    strict = judged(sandbox, tests, grading="isolated")
    assert strict.tests == ["ungradable", "ok"] and "grading='auto'" in strict.errors[0]
    assert strict.verdicts == ["IE", "AC"] and strict.ungradable == [0]
    weak = judged(sandbox, tests, grading="in_process")
    assert weak.tests == ["ok", "ok"] and weak.in_process_tests == (0, 1)
    with pytest.raises(InvalidArgument, match="grading must be one of"):
        judged(sandbox, tests, grading="loose")


def test_the_reward_counts_and_warns_about_in_process_grading(daemon, caplog):
    reward = code_reward("fraction", url=daemon.url)
    completion = "```python\n" + SOLUTION + "\n```"
    with caplog.at_level(logging.WARNING, logger="corral.rl.rewards"):
        got = reward(completions=[completion] * 2, tests=[
            ["assert double(2) == 4"], ["assert apply(lambda v: v, 3) == 3"]])
    assert got == [1.0, 1.0]
    assert reward.stats.in_process_graded == 1
    assert any("forge" in r.getMessage() for r in caplog.records)


MORE = '''
import collections, enum, sys
class Color(enum.IntEnum):
    RED = 1
class BadInput(ValueError):
    pass
Point = collections.namedtuple("Point", "x y")
class Name(str):
    pass
def big():
    return 10 ** 5000
def subclasses():
    return [collections.Counter("aab"), collections.defaultdict(int, a=1), Point(1, 2),
            Color.RED, Name("n"), bytearray(b"ab")]
def nested(n):
    d = {}
    for _ in range(n):
        d = {"k": d}
    return d
def checked(x):
    if x < 0:
        raise BadInput("negative")
    return x
def gen():
    yield 1
    yield 2
def nan_list():
    return [float("nan")]
def fill(*, into):
    into.append(1)
sys.exit(0)
'''


def test_honest_solutions_red_team_found_misjudged(sandbox):
    r = run_tests(sandbox, [
        "assert big() == 10 ** 5000",
        "c, d, p, e, s, b = subclasses()\n"
        "assert c == {'a': 2, 'b': 1} and d == {'a': 1} and p == (1, 2) and e == 1\n"
        "assert s == 'n' and b == b'ab'",
        "try:\n    checked(-1)\nexcept ValueError as e:\n    assert 'negative' in str(e)\n"
        "else:\n    raise AssertionError",
        "d = nested(60)\nfor _ in range(60):\n    d = d['k']\nassert d == {}",
        "g = gen()\nassert next(g) == 1 and next(g) == 2",
        "import math\nassert nan_list() == [math.nan]",
        "xs = []\nfill(into=xs)\nassert xs == [1]",
    ], code=MORE, timeout=20)
    assert r.loaded, r.feedback()  # sys.exit(0) at the end keeps what was defined
    assert r.tests == ["ok"] * 7, r.feedback()
