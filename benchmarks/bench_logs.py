"""What sandbox logs cost a command (exec round trip with the log store on vs off), and
what keeping a stopped sandbox's files costs its stop (stop, files copied out, vs delete).

Run as root::

    python3 benchmarks/bench_logs.py            # ~20 s
    python3 benchmarks/bench_logs.py --n 2000

One engine, one sandbox, ``/bin/true`` run back to back through ``Engine.exec``; the
store (:class:`corral.runtime.sandbox_logs.SandboxLogs`, its writer flushing to SQLite
in a thread) is attached and detached in alternating blocks, so drift on a busy machine
hits both sides alike. Prints the medians, p90s and their ratio (on / off).

Then pairs of sandboxes that each wrote 20 files of 10 kB: one is stopped (its writable
layer copied out, :mod:`corral.runtime.kept_files`), the other deleted (nothing kept);
the medians of both and their ratio.
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

BLOCK = 50


async def main(n: int, pairs: int) -> dict[str, float]:
    from corral.runtime.engine import Engine
    from corral.runtime.sandbox_logs import SandboxLogs

    state = Path(tempfile.mkdtemp(prefix="corral-bench-logs-"))
    state.chmod(0o711)
    engine = await Engine.open(state / "state")
    logs = SandboxLogs(state / "logs.db")
    try:
        sid = (await engine.create()).id
        for _ in range(20):  # warm up
            await engine.exec(sid, ["/bin/true"])
        times: dict[bool, list[float]] = {False: [], True: []}
        on = False
        block_len = min(BLOCK, n)
        for block in range(2 * max(1, n // block_len)):
            on = block % 2 == 1
            if on:
                logs.attach(engine.events)
            for _ in range(block_len):
                t0 = time.perf_counter()
                await engine.exec(sid, ["/bin/true"])
                times[on].append((time.perf_counter() - t0) * 1000)
            if on:
                logs.detach()
        await asyncio.sleep(0.5)  # let the writer finish
        stats = logs.stats()
        off_ms, on_ms = statistics.median(times[False]), statistics.median(times[True])
        p90 = {k: statistics.quantiles(v, n=10)[-1] for k, v in times.items()}
        print(f"exec /bin/true round trip, {len(times[True])} runs each, median (p90):")
        print(f"  logs off  {off_ms:.3f} ms ({p90[False]:.3f})")
        print(f"  logs on   {on_ms:.3f} ms ({p90[True]:.3f})")
        print(f"  ratio on/off  {on_ms / off_ms:.3f}   (p90 {p90[True] / p90[False]:.3f})")
        print(f"  store: {stats['rows']} rows kept, {stats['bytes']} bytes, "
              f"{stats['dropped']} dropped")
        await engine.delete(sid)
        stop_ms, delete_ms = await stop_vs_delete(engine, pairs)
        return {"logs_off_exec_ms_p50": off_ms, "logs_on_exec_ms_p50": on_ms,
                "logs_exec_ratio": on_ms / off_ms, "stop_kept_ms_p50": stop_ms,
                "delete_ms_p50": delete_ms, "stop_delete_ratio": stop_ms / delete_ms}
    finally:
        await logs.close()
        await engine.close()
        shutil.rmtree(state, ignore_errors=True)


async def stop_vs_delete(engine, pairs: int) -> tuple[float, float]:  # type: ignore[no-untyped-def]
    write = ("mkdir -p /workspace/o; for i in $(seq 20); do "
             "head -c 10000 /dev/urandom > /workspace/o/$i; done")
    stops: list[float] = []
    deletes: list[float] = []
    for _ in range(pairs):
        kept, gone = (await engine.create()).id, (await engine.create()).id
        for sid in (kept, gone):
            await engine.exec(sid, ["sh", "-c", write])
        t0 = time.perf_counter()
        await engine.stop(kept)
        stops.append((time.perf_counter() - t0) * 1000)
        t0 = time.perf_counter()
        await engine.delete(gone)
        deletes.append((time.perf_counter() - t0) * 1000)
        await engine.delete(kept)
    s, d = statistics.median(stops), statistics.median(deletes)
    print(f"end of a sandbox with 200 kB of files, {pairs} each, median:")
    print(f"  stop (files kept) {s:.1f} ms   delete {d:.1f} ms   ratio {s / d:.2f}")
    return s, d


if __name__ == "__main__":
    parser = bench_args.parser(__doc__)
    parser.add_argument("--n", type=int, help="commands on each side (default 1000)")
    args = parser.parse_args()
    n = args.n or bench_args.pick(args, 1000, 200, 4)
    res = asyncio.run(main(n, bench_args.pick(args, 10, 5, 1)))
    if args.json:
        args.json.write_text(json.dumps(res, indent=2) + "\n")
