"""The agent built against musl vs glibc: one process, the same engine code, both builds.

    python3 benchmarks/bench_agent_libc.py [--quick | --smoke] [--json OUT]

The agent binary is also the sandbox's launcher, so a create starts it twice (the
warm slot's launcher, then the agent inside the sandbox). A static glibc start probes
the CPU (dozens of ``CPUID`` instructions, each a VM exit where the hypervisor traps
them); musl's does not (``corral.runtime.agentbuild``). Two engines are opened in
this process, one per build (``CORRAL_AGENT_LIBC``), and measured in alternating
blocks, so a change of the host's load hits both:

- ``*_start_ms_p50``   spawn -> exit of ``corral-agent launch -- /bin/true`` (the
                       launcher's start and exec; ``bare_true_ms_p50`` is the floor)
- ``*_ready_ms_p50``   ``Engine.create`` -> ready
- ``*_cycle_ms_p50``   create -> exec ``true`` -> delete
- ``*_children_cpu_ms`` CPU of the reaped children per cycle (launcher, bwrap, agent,
                       ``true``): mean of the blocks

Needs root and ``musl-gcc`` (Debian's ``musl-tools``); without it, says so.
"""

from __future__ import annotations

import asyncio
import json
import os
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path

import bench_args  # noqa: E402  (a sibling script, not a package)
from bench_engine import bare_exec, timed_ms

LIBCS = ("glibc", "musl")


async def measure(rounds: int, block: int, starts: int) -> dict[str, float | None]:
    from corral.runtime import agentbuild
    from corral.runtime.engine import Engine

    engines: dict[str, tuple[Engine, Path]] = {}
    res: dict[str, dict[str, list[float]]] = {
        k: {"start": [], "ready": [], "cycle": [], "cpu": []} for k in LIBCS}
    try:
        for libc in LIBCS:
            os.environ["CORRAL_AGENT_LIBC"] = libc  # read when the engine builds its agent
            state = Path(tempfile.mkdtemp(prefix=f"corral-bench-libc-{libc}-"))
            os.chmod(state, 0o711)
            engines[libc] = (await Engine.open(state), state)
        os.environ.pop("CORRAL_AGENT_LIBC")
        found = agentbuild.compiler("musl")
        if found is None or found[1] is not agentbuild.MUSL_CFLAGS:
            return {"musl_gcc": 0.0}
        for engine, _ in engines.values():
            for _ in range(2):
                info = await engine.create()
                await engine.delete(info.id)
        for r in range(rounds):
            for libc in LIBCS if r % 2 == 0 else LIBCS[::-1]:
                engine = engines[libc][0]
                launch = [str(engine.agent_path), "launch", "--nofile", "1024", "--", "/bin/true"]
                res[libc]["start"] += timed_ms(lambda argv=launch: bare_exec(argv), starts,
                                               warmup=1)
                c0 = os.times()
                for _ in range(block):
                    t0 = time.perf_counter()
                    info = await engine.create()
                    t1 = time.perf_counter()
                    await engine.exec(info.id, ["true"])
                    await engine.delete(info.id)
                    res[libc]["ready"].append((t1 - t0) * 1e3)
                    res[libc]["cycle"].append((time.perf_counter() - t0) * 1e3)
                await engine.reclaimed()  # every child reaped before the CPU is read
                c1 = os.times()
                res[libc]["cpu"].append((c1.children_user + c1.children_system
                                         - c0.children_user - c0.children_system) / block * 1e3)
    finally:
        for engine, state in engines.values():
            await engine.close()
            shutil.rmtree(state, ignore_errors=True)
    fig: dict[str, float | None] = {
        "musl_gcc": 1.0,
        "bare_true_ms_p50": statistics.median(timed_ms(lambda: bare_exec(["/bin/true"]), starts)),
    }
    for libc, d in res.items():
        fig[f"{libc}_start_ms_p50"] = statistics.median(d["start"])
        fig[f"{libc}_ready_ms_p50"] = statistics.median(d["ready"])
        fig[f"{libc}_cycle_ms_p50"] = statistics.median(d["cycle"])
        fig[f"{libc}_children_cpu_ms"] = statistics.mean(d["cpu"])
    for what in ("start_ms_p50", "ready_ms_p50", "cycle_ms_p50", "children_cpu_ms"):
        fig[f"musl_vs_glibc_{what}"] = fig[f"musl_{what}"] / fig[f"glibc_{what}"]
    return fig


def main() -> int:
    args = bench_args.parser(__doc__).parse_args()
    if os.geteuid() != 0:
        print("needs root (the engine runs real sandboxes)")
        return 1
    rounds = bench_args.pick(args, 12, 6, 2)
    block = bench_args.pick(args, 10, 5, 1)
    starts = bench_args.pick(args, 100, 30, 3)
    fig = asyncio.run(measure(rounds, block, starts))
    if not fig.get("musl_gcc"):
        print("no musl-gcc here (Debian's musl-tools): the agent is built against glibc")
    for key, value in fig.items():
        print(f"{key:34} {value:10.3f}")
    fig["loadavg"] = os.getloadavg()[0]
    print(f"load average {fig['loadavg']:.1f}")
    if args.json:
        args.json.write_text(json.dumps(fig, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
