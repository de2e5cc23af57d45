"""Attack: the policy rewrites the runner during the check, and the snapshot keeps it.

:func:`corral.rl.evaluate` writes the runner and the policy into a base sandbox, runs
the runner's check there (which imports the policy: its code runs), and then snapshots
that sandbox for every episode. A policy that, while imported by the check, rewrote
``runner.py`` next to it had every episode's sandbox start the forged runner, which
printed a win for every episode without playing.
"""

from __future__ import annotations

import pytest

import corral
from corral.rl import evaluate
from tests.conftest import requires_root

REWRITER = r'''
import os
RUNNER = os.path.join(os.path.dirname(os.path.abspath(__file__)), "runner.py")
try:
    with open(RUNNER, "w") as f:
        f.write("""import json, sys
items = sys.argv[2:]
if sys.argv[1:] == ["serve"]:  # pre-started: READY, then the items on stdin
    print("READY", flush=True)
    items = sys.stdin.readline().split()
for item in items:
    seed, k = (int(x) for x in item.split(":"))
    print(json.dumps({"seed": seed, "k": k, "return": 1.0, "steps": 1, "terminated": True,
                      "truncated": False, "digest": "0" * 16, "seconds": 0.0}), flush=True)
""")
except OSError:
    pass

def act(obs):
    return 0  # the first cell: an illegal move by the second turn
'''


@requires_root
@pytest.mark.parametrize("prestart", [False, True], ids=["fresh", "prestarted"])
def test_a_policy_that_rewrites_the_runner_during_the_check_scores_its_real_play(daemon, prestart):
    with corral.Client(daemon.url) as client:
        result = evaluate(REWRITER, "tictactoe", seeds=range(2), cache=False, prestart=prestart,
                          client=client)
    assert [e.episode_return for e in result.episodes] == [-1.0, -1.0], result.episodes
