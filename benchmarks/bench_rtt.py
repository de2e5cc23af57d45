"""SDK round trips (health, exec, pool acquire) of this tree against a baseline tree's.

    python3 benchmarks/bench_rtt.py [--quick] [--smoke] [--json OUT] [--baseline REF]

Each tree gets a private daemon of its own code (``bench_sdk.private_daemon``, its
``src`` first on ``PYTHONPATH``); then, in rounds alternated between the trees, a probe
process of that tree's SDK measures, on its daemon:

- ``health``: ``client.health()`` back to back, the floor of any call;
  ``health_idle``: the same after 50 ms idle (what a call after a pause costs);
- ``exec`` / ``async_exec``: ``exec(["true"])`` on one sandbox, blocking and asyncio SDK
  in alternated chunks, next to ``bare``: ``subprocess.run(["/bin/true"])`` in the same
  probe (the target: exec ≤ 1.5× bare; async ≤ sync);
- ``acquire``: ``pool.acquire()`` back to back from a pool whose ``max_size`` is its
  ``min_ready`` (no refill in the window); ``acquire_idle``: the same, each 50 ms
  after the last (``bench_pool.py``'s one-at-a-time figure). Target ≤ 0.5 ms p50.

Also the probe's CPU per call (``time.process_time``). Medians over every sample of a
tree; with ``--baseline``, the ratios current/baseline. The host's load is printed.
Needs root.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import bench_args  # noqa: E402  (a sibling script, not a package)
from bench_cpu import _tree, tree_daemons  # noqa: E402  (a sibling script, not a package)

HERE = Path(__file__).resolve().parent
IDLE_S = 0.05


def _timed(fn, n: int, idle: float = 0.0) -> tuple[list[float], float]:
    out, cpu = [], 0.0
    for _ in range(n):
        if idle:
            time.sleep(idle)
        c, t = time.process_time(), time.perf_counter()
        fn()
        out.append((time.perf_counter() - t) * 1000)
        cpu += time.process_time() - c
    return out, cpu / n * 1000


CHUNKS = 6


def exec_both(sb, url: str, n: int, put) -> None:
    """``exec`` and ``async_exec`` on the same sandbox, in alternated chunks (the async
    figure was once taken after the pool's rows, while the daemon tore the pool down:
    1.5x the sync one for that alone)."""
    import corral

    loop = asyncio.new_event_loop()
    ac = corral.AsyncClient(url)
    try:
        asb = loop.run_until_complete(corral.AsyncSandbox.connect(sb.id, client=ac))
        loop.run_until_complete(asb.exec(["true"]))

        async def chunk(k: int) -> tuple[list[float], float]:
            out, cpu = [], 0.0
            for _ in range(k):
                c, t = time.process_time(), time.perf_counter()
                await asb.exec(["true"])
                out.append((time.perf_counter() - t) * 1000)
                cpu += time.process_time() - c
            return out, cpu

        got: dict[str, tuple[list[float], float]] = {"exec": ([], 0.0), "async_exec": ([], 0.0)}
        k = max(1, n // CHUNKS)
        for _ in range(CHUNKS):
            out, cpu = _timed(lambda: sb.exec(["true"]), k)
            got["exec"] = (got["exec"][0] + out, got["exec"][1] + cpu * k / 1000)
            out, cpu = loop.run_until_complete(chunk(k))
            got["async_exec"] = (got["async_exec"][0] + out, got["async_exec"][1] + cpu)
        for key, (out, cpu) in got.items():  # cpu: seconds in all
            put(key, (out, cpu / len(out) * 1000))
    finally:
        loop.run_until_complete(ac.aclose())
        loop.close()


def probe(url: str, n: int, grab: int) -> dict[str, object]:
    """One round with this process's SDK: samples (ms) and CPU per call (ms)."""
    import corral

    res: dict[str, object] = {}

    def put(key: str, got: tuple[list[float], float]) -> None:
        res[key], res[key + "_cpu"] = got

    with corral.Client(url) as client:
        client.health()
        put("health", _timed(client.health, n))
        put("health_idle", _timed(client.health, max(2, n // 10), IDLE_S))
        put("bare", _timed(lambda: subprocess.run(["/bin/true"]), n))
        with corral.Sandbox.create(memory_mb=128, client=client) as sb:
            sb.exec(["true"])
            exec_both(sb, url, n, put)
        with corral.Pool(image="python", memory_mb=128, min_ready=grab, max_size=grab,
                         client=client) as pool:
            held: list[corral.Sandbox] = []
            for key, idle in (("acquire", 0.0), ("acquire_idle", IDLE_S)):
                pool.wait_ready(timeout=300)
                time.sleep(0.2)  # the last refill's teardown and bookkeeping done
                put(key, _timed(lambda: held.append(pool.acquire(timeout=30)), grab, idle))
                for s in held:
                    s.delete()
                held.clear()

    return res


def _probe_in(src: Path, url: str, n: int, grab: int) -> dict[str, object]:
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(src), str(HERE)])}
    proc = subprocess.run([sys.executable, __file__, "--probe", url, str(n), str(grab)],
                          env=env, capture_output=True, text=True, timeout=900)
    if proc.returncode != 0:
        raise SystemExit(f"a probe failed:\n{proc.stdout[-2000:]}\n{proc.stderr[-2000:]}")
    return json.loads(proc.stdout.strip().splitlines()[-1])


