"""What sandbox logs cost a command: exec round trip with the log store on vs off.

Run as root::

    python3 benchmarks/bench_logs.py            # ~20 s
    python3 benchmarks/bench_logs.py --n 2000

One engine, one sandbox, ``/bin/true`` run back to back through ``Engine.exec``; the
store (:class:`corral.runtime.sandbox_logs.SandboxLogs`, its writer flushing to SQLite
in a thread) is attached and detached in alternating blocks, so drift on a busy machine
hits both sides alike. Prints the medians, p90s and their ratio (on / off).
"""

from __future__ import annotations

import argparse
import asyncio
import shutil
import statistics
import tempfile
import time
from pathlib import Path

BLOCK = 50


async def main(n: int) -> None:
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
        for block in range(2 * max(1, n // BLOCK)):
            on = block % 2 == 1
            if on:
                logs.attach(engine.events)
            for _ in range(BLOCK):
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
    finally:
        await logs.close()
        await engine.close()
        shutil.rmtree(state, ignore_errors=True)


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--n", type=int, default=1000, help="commands on each side")
    asyncio.run(main(parser.parse_args().n))
