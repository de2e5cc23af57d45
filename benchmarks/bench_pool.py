"""Warm-pool acquire through the SDK and the daemon, against creating a sandbox.

    python3 benchmarks/bench_pool.py [--quick] [--json OUT]

Starts a private daemon (``python -m corral.server``) on a temporary socket and state
directory. Times, with the blocking SDK:

- ``create_ready_ms``: ``Sandbox.create`` until the sandbox can run commands (then
  deleted, untimed): what an episode waits for without a pool;
- ``pool_acquire_ms``: ``pool.acquire()`` of a ready sandbox, the pool kept full (before
  each acquire the pool is refilled to ``min_ready``, and the sandbox is deleted after,
  both untimed), and the part of it spent in the daemon (``pool_acquire_daemon_ms``,
  liveness check included). Waiting for the refill leaves the daemon idle for a moment
  before each acquire, so compare it with ``sdk_health_after_idle_ms``;
- ``pool_acquire_reserve_ms``: the same one-at-a-time acquires from a pool with a client
  reserve (``reserve=MIN_READY``): the SDK takes ``MIN_READY`` sandboxes in one call and
  hands them out locally; every ``MIN_READY``-th acquire pays the round trip;
- ``pool_acquire_burst_ms``: acquires back to back (a training step's fan-out), 50 at a
  time from a pool of 50 ready, while the pool refills in the background;
- ``sdk_health_rtt_ms``: ``GET /v1/health`` back to back, the floor of any SDK call;
  ``sdk_health_after_idle_ms`` the same after 50 ms idle.

Needs root. Target (issue: performance): pool acquire through the SDK p50 ≤ 0.5 ms.
"""

from __future__ import annotations

import json
import os
import statistics
import sys
import time
from pathlib import Path

import corral

sys.path.insert(0, str(Path(__file__).resolve().parent))
import bench_args  # noqa: E402  (a sibling script, not a package)
from bench_sdk import pct, private_daemon  # noqa: E402  (a sibling script, not a package)

SPEC = {"image": "python", "memory_mb": 128}
MIN_READY = 8
BURST = 50
IDLE_S = 0.05  # the gap before each "after idle" sample: wait_ready's poll interval


def timed_creates(client: corral.Client, n: int) -> list[float]:
    out = []
    for _ in range(n):
        t = time.perf_counter()
        sb = corral.Sandbox.create(**SPEC, client=client)
        out.append((time.perf_counter() - t) * 1000)
        sb.delete()
    return out


def timed(fn, n: int, *, idle: float = 0.0) -> list[float]:
    out = []
    for _ in range(n):
        time.sleep(idle)
        t = time.perf_counter()
        fn()
        out.append((time.perf_counter() - t) * 1000)
    return out


def timed_acquires(pool: corral.Pool, n: int) -> list[float]:
    out = []
    for _ in range(n):
        pool.wait_ready()  # kept full: every acquire finds MIN_READY ready
        t = time.perf_counter()
        sb = pool.acquire(timeout=30)
        out.append((time.perf_counter() - t) * 1000)
        sb.delete()
    return out


def timed_bursts(pool: corral.Pool, n: int) -> list[float]:
    out: list[float] = []
    while len(out) < n:
        pool.wait_ready()
        held = []
        for _ in range(BURST):
            t = time.perf_counter()
            held.append(pool.acquire(timeout=30))
            out.append((time.perf_counter() - t) * 1000)
        for sb in held:
            sb.delete()
    return out


def main() -> int:
    ap = bench_args.parser(__doc__)
    args = ap.parse_args()
    if os.geteuid() != 0:
        print("needs root (the daemon runs real sandboxes)")
        return 1
    n = bench_args.pick(args, 200, 50, 4)
    with private_daemon("corral-bench-pool-") as url:
        with corral.Client(url) as client:
            client.health()  # warm the connection
            health = timed(client.health, n)
            health_idle = timed(client.health, n, idle=IDLE_S)
            creates = timed_creates(client, max(20, n // 4))
            with corral.Pool(**SPEC, min_ready=MIN_READY, max_size=64, client=client) as pool:
                timed_acquires(pool, 5)  # warm up
                acquires = timed_acquires(pool, n)
                stats = pool.stats()
            with corral.Pool(**SPEC, min_ready=MIN_READY, max_size=64, reserve=MIN_READY,
                             client=client) as pool:
                timed_acquires(pool, 5)
                reserved = timed_acquires(pool, n)
            with corral.Pool(**SPEC, min_ready=BURST, max_size=2 * BURST, client=client) as pool:
                bursts = timed_bursts(pool, n)
        res = {
            "sdk_health_rtt_ms_p50": statistics.median(health),
            "sdk_health_after_idle_ms_p50": statistics.median(health_idle),
            "create_ready_ms_p50": statistics.median(creates),
            "pool_acquire_ms_p50": statistics.median(acquires),
            "pool_acquire_ms_p95": pct(acquires, 0.95),
            "pool_acquire_daemon_ms_p50": stats.acquire_wait_ms_p50 or 0.0,
            "pool_acquire_reserve_ms_p50": statistics.median(reserved),
            "pool_acquire_reserve_ms_p95": pct(reserved, 0.95),
            "pool_acquire_burst_ms_p50": statistics.median(bursts),
            "pool_acquire_burst_ms_p95": pct(bursts, 0.95),
        }
    print(f"{n} acquires one at a time (pool kept at {MIN_READY} ready), {n} in bursts of "
          f"{BURST}; {len(creates)} creates")
    print(f"{'figure':30} {'value':>8}  {'target':>9}  vs create")
    targets = {"pool_acquire_ms_p50": 0.5, "pool_acquire_reserve_ms_p50": 0.5}
    for key, value in res.items():
        target = f"<= {targets[key]} ms" if key in targets else ""
        ratio = value / res["create_ready_ms_p50"]
        print(f"{key:30} {value:8.2f}  {target:>9}  {ratio:7.3f}x")
    if args.json:
        args.json.write_text(json.dumps(res, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