def measure(trees: dict[str, Path], rounds: int, n: int, grab: int) -> dict[str, float]:
    samples: dict[str, dict[str, list[float]]] = {name: {} for name in trees}
    with contextlib.ExitStack() as stack:
        urls = tree_daemons(stack, trees, "corral-bench-rtt-")  # each runs its tree's code
        for i in range(rounds):
            order = list(trees) if i % 2 == 0 else list(reversed(trees))  # ABBA
            for name in order:
                for key, value in _probe_in(trees[name], urls[name], n, grab).items():
                    got = samples[name].setdefault(key, [])
                    got.extend(value if isinstance(value, list) else [value])
    res: dict[str, float] = {}
    for name, figures in samples.items():
        for key, values in figures.items():
            res[f"{name}_{key}_ms_p50"] = statistics.median(values)
    return res


def main() -> int:
    if len(sys.argv) == 5 and sys.argv[1] == "--probe":
        print(json.dumps(probe(sys.argv[2], int(sys.argv[3]), int(sys.argv[4]))))
        return 0
    ap = bench_args.parser(__doc__)
    ap.add_argument("--baseline", metavar="REF", help="also measure git ref REF, alternated")
    args = ap.parse_args()
    if os.geteuid() != 0:
        print("needs root (the daemon runs real sandboxes)")
        return 1
    rounds, n, grab = bench_args.pick(args, (8, 300, 8), (4, 150, 8), (1, 3, 2))
    trees = {"current": HERE.parent / "src"}
    load = [os.getloadavg()[0]]
    with tempfile.TemporaryDirectory(prefix="corral-bench-rtt-") as tmp:
        try:
            if args.baseline:
                trees["baseline"] = _tree(args.baseline, Path(tmp) / "baseline")
            res = measure(trees, rounds, n, grab)
        finally:
            if args.baseline:
                subprocess.run(["git", "-C", str(HERE.parent), "worktree", "remove", "--force",
                                str(Path(tmp) / "baseline")], check=False)
    load.append(os.getloadavg()[0])
    res["load_1min_start"], res["load_1min_end"] = load
    keys = sorted({k.split("_", 1)[1] for k in res if k.startswith("current_")})
    print(f"{'figure (p50, ms)':28} {'current':>9}" + (f" {'baseline':>9} {'ratio':>6}"
                                                      if args.baseline else ""))
    for key in keys:
        line = f"{key:28} {res['current_' + key]:9.3f}"
        if args.baseline:
            base = res["baseline_" + key]
            res["ratio_" + key] = res["current_" + key] / base
            line += f" {base:9.3f} {res['ratio_' + key]:6.2f}"
        print(line)
    for name in trees:
        bare = res[f"{name}_bare_ms_p50"]
        print(f"{name}: exec / bare fork+exec {res[f'{name}_exec_ms_p50'] / bare:.2f}x "
              f"(target <= 1.5x), async / sync exec "
              f"{res[f'{name}_async_exec_ms_p50'] / res[f'{name}_exec_ms_p50']:.2f} (target <= 1)")
    print(f"load {load[0]:.1f} -> {load[1]:.1f}")
    if args.json:
        args.json.write_text(json.dumps(res, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
