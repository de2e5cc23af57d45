"""What the kernel keeps across fork and execve, handed down to a daemon, must not reach
its sandboxes (docs/inherited.md): a parent that ran the daemon under ``setarch -R``,
``chrt -f``, ``ionice -c1``, systemd's ``TimerSlackNSec=``, or with THP disabled or the
IO_FLUSHER flag set by prctl.

The attacks, each what a command (and the agent, pid 1) saw before the launcher put
them back (agent/clean.c: clean_kernel_state):

- a personality: ``ADDR_NO_RANDOMIZE`` reached every command and the agent (no ASLR
  for the process that judges the sandbox; ``linux32`` would change ``uname -m``);
- a real-time policy: with RT group scheduling (this kernel) no launcher could join its
  cgroup, so no sandbox started ("cannot join cgroup ...: Invalid argument"); without
  it a command ran SCHED_FIFO, outside its CFS quota (``cpus``), ahead of the host;
- a real-time I/O class: every command's I/O ahead of the host's;
- a 20 ms timer slack: every sleep, poll and timeout in the sandbox up to 20 ms late;
- THP disabled, and IO_FLUSHER (PF_MEMALLOC_NOIO | PF_LOCAL_THROTTLE: a command out of
  the kernel's dirty-page throttling).

One engine, one sandbox, opened from such a parent (tests/security/hostile_parent.py
``--kernel``); what this host would not let the parent set (a container's cgroup with
no real-time budget, no CAP_SYS_RESOURCE) is not checked.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.conftest import requires_root
from tests.security import hostile_parent as hp

pytestmark = [requires_root, pytest.mark.root]

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def seen() -> dict:
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT / "src"), str(ROOT)])}
    r = subprocess.run(
        [sys.executable, "-m", "tests.security.hostile_parent", "--kernel", "--",
         sys.executable, "-m", "tests.security.hostile_parent", "--one"],
        capture_output=True, env=env, cwd=ROOT, timeout=600, check=False,
    )
    assert r.returncode == 0, r.stderr.decode()[-3000:]
    out = json.loads(r.stdout)
    assert "create" not in out, f"no sandbox started: {out['create']}"
    code, stdout, stderr = out["probe"]
    assert code == 0, stderr
    out["procs"] = {"command": {}, "agent": {}}
    for line in stdout.splitlines():
        pid, what, *value = line.split()
        out["procs"]["agent" if pid == "1" else "command"][what.rstrip(":")] = value
    for who in ("command", "agent"):
        assert "stat" in out["procs"][who], stdout
    assert {"personality", "timerslack"} <= set(out["procs"]["command"]), stdout
    return out


def _handed(seen: dict, what: str) -> None:
    if what not in seen["handed_down"]:
        pytest.skip(f"this host did not let the parent set {what}")


def test_a_parents_personality_does_not_reach_a_sandbox(seen):
    _handed(seen, "personality")
    # (the agent's is not readable: it is not dumpable; it is the launcher's, as this is)
    personality = seen["procs"]["command"]["personality"][0]
    assert int(personality, 16) == 0, personality  # PER_LINUX: ASLR on


def test_a_parents_real_time_policy_does_not_reach_a_sandbox(seen):
    _handed(seen, "fifo")  # (and the sandbox started at all: the fixture)
    for who, p in seen["procs"].items():
        assert p["stat"][1] == "0", (who, p["stat"])  # SCHED_OTHER


def test_a_parents_real_time_io_class_does_not_reach_a_sandbox(seen):
    _handed(seen, "ioprio")
    if not all(p.get("ionice") for p in seen["procs"].values()):
        pytest.skip("no ionice in the sandbox's image")
    for who, p in seen["procs"].items():
        assert p["ionice"] and p["ionice"][0] != "realtime:", (who, p["ionice"])


def test_a_parents_timer_slack_does_not_reach_a_sandbox(seen):
    _handed(seen, "timerslack")
    slack = seen["procs"]["command"]["timerslack"]
    assert slack == ["50000"], slack  # the kernel's own


def test_a_parents_thp_and_io_flusher_flags_do_not_reach_a_sandbox(seen):
    _handed(seen, "thp")
    if not all("THP_enabled" in p for p in seen["procs"].values()):
        pytest.skip("no THP_enabled in /proc/PID/status (Linux < 5.0)")
    for who, p in seen["procs"].items():
        assert p["THP_enabled"] == ["1"], (who, p["THP_enabled"])
    _handed(seen, "io_flusher")
    for who, p in seen["procs"].items():
        assert not int(p["stat"][0]) & hp.PF_IO_FLUSHER, (who, hex(int(p["stat"][0])))
