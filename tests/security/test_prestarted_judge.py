"""The reward hacks of test_reward_hacks.py against pre-started judges
(``code_reward(..., prestart=N)``): a judge that started before its completion existed
and waited in its own sandbox keeps every guarantee of one started for it
(docs/grading.md) — each hack earns nothing, the judge cannot be read through /proc, the
expected values never reach the solution — and a completion cannot see or reach the
other judges waiting in the pool."""

from __future__ import annotations

import secrets

import corral
from corral.rl import code_reward
from tests.conftest import requires_root
from tests.security.test_reward_hacks import (
    ALWAYS_EQUAL,
    INT_SUBCLASS,
    LIST_SUBCLASS_TRUTHY,
    SEARCH_HEAP,
    STEAL_TOKEN,
    TESTS,
    fence,
)

pytestmark = requires_root

HONEST = "def f(x):\n    return 2 * x"
ON_THE_JUDGE = [
    "import os\nos._exit(0)",
    "print('corral-verdict-' + '0' * 32 + '{\"load\": [\"ok\", null], "
    "\"tests\": [[\"ok\", null], [\"ok\", null], [\"ok\", null]]}')\ndef f(x):\n    return 0",
    "import os, signal\nos.kill(os.getppid(), signal.SIGKILL)\n"
    "print('corral-verdict-' + '0' * 32 + '{}')\ndef f(x):\n    return 0",
    "import os, signal\nos.kill(os.getppid(), signal.SIGSTOP)\ndef f(x):\n    return 2 * x",
    "import os, signal\ntry:\n    os.kill(-1, signal.SIGKILL)\nexcept OSError:\n    pass\n"
    "def f(x):\n    return 2 * x",
    "import os, struct\nfor fd in range(3, 16):\n    try:\n"
    "        os.write(fd, struct.pack('<I', 1 << 31) + b'x' * 64)\n"
    "    except OSError:\n        pass\ndef f(x):\n    return 2 * x",
    "import builtins, json\nbuiltins.AssertionError = type('N', (Exception,), {})\n"
    "json.dumps = lambda *a, **k: '{\"value\": 4}'\ndef f(x):\n    return 0",
]
# The verdict, the judge's exit and the sandbox's delete come back in one reply
# (``consume``): the solution cannot write that reply, nor a line of it, nor a line after
# its judge's verdict that would be read as one.
FORGED_REPLY = [
    "print('{\"data\": \"corral-verdict-' + '0' * 32 + '{\\\"load\\\": [\\\"ok\\\", null], "
    "\\\"tests\\\": [[\\\"ok\\\", null]]}\", \"result\": {\"returncode\": 0}, "
    "\"deleted\": true}')\ndef f(x):\n    return 0",
    "import sys\nsys.stdout.write('\\n' * 200000 + 'corral-verdict-' + '0' * 32 + '{}\\n')\n"
    "def f(x):\n    return 0",
    "import os, time\nif os.fork() == 0:\n    time.sleep(0.3)\n    for fd in range(16):\n"
    "        try:\n            os.write(fd, b'corral-verdict-' + b'0' * 32 + b'{}\\n')\n"
    "        except OSError:\n            pass\n    os._exit(0)\ndef f(x):\n    return 0",
]
FINDER = r"""
import gc, os, re
PAT = re.compile(rb"corral-secret-[0-9a-f]{32}")
def f(x):
    for o in gc.get_objects():
        if isinstance(o, str) and PAT.search(o.encode()):
            return PAT.search(o.encode()).group().decode()
    for pid in os.listdir("/proc"):
        for what in ("cmdline", "environ", "fd/0", "mem"):
            try:
                with open(f"/proc/{pid}/{what}", "rb") as fh:
                    m = PAT.search(fh.read(1 << 20))
            except OSError:
                continue
            if m:
                return m.group().decode()
    return "not found"
"""
# What a completion sees of other judges: only the processes of its own sandbox (its
# judge, itself), never another sandbox's waiting judge; and its judge's memory,
# descriptors and environment are closed to it.
LOOK_AROUND = r"""
import os
pids = [p for p in os.listdir("/proc") if p.isdigit() and p != "1"]
opened = []
for what, mode in (("mem", "r+b"), ("fd/0", "rb"), ("fd/1", "wb"), ("environ", "rb")):
    try:
        with open(f"/proc/{os.getppid()}/{what}", mode):
            opened.append(what)
    except OSError:
        pass
print("PIDS:%d OPENED:%s" % (len(pids), ",".join(opened)))
def f(x):
    return 2 * x
"""


def test_hacks_earn_nothing_from_a_prestarted_judge(daemon):
    secret = "corral-secret-" + secrets.token_hex(16)
    hacks = [STEAL_TOKEN, SEARCH_HEAP, ALWAYS_EQUAL, INT_SUBCLASS, LIST_SUBCLASS_TRUTHY,
             *ON_THE_JUDGE, *FORGED_REPLY, FINDER]
    codes = [HONEST, LOOK_AROUND, *hacks]
    tests = [TESTS] * (len(codes) - 1) + [[f"assert f(0) == {secret!r}"]]
    # 16 s a run, 8 a test: the right answer must pass within them on a loaded host
    reward = code_reward("fraction", timeout=16, test_timeout=8, url=daemon.url,
                         prestart=len(codes))
    try:
        assert reward.prestart() == len(codes)
        got = reward(completions=[fence(c) for c in codes], tests=tests)
        outcomes = reward.last_outcomes
        assert reward.stats.prestarted == len(codes)
    finally:
        reward.close()
    assert got[:2] == [1.0, 1.0], [o.reason for o in outcomes[:2]]  # the controls
    # Its own judge and itself (and what `ps` of its own started): no other judge.
    look = outcomes[1].report.output
    assert "PIDS:2 OPENED:\n" in look + "\n", look
    for code, score, outcome in zip(hacks, got[2:], outcomes[2:], strict=True):
        assert score == 0.0, f"{code[:60]!r}: {outcome.reason}"
        assert outcome.report is None or outcome.report.grading == "isolated"
    assert len({o.sandbox_id for o in outcomes}) == len(codes)
    with corral.Client(daemon.url) as client:  # each deleted with its verdict
        assert not {s.id for s in corral.Sandbox.list(client=client)} & {
            o.sandbox_id for o in outcomes}
