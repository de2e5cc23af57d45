"""Run 50 short programs, one warm sandbox each, and print results as they arrive.

A warm pool keeps sandboxes started ahead of time, so an episode does not wait for
one to boot: ``pool.acquire()`` hands out a live sandbox, the ``with`` block deletes
it afterwards (never reused: nothing leaks between episodes), and the daemon starts
a replacement in the background.

    python examples/pool_fanout.py                   # 50 tasks, the local daemon
    python examples/pool_fanout.py --count 200 --parallel 32 --min-ready 16
    python examples/pool_fanout.py --url unix:///tmp/corral.sock

Without ``--url`` (or ``CORRAL_URL``) the SDK uses the local daemon, starting it if
nothing answers. The pool and its ready sandboxes are deleted at the end.
"""

from __future__ import annotations

import argparse
import os
import statistics
import time
from dataclasses import dataclass

import corral

# Each task: "is n prime?", computed in the sandbox by a program the "model" wrote.
PROGRAM = """
import sys
n = int(sys.argv[1])
print(n > 1 and all(n % d for d in range(2, int(n ** 0.5) + 1)))
"""


@dataclass
class Outcome:
    task: int
    sandbox: str
    answer: str
    acquire_ms: float
    run_ms: float


def run_one(pool: corral.Pool, task: int) -> Outcome:
    """One episode: a fresh sandbox from the pool, one program, then it is deleted."""
    t0 = time.perf_counter()
    with pool.acquire(timeout=120) as sb:
        t1 = time.perf_counter()
        r = sb.exec(["python3", "-c", PROGRAM, str(task)], timeout=10, check=True)
        t2 = time.perf_counter()
    return Outcome(task, sb.id, r.stdout.strip(), (t1 - t0) * 1000, (t2 - t1) * 1000)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--count", type=int, default=50, help="tasks to run (default 50)")
    parser.add_argument("--parallel", type=int, default=16, help="tasks at once (default 16)")
    parser.add_argument("--min-ready", type=int, default=8, help="sandboxes kept ready (default 8)")
    parser.add_argument("--max-size", type=int, default=32, help="pool size cap (default 32)")
    parser.add_argument("--url", help="the daemon (default: CORRAL_URL, else the local one)")
    args = parser.parse_args()
    # The SDK's shared thread pool runs corral.submit calls; its size is read on first use.
    os.environ["CORRAL_MAX_WORKERS"] = str(args.parallel)

    errors = 0
    outcomes: list[Outcome] = []
    with corral.Client(args.url) as client, corral.Pool(
        image="python", memory_mb=128, timeout=600, min_ready=args.min_ready,
        max_size=args.max_size, client=client,
    ) as pool:
        print(f"pool {pool.name} on {client.url}: {args.min_ready} ready, at most {args.max_size}")
        pool.wait_ready()  # warm up first, as a training job would before its first step
        start = time.perf_counter()
        handles = [corral.submit(run_one, pool, task) for task in range(args.count)]
        for h in corral.as_completed(handles):
            try:
                o = h.result()
            except corral.CorralError as exc:
                errors += 1
                print(f"error: {exc}")
                continue
            outcomes.append(o)
            print(f"task {o.task:3d} prime={o.answer:5} in {o.sandbox}  "
                  f"acquire {o.acquire_ms:6.1f} ms  run {o.run_ms:6.1f} ms", flush=True)
        elapsed = time.perf_counter() - start
        stats = pool.stats()

    sandboxes = {o.sandbox for o in outcomes}
    print(f"{len(outcomes)} tasks in {elapsed:.2f} s, {errors} errors, "
          f"{len(sandboxes)} distinct sandboxes")
    if outcomes:
        print(f"acquire p50 {statistics.median(o.acquire_ms for o in outcomes):.1f} ms, "
              f"run p50 {statistics.median(o.run_ms for o in outcomes):.1f} ms (SDK side)")
    print(f"pool: created {stats.created}, discarded {stats.discarded}, "
          f"daemon-side acquire wait p50 {stats.acquire_wait_ms_p50 or 0:.2f} ms")
    return 1 if errors else 0


if __name__ == "__main__":
    raise SystemExit(main())
