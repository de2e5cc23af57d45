"""Attacks by a policy under evaluation on the runner that judges it
(``corral.rl._eval_runner``: the policy runs in a forked process of its own that holds
only a pipe pair; the runner is non-dumpable and accepts only plain data). Each runs
the runner as evaluation does (its files in one directory), outside any sandbox: none
needs anything a sandbox would stop, so none may rely on one."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest

import corral.rl._eval_runner as runner_module
import corral.rl.envs.tictactoe as tictactoe_module

FIRST_CELL = "\ndef act(observation):\n    return 0  # an illegal move by the second turn\n"


def _drop_ptrace() -> None:
    import ctypes

    if ctypes.CDLL(None, use_errno=True).prctl(24, 19, 0, 0, 0) != 0:  # CAPBSET_DROP SYS_PTRACE
        raise OSError(ctypes.get_errno(), "cannot drop CAP_SYS_PTRACE")


def _run(policy: str, items: tuple[str, ...] = ("0:0",), *, no_ptrace: bool = False,
         timeout: float | None = None) -> tuple[list[dict], subprocess.CompletedProcess]:
    """The runner's records for ``items`` with ``policy`` (and how it ended)."""
    with tempfile.TemporaryDirectory() as tmp:
        d = Path(tmp)
        shutil.copy(runner_module.__file__, d / "runner.py")
        shutil.copy(tictactoe_module.__file__, d / "tictactoe.py")
        (d / "policy.py").write_text(policy)
        (d / "job.json").write_text(json.dumps({
            "policy": {"kind": "module", "module": "policy.py"},
            "env": {"id": "corral/TicTacToe-v0", "kwargs": {}, "max_steps": 20},
            "timeout": timeout}))
        # root would read a non-dumpable process's /proc files with CAP_SYS_PTRACE
        # (a sandbox has none): the runner runs without it
        drop = _drop_ptrace if no_ptrace and os.geteuid() == 0 else None
        out = subprocess.run([sys.executable, "-S", str(d / "runner.py"), "run", *items],
                             capture_output=True, text=True, timeout=60, cwd=d,
                             preexec_fn=drop)
    records = [json.loads(line) for line in out.stdout.splitlines() if line.strip()]
    return records, out


def _honest() -> dict:
    records, _ = _run(FIRST_CELL)
    assert records[0]["return"] != 1.0
    return records[0]


def test_a_policy_that_patches_the_env_class_scores_its_real_play():
    forger = "import tictactoe\n" \
        "tictactoe.TicTacToeEnv.step = lambda self, a: (self._obs(), 1.0, True, False, {})\n"
    records, _ = _run(forger + FIRST_CELL)
    assert records == [dict(_honest(), seconds=records[0]["seconds"])]


def test_the_policy_process_holds_only_its_pipes_and_cannot_reach_the_runner():
    spy = r'''
import os, sys
fds = sorted(int(fd) for fd in os.listdir("/proc/self/fd"))
reached = []
for path in ("/proc/%d/mem" % os.getppid(), "/proc/%d/fd/3" % os.getppid()):
    try:
        open(path, "rb").close()
        reached.append(path)
    except OSError:
        pass
for fd in range(5, 256):  # a record fd it kept would take this line
    try:
        os.write(fd, b'{"seed": 0, "k": 0, "return": 1.0}\n')
    except OSError:
        pass
print("SPY", fds, reached, file=sys.stderr)
'''
    records, out = _run(spy + FIRST_CELL, no_ptrace=True)
    assert records == [dict(_honest(), seconds=records[0]["seconds"])]
    line = next(x for x in out.stderr.splitlines() if x.startswith("SPY"))
    fds, reached = line[4:].split("] ")
    # 0-2 (stdin /dev/null, stdout and stderr: the runner's stderr), 3-4 (the pipes),
    # and the one listdir had open
    assert len(json.loads(fds + "]")) == 6, line
    assert reached == "[]", line


def test_a_policy_that_kills_its_runner_gets_no_record():
    killer = "import os, signal\n" + FIRST_CELL.replace(
        "    return 0", "    os.kill(os.getppid(), signal.SIGKILL)\n    return 0")
    records, out = _run(killer)
    assert records == [] and out.returncode == -9


@pytest.mark.parametrize("reply", [
    b"A" * (2 << 20),  # past the bounded read, no newline
    b"\x80\x04\x95pickled\n",  # a pickle: never unpickled, not JSON
    b'{"a": {"nd": [1], "dt": "|O"}}\n',  # an object array
    b'{"a": {"np": 1, "dt": "<M8[s]"}}\n',  # a dtype numpy parses as something else
    b'{"a": {"__reduce__": "os.system"}}\n',
    b"[" * 100000 + b"\n",  # deeper than any parser's stack
], ids=["huge", "pickle", "object-dtype", "datetime", "unknown-object", "deep"])
def test_garbage_from_the_policy_process_is_an_episode_error(reply):
    raw = f"import os\ndef act(observation):\n    os.write(4, {reply!r})\n    os._exit(0)\n"
    records, out = _run(raw, ("0:0", "1:0"))
    assert [r.get("return") for r in records] == [None, None], records
    assert all(r["where"] == "policy" and r["steps"] == 0 for r in records), records
    assert out.returncode == 0, out.stderr[-2000:]


def test_an_action_that_is_not_plain_data_is_the_policys_error():
    pickler = "class Evil:\n    def __reduce__(self):\n        return (print, ('pwned',))\n" \
        "def act(observation):\n    return Evil()\n"
    records, out = _run(pickler)
    assert records[0]["error"].startswith("TypeError: the policy returned a Evil")
    assert "pwned" not in out.stdout + out.stderr


def test_decode_takes_only_numbers_lists_and_numeric_arrays():
    np = pytest.importorskip("numpy")
    d = runner_module.decode
    assert d({"nd": [[1, 2]], "dt": "<f4"}).dtype == np.float32
    assert d({"np": 3, "dt": "<i8"}) == 3 and d({"t": [1, [2]]}) == (1, [2])
    for bad in ({"nd": [1], "dt": "|O"}, {"nd": [1], "dt": "V8"}, {"np": 1, "dt": "<M8[s]"},
                {"nd": [1], "dt": "x" * 99}, {"x": 1}, {"nd": [[1], [1, 2]], "dt": "<f8"},
                {"d": [["a", {"q": 1}]]}, [[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[1]]]]]]]]]]]]]]]]]]]]]]]]]]]]]]]]]]):
        with pytest.raises((ValueError, TypeError)):
            d(bad)


def test_a_policy_that_stops_answering_times_out_by_the_runners_clock():
    # answers the first episode, then sleeps at the second's first step (an empty board)
    sleeper = "import time\nseen = 0\ndef act(obs):\n    global seen\n" \
        "    if obs == [0] * 9 and seen:\n        time.sleep(3600)\n" \
        "    seen += 1\n    return obs.index(0)\n"
    # 3 s: the first episode must end within it, on a loaded host (0.5 s was tight)
    records, out = _run(sleeper, ("0:0", "1:0", "2:0"), timeout=3)
    assert "return" in records[0], records
    assert [r.get("timed_out") for r in records[1:]] == [True, True], records
    assert records[1]["error"] == "the episode ran past its 3 s timeout"
    assert out.returncode == 0
