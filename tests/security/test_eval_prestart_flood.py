"""Attack on pre-started evaluation runners (corral/rl/_eval_live.py): the policy shares
the runner's stdout, and its records are read on the evaluating host. A policy printing
64 MiB must not cost that host 64 MiB (``sb.exec`` keeps 1 MiB by default; a plain
``wait()`` would keep every byte): only the head and the tail are kept, and the record
printed after the flood still arrives in the tail. An episode that ignores its request
and never ends is killed at its timeout and reported ``timed_out``."""

from __future__ import annotations

import asyncio
import tracemalloc

import corral
from corral.rl import _eval_live
from tests.conftest import requires_root

pytestmark = requires_root

FLOOD = ("import sys\nsys.stdin.readline()\nline = 'x' * 65535\n"
         "for _ in range(1024):\n    print(line)\nprint('{\"record\": 1}')\n")


async def _serve(url: str, code: str, timeout: float) -> tuple[corral.CommandResult, int]:
    async with corral.AsyncClient(url) as ac:
        async with await corral.AsyncSandbox.create(client=ac) as sb:
            # the daemon keeps all of it for a reader that falls behind (a 16 MiB
            # buffer dropped the record under load): what is bounded here is the
            # evaluating host's copy
            proc = await sb.spawn(["python3", "-c", code], timeout=None,
                                  max_buffer=128 << 20)
            tracemalloc.start()
            try:
                r = await _eval_live.serve(sb, proc.id, ["0:0"], timeout)
                return r, tracemalloc.get_traced_memory()[1]
            finally:
                tracemalloc.stop()


def test_a_policy_flooding_stdout_costs_the_evaluator_a_bounded_copy(daemon):
    r, peak = asyncio.run(_serve(daemon.url, FLOOD, 120))
    assert r.returncode == 0 and not r.timed_out
    assert len(r.stdout_bytes) <= _eval_live.MAX_STDOUT + _eval_live.STDOUT_TAIL + 1
    assert r.stdout.rstrip().endswith('{"record": 1}')  # the record, from the tail
    assert peak < 16 << 20, f"peak {peak >> 20} MiB of Python memory for 64 MiB printed"


def test_a_runner_that_never_ends_is_killed_at_its_timeout(daemon):
    r, _ = asyncio.run(_serve(daemon.url, "import time\nprint('busy', flush=True)\n"
                              "time.sleep(600)\n", 2))
    assert r.timed_out and r.returncode != 0
    assert r.stdout.startswith("busy")
