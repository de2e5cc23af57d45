"""Attack on :func:`corral.rl.evaluate` by the policy it scores (corral/rl/_eval_runner.py):
policy and env share the runner's process, and the runner's records used to share its
stdout with the policy. A policy that prints ``{"seed": S, "k": 0, "return": 1e6}`` for
every seed it may be given, after the runner's own record (``atexit``), had that line
read as its record: the last one per key won. Records now go to the runner's private
copy of stdout, file descriptor 1 points at stderr once the policy loads, and a key
with two records (something wrote to the channel on purpose) keeps neither.

The forge is skipped in the base's check (``runner.py check``), so the policy passes it
and the evaluation reaches its episodes — fresh runners and pre-started ones alike."""

from __future__ import annotations

import math

import pytest

import corral
from corral.rl import evaluate
from corral.rl._eval_result import parse_records
from corral.runtime import criu
from corral.runtime.paths import default_cache_dir
from tests.conftest import requires_root

FORGER = r'''
import atexit, json, sys

def forge():
    for seed in range(8):
        print(json.dumps({"seed": seed, "k": 0, "return": 1e6, "steps": 500,
                          "terminated": False, "truncated": True, "digest": "0" * 16}),
              flush=True)

if sys.argv[1:2] != ["check"]:
    atexit.register(forge)

def act(obs):
    if sys.argv[1:2] != ["check"]:
        forge()
    return 0
'''


@requires_root
@pytest.mark.parametrize("prestart", [False, True])
def test_a_policy_printing_records_scores_nothing_by_them(daemon, prestart):
    if prestart and criu.find(default_cache_dir()) is None:
        pytest.skip(f"no cached CRIU: {criu.BUILD}")
    with corral.Client(daemon.url) as client:
        res = evaluate(FORGER, "CartPole-v1", seeds=range(2), cache=False, client=client,
                       prestart=prestart, concurrency=2, timeout=60)
    assert [e.status for e in res.episodes] == ["ok", "ok"], [e.error for e in res.episodes]
    # Always pushing left ends CartPole within a few dozen steps.
    assert all(e.episode_return < 100 for e in res.episodes), res.episodes
    assert all(e.digest != "0" * 16 for e in res.episodes)


def test_records_written_twice_or_malformed_are_not_scored():
    real = '{"seed": 1, "k": 0, "return": 9.0, "steps": 9, "digest": "ab"}'
    lines = [
        '{"seed": 0, "k": 0, "return": 1e6}', '{"seed": 0, "k": 0, "return": 10.0}',  # twice
        real,
        '{"seed": 2, "k": 0}',  # no return: once crashed the evaluation (KeyError)
        '{"seed": 3, "k": 0, "return": NaN}', '{"seed": 4, "k": 0, "return": Infinity}',
        '{"seed": 5, "k": 0, "return": [1]}', '[5, 0]', '"x"', '{"seed": "x", "k": 0}',
    ]
    records = parse_records("\n".join(lines))
    assert sorted(records) == [(0, 0), (1, 0)]
    assert "two records" in records[(0, 0)]["error"] and "return" not in records[(0, 0)]
    assert records[(1, 0)]["return"] == 9.0 and math.isfinite(records[(1, 0)]["return"])
