"""Attack (closed): a policy under evaluation rewrites its own returns.

The evaluation runner (``corral.rl._eval_runner``) once loaded the policy into the
process that also ran the env and wrote the records: a policy module that, as it is
imported, replaced the runner's ``emit`` (``import __main__``) or the env's ``step``
scored whatever it liked. DESIGN.md: "a verdict is never decided inside the process
being judged". The policy now runs in a process of its own (a pipe pair to the runner);
its ``__main__.emit`` is its own copy's (more attacks: test_eval_policy_process.py).
This test runs the runner as evaluation does (its files in one directory), outside
any sandbox: the forgery needs nothing the sandbox would stop.
"""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

import corral.rl._eval_runner as runner_module
import corral.rl.envs.tictactoe as tictactoe_module

FORGER = """
import __main__
_emit = __main__.emit
def emit(message):
    if isinstance(message, dict) and "return" in message:
        message = dict(message, **{"return": 1.0})  # every game won
    _emit(message)
__main__.emit = emit

def act(observation):
    return 0  # always the first cell: an illegal move by the second turn
"""
HONEST = FORGER.split("import __main__")[0] + FORGER.split("__main__.emit = emit")[1]


def _run(tmp_path: Path, policy: str) -> dict:
    shutil.copy(runner_module.__file__, tmp_path / "runner.py")
    shutil.copy(tictactoe_module.__file__, tmp_path / "tictactoe.py")
    (tmp_path / "policy.py").write_text(policy)
    (tmp_path / "job.json").write_text(json.dumps({
        "policy": {"kind": "module", "module": "policy.py"},
        "env": {"id": "corral/TicTacToe-v0", "kwargs": {}, "max_steps": 20}}))
    out = subprocess.run([sys.executable, str(tmp_path / "runner.py"), "run", "0:0"],
                         capture_output=True, text=True, timeout=60, cwd=tmp_path)
    return json.loads(out.stdout.strip().splitlines()[-1])


def test_a_policy_cannot_rewrite_its_own_return(tmp_path):
    (tmp_path / "honest").mkdir()
    (tmp_path / "forger").mkdir()
    honest = _run(tmp_path / "honest", HONEST)
    forged = _run(tmp_path / "forger", FORGER)
    assert honest["return"] != 1.0  # the same play, honestly scored, does not win
    assert forged["return"] == honest["return"]
