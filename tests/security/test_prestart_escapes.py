"""Completions that try to escape their zero on a pre-started judge
(``code_reward(..., prestart=N)``, one ``consume`` request per completion) rather than
forge a pass (red team 13). A reward of ``None`` (not gradable, or an infrastructure
failure retried until it gave up) drops a completion from the batch instead of
penalising it: a policy that learns to crash the machinery dodges every wrong answer.

Each completion here is wrong and tries one way of breaking what judges it: memory,
processes, disk, output floods, a crash of the interpreter, its session killed, the
sandbox's lifetime outlasted. Each must score 0.0, each sandbox deleted with its
verdict, and a right answer judged in the same batch scores 1.0.
"""

from __future__ import annotations

import time

import corral
from corral.rl import code_reward
from tests.conftest import requires_root
from tests.security.test_reward_hacks import TESTS, fence

pytestmark = requires_root

HONEST = "def f(x):\n    return 2 * x"
WRONG = "\ndef f(x):\n    return 0"
ESCAPES = {
    "memory": "hold = []\nwhile True:\n    hold.append(bytearray(1 << 24))" + WRONG,
    "forks": "import os\nfor _ in range(100000):\n    try:\n        os.fork()\n"
             "    except OSError:\n        pass" + WRONG,
    "disk": "with open('/tmp/fill', 'wb') as fh:\n    while True:\n        fh.write(b'x' * (1 << 20))"
            + WRONG,
    "flood": "import sys\nwhile True:\n    sys.stdout.write('corral-verdict-' * 4096)" + WRONG,
    "segfault": "import ctypes\nctypes.string_at(0)" + WRONG,
    "session": "import os, signal\nos.killpg(0, signal.SIGKILL)" + WRONG,
    "pid1": "import os, signal\nfor pid in range(1, 64):\n    try:\n"
            "        os.kill(pid, signal.SIGKILL)\n    except OSError:\n        pass" + WRONG,
    "outlive": "import time\ntime.sleep(3600)" + WRONG,
    "closed": "import os\nfor fd in range(0, 256):\n    try:\n        os.close(fd)\n"
              "    except OSError:\n        pass" + WRONG,
}


def test_no_completion_escapes_its_zero(daemon):
    codes = [HONEST, *ESCAPES.values()]
    # 16 s a run, 8 a test: the right answer must pass within them on a loaded host
    reward = code_reward("fraction", timeout=16, test_timeout=8, url=daemon.url,
                         prestart=len(codes))
    try:
        reward.prestart()
        got = reward(completions=[fence(c) for c in codes], tests=[TESTS] * len(codes))
        outcomes = reward.last_outcomes
        assert reward.stats.prestarted == len(codes)  # each on a pre-started judge
    finally:
        reward.close()
    assert got[0] == 1.0, outcomes[0].reason
    for name, score, outcome in zip(ESCAPES, got[1:], outcomes[1:], strict=True):
        assert score == 0.0, f"{name}: {score} ({outcome.reason})"
    # Each deleted with its verdict: the verdict's request began the deletion, which goes
    # on after the reply (delete_first=False), so a loaded host may still list one for a
    # moment (full run 21). Bounded only against a hang.
    judged = {o.sandbox_id for o in outcomes}
    deadline = time.monotonic() + 120
    with corral.Client(daemon.url) as client:
        while left := {s.id for s in corral.Sandbox.list(client=client)} & judged:
            assert time.monotonic() < deadline, f"judges never deleted: {left}"
            time.sleep(0.1)
