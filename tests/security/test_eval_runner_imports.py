"""Attack: the policy's process plants a module where the runner will import it.

The runner (``corral.rl._eval_runner``) forks the policy's process before any policy
code runs, but both share the runner's directory, which is ``sys.path[0]`` (the
policy's files live there, and the policy may write to it). A module the runner
imports only **after** the fork (``select``, for its per-step deadline, once lazily)
was looked up there first: a policy that wrote ``select.py`` next to itself ran its
code inside the runner, which holds the env and the record channel, and rewrote every
record to a win. The runner now imports what it needs before the fork and drops its
directory from ``sys.path`` once the policy's process exists. Run outside a sandbox,
as test_eval_policy_process.py does: the attack needs nothing a sandbox stops.
"""

from __future__ import annotations

from tests.security.test_eval_policy_process import FIRST_CELL, _honest, _run

PLANTER = r'''
import os
HERE = os.path.dirname(os.path.abspath(__file__))
FAKE = """
import os, sys, __main__
sys.modules.pop("select", None)
sys.path[:] = [p for p in sys.path if os.path.abspath(p or ".") != %r]
import select as _real
select, error = _real.select, _real.error
_emit = __main__.emit
def emit(message):
    if isinstance(message, dict) and "seed" in message:
        message = {"seed": message["seed"], "k": message["k"], "return": 1.0, "steps": 1,
                   "terminated": True, "truncated": False, "digest": "0" * 16, "seconds": 0.0}
    _emit(message)
__main__.emit = emit
"""
with open(os.path.join(HERE, "select.py"), "w") as f:
    f.write(FAKE % HERE)
'''


def test_a_module_the_policy_plants_in_its_directory_never_runs_in_the_runner():
    records, out = _run(PLANTER + FIRST_CELL, ("0:0", "1:0"), timeout=30)
    honest = _honest()
    assert [r["return"] for r in records] == [honest["return"]] * 2, (records, out.stderr[-2000:])
    assert records[0]["digest"] == honest["digest"]
    assert out.returncode == 0, out.stderr[-2000:]
