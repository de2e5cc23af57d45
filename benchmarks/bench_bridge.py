"""The sync/async bridge (one anyio blocking portal) against what it replaced.

    python3 benchmarks/bench_bridge.py [--quick] [--json OUT]

Measured in one run, medians in ms:

- a blocking exec round trip ``sb.exec(["true"])`` through a private daemon (the
  floor), the same call as ``sb.exec_future(...).result()`` (the portal's worker
  threads) and as ``ThreadPoolExecutor.submit(sb.exec, ...).result()`` (the shared
  pool the futures used before);
- crossing into asyncio with nothing to do: :func:`corral._bridge.run_sync` on the
  portal against ``asyncio.run`` (what ``run_sync`` did outside a loop before).
Needs root (the daemon runs real sandboxes).
"""

from __future__ import annotations

import asyncio
import json
import os
import statistics
import sys
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import bench_args  # noqa: E402  (a sibling script, not a package)
from bench_sdk import private_daemon, timed  # noqa: E402

import corral  # noqa: E402
from corral._bridge import run_sync  # noqa: E402


async def nothing() -> None:
    await asyncio.sleep(0)


def main() -> int:
    ap = bench_args.parser(__doc__)
    args = ap.parse_args()
    if os.geteuid() != 0:
        print("needs root (the daemon runs real sandboxes)")
        return 1
    n = bench_args.pick(args, 400, 100, 8)
    res: dict[str, float] = {}
    with private_daemon("corral-bench-bridge-") as url, corral.Client(url) as client:
        with corral.Sandbox.create(memory_mb=128, client=client) as sb, ThreadPoolExecutor(64) as pool:
            sb.exec(["true"])
            sb.exec_future(["true"]).result()
            pool.submit(sb.exec, ["true"]).result()
            rounds: dict[str, list[float]] = {"direct": [], "portal": [], "pool": []}
            for _ in range(4):  # interleaved, so drift hits all three alike
                rounds["direct"] += timed(lambda: sb.exec(["true"]), n // 4)
                rounds["portal"] += timed(lambda: sb.exec_future(["true"]).result(), n // 4)
                rounds["pool"] += timed(lambda: pool.submit(sb.exec, ["true"]).result(), n // 4)
    run_sync(nothing())
    res = {
        "exec_direct_ms_p50": statistics.median(rounds["direct"]),
        "exec_future_portal_ms_p50": statistics.median(rounds["portal"]),
        "exec_future_threadpool_ms_p50": statistics.median(rounds["pool"]),
        "run_sync_portal_ms_p50": statistics.median(timed(lambda: run_sync(nothing()), n)),
        "asyncio_run_ms_p50": statistics.median(timed(lambda: asyncio.run(nothing()), n)),
    }
    res["exec_future_portal_vs_threadpool"] = res["exec_future_portal_ms_p50"] / res["exec_future_threadpool_ms_p50"]
    res["run_sync_portal_vs_asyncio_run"] = res["run_sync_portal_ms_p50"] / res["asyncio_run_ms_p50"]
    for key, value in res.items():
        print(f"{key:36} {value:8.3f}")
    if args.json:
        args.json.write_text(json.dumps(res, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
