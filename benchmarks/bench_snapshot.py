"""Snapshot commit and restore, against plain copies and plain creates in the same run.

    python3 benchmarks/bench_snapshot.py [--quick] [--json OUT]

- ``snapshot_commit_ms``: ``engine.snapshot`` of a sandbox whose writable layer holds a
  fresh 50 MB file (median of 5); baseline: copying the same 50 MB file on the host
  with ``cp`` into the state directory's filesystem, plus ``sync``. Beside it, alternating:
  ``commit_hash_at_seal_ms``, the same commit with large files hashed only after the copy
  (``LayerStore.stream_hash`` False, the way before; the default hashes behind the copy
  when a CPU is spare); ``snapshot_frozen_ms`` /
  ``frozen_hash_at_seal_ms``: how long the sandbox stayed frozen (issue 30: commit
  <= 0.8x the copy, frozen <= 10 ms).
- ``restore_100_s``: 100 sandboxes created concurrently from that snapshot; baseline:
  100 plain creates, same concurrency. Targets (issue: snapshots): commit ≤ 100 ms,
  100 restores ≤ 1 s. Needs root.
"""

from __future__ import annotations

import asyncio
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import bench_args  # noqa: E402  (a sibling script, not a package)

from corral.runtime.engine import Engine

MB = 1 << 20


async def commit_times(engine: Engine, rounds: int) -> dict[str, list[float]]:
    """Commits as by default (``default``: large files hashed behind their copy when
    a CPU is spare, :mod:`corral.runtime.streamhash`) and with them hashed only at seal
    (``at_seal``: the earlier way), alternating; each with the time the sandbox stayed
    frozen. ``bench_layer_hash.py`` measures the hashing's two ways without a sandbox."""
    out: dict[str, list[float]] = {}
    store = engine.snapshots.store
    try:
        for i in range(rounds):
            for way, streamed in (("at_seal", False), ("default", None)):
                store.stream_hash = streamed
                sb = await engine.create(memory_mb=256, disk_mb=256)
                r = await engine.exec(
                    sb.id, f"head -c {50 * MB} /dev/urandom > /workspace/data-{i}.bin"
                )
                assert r.returncode == 0, r.stderr
                t = time.perf_counter()
                snap = await engine.snapshot(sb.id)
                out.setdefault(way, []).append((time.perf_counter() - t) * 1000)
                out.setdefault(f"{way}_frozen", []).append(engine.snapshots.last_frozen_s * 1000)
                await engine.delete(sb.id)
                await engine.delete_snapshot(snap.id)
    finally:
        store.stream_hash = None
    await engine.gc_layers()
    return out


def copy_baseline(state_dir: Path, rounds: int) -> list[float]:
    src = Path(tempfile.mkdtemp(prefix="corral-bench-src-", dir="/dev/shm"))
    dst = state_dir / "copy-baseline"
    (src / "f").write_bytes(os.urandom(50 * MB))
    out = []
    try:
        for _ in range(rounds):
            t = time.perf_counter()
            subprocess.run(["cp", "-a", str(src), str(dst)], check=True)
            os.sync()
            out.append((time.perf_counter() - t) * 1000)
            shutil.rmtree(dst)
    finally:
        shutil.rmtree(src, ignore_errors=True)
    return out


async def creates(engine: Engine, n: int, **spec) -> float:
    t = time.perf_counter()
    infos = await asyncio.gather(*(engine.create(memory_mb=128, **spec) for _ in range(n)))
    elapsed = time.perf_counter() - t
    await asyncio.gather(*(engine.delete(i.id) for i in infos))
    return elapsed


async def run(sizes: tuple[int, int]) -> dict[str, float]:
    state = Path(tempfile.mkdtemp(prefix="corral-bench-snap-"))
    os.chmod(state, 0o711)
    rounds, n = sizes
    engine = await Engine.open(state)
    try:
        commits = await commit_times(engine, rounds)
        base = await engine.create(memory_mb=128)
        await engine.exec(base.id, "echo ready > /workspace/env.txt")
        snap = await engine.snapshot(base.id)
        await engine.delete(base.id)
        restore = await creates(engine, n, snapshot=snap.id)
        plain = await creates(engine, n)
        await engine.delete_snapshot(snap.id)
    finally:
        await engine.close()
    copies = copy_baseline(state, rounds)
    shutil.rmtree(state, ignore_errors=True)
    scale = 100 / n
    return {
        "snapshot_commit_ms": statistics.median(commits["default"]),
        "snapshot_frozen_ms": statistics.median(commits["default_frozen"]),
        "commit_hash_at_seal_ms": statistics.median(commits["at_seal"]),
        "frozen_hash_at_seal_ms": statistics.median(commits["at_seal_frozen"]),
        "load_1min": os.getloadavg()[0],
        "copy_50mb_ms": statistics.median(copies),
        "restore_100_s": restore * scale,
        "plain_create_100_s": plain * scale,
        "restores": n,
    }


def main() -> int:
    ap = bench_args.parser(__doc__)
    args = ap.parse_args()
    if os.geteuid() != 0:
        print("needs root (real sandboxes)")
        return 1
    res = asyncio.run(run(bench_args.pick(args, (5, 100), (3, 30), (1, 3))))
    rows = [
        ("snapshot_commit_ms", "<= 0.8x", "copy_50mb_ms", "cp -a + sync of 50 MB"),
        ("commit_hash_at_seal_ms", "", "copy_50mb_ms", "cp -a + sync of 50 MB"),
        ("snapshot_frozen_ms", "<= 10 ms", "frozen_hash_at_seal_ms", "frozen, hashed at seal"),
        ("restore_100_s", "<= 1 s", "plain_create_100_s", "100 plain creates"),
    ]
    print(f"{'figure':22} {'value':>9}  {'target':>9}  baseline (same run)")
    for key, target, base, what in rows:
        print(f"{key:22} {res[key]:9.3f}  {target:>9}  {what}: {res[base]:.3f} "
              f"({res[key] / res[base]:.2f}x)")
    print(f"load (1 min) at the end: {res['load_1min']:.2f}")
    if args.quick or args.smoke:
        print("note: quick run: restore_100_s is scaled from fewer restores")
    if args.json:
        args.json.write_text(json.dumps(res, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
