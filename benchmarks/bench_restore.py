"""What live restore costs (docs/restart.md), and how long a restart takes.

Run as root::

    python3 benchmarks/bench_restore.py            # ~1 min
    python3 benchmarks/bench_restore.py --n 200 --sandboxes 100
    python3 benchmarks/bench_restore.py --quick --json out.json

1. The sandbox lifecycle with live restore on vs off: create, one ``/bin/true``, delete,
   on two engines opened side by side (``restore_grace`` 60 vs 0: with it on, each
   sandbox's reattach socket and log pipe go to the warden at create and come back at
   delete), in alternating blocks so drift hits both alike. Medians and their ratio.
2. A restart with ``--sandboxes`` running: the engine closes with ``handover`` and a new
   one opens on the state directory, adopting every sandbox (each answers an exec
   after). The median of a few rounds, next to the open of an engine with none (the
   baseline: what any restart costs).
"""

from __future__ import annotations

import asyncio
import json
import shutil
import statistics
import tempfile
import time
from pathlib import Path

import bench_args  # a sibling script, not a package

BLOCK = 10


async def lifecycle(n: int) -> dict[str, float]:
    from corral.runtime.engine import Engine

    base = Path(tempfile.mkdtemp(prefix="corral-bench-restore-"))
    base.chmod(0o711)
    engines = {True: await Engine.open(base / "on", restore_grace=60.0),
               False: await Engine.open(base / "off", restore_grace=0.0)}
    times: dict[bool, list[float]] = {True: [], False: []}
    try:
        for block in range(2 * max(1, n // BLOCK)):
            on = block % 2 == 0
            engine = engines[on]
            for _ in range(BLOCK):
                t = time.perf_counter()
                sid = (await engine.create()).id
                await engine.exec(sid, ["/bin/true"])
                await engine.delete(sid)
                times[on].append(time.perf_counter() - t)
    finally:
        for engine in engines.values():
            await engine.close()
        shutil.rmtree(base, ignore_errors=True)
    on, off = statistics.median(times[True]), statistics.median(times[False])
    print(f"create+exec+delete, live restore on:  median {on * 1000:.1f} ms")
    print(f"create+exec+delete, live restore off: median {off * 1000:.1f} ms")
    print(f"ratio on/off: {on / off:.2f}")
    return {"lifecycle_on_ms": on * 1000, "lifecycle_off_ms": off * 1000,
            "lifecycle_ratio": on / off}


async def restart(sandboxes: int, rounds: int) -> dict[str, float]:
    from corral.runtime.engine import Engine

    base = Path(tempfile.mkdtemp(prefix="corral-bench-restore-"))
    base.chmod(0o711)
    adopt, empty = [], []
    try:
        engine = await Engine.open(base / "state", restore_grace=60.0)
        ids = [(await engine.create(memory_mb=64)).id for _ in range(sandboxes)]
        for _ in range(rounds):
            t = time.perf_counter()
            await engine.close(handover=True)
            engine = await Engine.open(base / "state", restore_grace=60.0)
            adopt.append(time.perf_counter() - t)
            for sid in ids:
                assert (await engine.exec(sid, ["/bin/true"])).returncode == 0
        await engine.close()
        for _ in range(rounds):
            t = time.perf_counter()
            engine = await Engine.open(base / "empty", restore_grace=60.0)
            empty.append(time.perf_counter() - t)
            await engine.close()
    finally:
        shutil.rmtree(base, ignore_errors=True)
    a, e = statistics.median(adopt), statistics.median(empty)
    print(f"restart adopting {sandboxes} sandboxes: median {a * 1000:.0f} ms "
          f"({a / max(sandboxes, 1) * 1000:.2f} ms a sandbox)")
    print(f"open of an engine with none:          median {e * 1000:.0f} ms")
    print(f"ratio: {a / e:.1f}")
    return {"restart_ms": a * 1000, "restart_per_sandbox_ms": a / max(sandboxes, 1) * 1000,
            "open_empty_ms": e * 1000, "restart_ratio": a / e, "sandboxes": sandboxes}


def main() -> None:
    p = bench_args.parser(__doc__)
    p.add_argument("--n", type=int, help="lifecycles per side (default 100)")
    p.add_argument("--sandboxes", type=int, help="running through a restart (default 50)")
    p.add_argument("--rounds", type=int, help="restarts (default 3)")
    args = p.parse_args()
    n = args.n or bench_args.pick(args, 100, 40, 2 * BLOCK)
    sandboxes = args.sandboxes or bench_args.pick(args, 50, 20, 2)
    rounds = args.rounds or bench_args.pick(args, 3, 2, 1)
    figures = {**asyncio.run(lifecycle(n)), **asyncio.run(restart(sandboxes, rounds))}
    if args.json:
        args.json.write_text(json.dumps(figures, indent=2) + "\n")


if __name__ == "__main__":
    main()
