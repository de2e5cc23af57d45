"""Attack (open, xfail): a policy under evaluation rewrites its own returns.

The evaluation runner (``corral.rl._eval_runner``) loads the policy into the process
that also runs the env and writes the records: the record channel is kept from the
policy's *prints*, but not from its code. A policy module that, as it is imported,
replaces the runner's ``emit`` (``import __main__``) or the env's ``step`` scores
whatever it likes. DESIGN.md: "a verdict is never decided inside the process being
judged". Closing it means running the env and the record channel in a process the
policy cannot reach (a pipe to a separate policy process), at the per-step cost the
runner's one-process design avoids: left to the runner's owner. This test runs the
runner as evaluation does (its files in one directory), outside any sandbox: the
forgery needs nothing the sandbox would stop.
"""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

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


@pytest.mark.xfail(strict=True, reason="open: the policy shares the runner's process "
                   "(env, records); see the module docstring")
def test_a_policy_cannot_rewrite_its_own_return(tmp_path):
    (tmp_path / "honest").mkdir()
    (tmp_path / "forger").mkdir()
    honest = _run(tmp_path / "honest", HONEST)
    forged = _run(tmp_path / "forger", FORGER)
    assert honest["return"] != 1.0  # the same play, honestly scored, does not win
    assert forged["return"] == honest["return"]
