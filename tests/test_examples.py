"""The examples run, end to end, against a real daemon."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import corral
from tests.conftest import requires_root

EXAMPLES = Path(__file__).resolve().parents[1] / "examples"


@requires_root
def test_fanout_demo(daemon):
    p = subprocess.run(
        [sys.executable, str(EXAMPLES / "fanout_demo.py"), "--count", "12", "--parallel", "4",
         "--url", daemon.url],
        capture_output=True, text=True, timeout=600, env={**os.environ, "COLUMNS": "120"},
    )
    assert p.returncode == 0, p.stdout + p.stderr
    out = p.stdout
    assert "Summary" in out and "sandboxes/s" in out and "Reward per variant" in out
    counts = {k: int(n) for k, n in re.findall(r"^\W*(pass|fail|timeout|oom|error)\W+(\d+)\W", out, re.M)}
    assert sum(counts.values()) == 12 and counts["error"] == 0
    # The wrong variants fail whatever the machine's load; the looping one times out
    # and the memory-hungry one is OOM-killed.
    assert counts["fail"] >= 3 and counts["timeout"] >= 1 and counts["oom"] >= 1
    assert re.search(r"loops-forever\W+1\W+0\.00\W+timeout 1", out)
    assert re.search(r"counting-sort\W+1\W+0\.00\W+oom 1", out)
    with corral.Client(daemon.url) as client:
        assert corral.Sandbox.list(tags=["demo"], client=client) == []


@requires_root
def test_pool_fanout(daemon):
    p = subprocess.run(
        [sys.executable, str(EXAMPLES / "pool_fanout.py"), "--url", daemon.url],
        capture_output=True, text=True, timeout=600,
    )
    assert p.returncode == 0, p.stdout + p.stderr
    rows = re.findall(r"^task +(\d+) prime=(True|False) +in (sb-\w+)", p.stdout, re.M)
    assert sorted(int(t) for t, _, _ in rows) == list(range(50))
    primes = {2, 3, 5, 7, 11, 13, 17, 19, 23, 29, 31, 37, 41, 43, 47}
    assert {int(t) for t, answer, _ in rows if answer == "True"} == primes
    assert len({sb for _, _, sb in rows}) == 50, "a sandbox was used for two tasks"
    assert "50 tasks in" in p.stdout and ", 0 errors, 50 distinct sandboxes" in p.stdout
    name = re.search(r"^pool (\S+) on ", p.stdout, re.M).group(1)
    with corral.Client(daemon.url) as client:
        assert name not in [pool["name"] for pool in client.info()["pools"]]
        assert corral.Sandbox.list(tags=[f"pool={name}"], client=client) == []
