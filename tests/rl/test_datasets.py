"""Dataset adapters (corral.rl.datasets): one sample row of each shape, shipped in
tests/rl/data, read from its file, turned into a task, and judged end to end."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from corral.errors import InvalidArgument
from corral.rl import code_reward
from corral.rl.datasets import load_tasks, read_rows
from corral.rl.stdio import IOCase
from tests.conftest import requires_root

DATA = Path(__file__).parent / "data"
KINDS = ["apps", "taco", "code_contests", "livecodebench", "mbpp", "humaneval"]


def reference(kind: str, row: dict) -> str:
    """The row's own reference solution, as a model would write it."""
    if kind in ("apps", "taco"):
        return json.loads(row["solutions"])[0]
    if kind == "code_contests":
        return row["solutions"]["solution"][0]
    if kind == "mbpp":
        return row["code"]
    if kind == "humaneval":
        return row["prompt"] + row["canonical_solution"]
    return {  # livecodebench ships no solutions
        "abc000_a": "import math\na, b = map(int, input().split())\nprint(math.gcd(a, b))\n",
        "9001": "class Solution:\n    def countPairs(self, nums, target):\n"
                "        return sum(1 for i in range(len(nums)) for j in range(i + 1, len(nums))"
                " if nums[i] + nums[j] == target)\n",
    }[row["question_id"]]


def test_each_shape_becomes_tasks():
    apps = load_tasks(DATA / "apps.jsonl", "apps")
    assert isinstance(apps[0].tests[0], IOCase) and apps[0].tests[0].output == "5\n"
    assert apps[1].entry_point == "total" and "Solution().total" in apps[1].tests[0]
    cc = load_tasks(DATA / "code_contests.jsonl", "code_contests")[0]
    assert [c.output for c in cc.tests] == ["14\n", "1\n", "385\n", "338350\n"]
    assert cc.tests[0].time_limit == 2 and cc.tests[0].memory_mb == 256
    lcb = load_tasks(DATA / "livecodebench.jsonl", "livecodebench")
    assert [c.input for c in lcb[0].tests] == ["12 18\n", "4 6\n", "17 5\n"]  # private unpacked
    assert lcb[1].entry_point == "countPairs" and not lcb[1].io
    mbpp = load_tasks(DATA / "mbpp.jsonl", "mbpp")[0]
    assert mbpp.entry_point == "similar_elements" and len(mbpp.tests) == 2
    he = load_tasks(read_rows(DATA / "humaneval.jsonl"), "humaneval")[0]
    assert he.entry_point == "max" and he.tests[0].endswith("check(max)\n")
    assert json.dumps(cc.row())  # plain data, ready for datasets.Dataset.from_list
    with pytest.raises(InvalidArgument, match="unknown dataset kind"):
        load_tasks([], "spider")


@requires_root
@pytest.mark.parametrize("kind", KINDS)
def test_one_row_of_each_shape_end_to_end(daemon, kind):
    rows = read_rows(DATA / f"{kind}.jsonl")
    tasks = load_tasks(rows, kind)
    reward = code_reward("fraction", url=daemon.url)
    columns = {k: [t.row()[k] for t in tasks] for k in ("tests", "entry_point", "language")}
    completions = [f"```{t.language or 'python'}\n{reference(kind, r)}\n```"
                   for t, r in zip(tasks, rows, strict=True)]
    got = reward(prompts=[t.prompt for t in tasks], completions=completions, **columns)
    assert got == [1.0] * len(tasks), [o.report.feedback() for o in reward.last_outcomes]
    wrong = reward(prompts=[t.prompt for t in tasks],
                   completions=["```python\nprint(0)\ndef f(*a):\n    return 0\n```"] * len(tasks),
                   **columns)
    assert all(w is not None and w < 1.0 for w in wrong), wrong
