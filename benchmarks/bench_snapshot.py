"""Snapshot commit and restore, against plain copies and plain creates in the same run.

    python3 benchmarks/bench_snapshot.py [--quick] [--json OUT]

- ``snapshot_commit_ms``: ``engine.snapshot`` of a sandbox whose writable layer holds a
  fresh 50 MB file (median of 5), until the snapshot is listed and usable; baseline:
  copying a 50 MB file from a tmpfs (where a sandbox's writable layer is) with ``cp -a``
  into the state directory's filesystem, plus ``sync``, in turn with the commits.
  ``commit_durable_ms``: the same commit until its layer is also hashed and durable
  (it settles in the background: :mod:`corral.runtime.snapshots`; every commit here
  waits for it before the next measurement, so none runs behind another's).
  Beside it, alternating: ``commit_settle_sync_ms``, the commit hashing and syncing its
  layer before it returns (``CORRAL_SNAPSHOT_SETTLE=sync``, the way before);
  ``commit_whole_frozen_ms``: the commit before precopies, the whole layer copied frozen
  (``CORRAL_SNAPSHOT_PRECOPY=0``, :mod:`corral.runtime.precopy`, settled in the commit);
  ``snapshot_frozen_ms`` / ``frozen_settle_sync_ms`` / ``frozen_whole_ms``: how long
  the sandbox stayed frozen in each (issue 30: commit <= 0.8x the copy, frozen <= 10 ms).
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

from corral.runtime import layers, precopy
from corral.runtime.engine import Engine

MB = 1 << 20


async def commit_times(engine: Engine, rounds: int,
                       copy_src: Path | None = None) -> dict[str, list[float]]:
    """Commits as by default (``default``: a precopy, then the delta frozen, the layer
    hashed and made durable after the commit returns: ``default_durable`` until then),
    with the layer settled within the commit (``settle_sync``, the way before) and with
    the whole layer copied frozen (``whole``: before precopies), alternating; each with
    the time the sandbox stayed frozen. ``bench_layer_hash.py`` measures hashing alone."""
    out: dict[str, list[float]] = {}
    try:
        for i in range(rounds):
            for way in ("settle_sync", "whole", "default"):
                os.environ[precopy.ENV] = "0" if way == "whole" else "1"
                os.environ[layers.SETTLE_ENV] = "" if way == "default" else "sync"
                sb = await engine.create(memory_mb=256, disk_mb=256)
                r = await engine.exec(
                    sb.id, f"head -c {50 * MB} /dev/urandom > /workspace/data-{i}.bin"
                )
                assert r.returncode == 0, r.stderr
                t = time.perf_counter()
                snap = await engine.snapshot(sb.id)
                out.setdefault(way, []).append((time.perf_counter() - t) * 1000)
                await engine.snapshots.settled()  # nothing left running behind the next one
                out.setdefault(f"{way}_durable", []).append((time.perf_counter() - t) * 1000)
                out.setdefault(f"{way}_frozen", []).append(engine.snapshots.last_frozen_s * 1000)
                await engine.delete(sb.id)
                await engine.delete_snapshot(snap.id)
            if copy_src is not None:  # the baseline, in turn with them
                out.setdefault("copy", []).append(await asyncio.to_thread(
                    copy_once, copy_src, engine.layout.state_dir / "copy-baseline"))
    finally:
        os.environ.pop(precopy.ENV, None)
        os.environ.pop(layers.SETTLE_ENV, None)
    await engine.gc_layers()
    return out


def copy_once(src: Path, dst: Path) -> float:
    """``cp -a`` of ``src`` to ``dst`` plus ``sync``, in ms (``dst`` removed after)."""
    t = time.perf_counter()
    subprocess.run(["cp", "-a", str(src), str(dst)], check=True)
    os.sync()
    took = (time.perf_counter() - t) * 1000
    shutil.rmtree(dst)
    return took


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
    src = Path(tempfile.mkdtemp(prefix="corral-bench-src-", dir="/dev/shm"))
    (src / "f").write_bytes(os.urandom(50 * MB))  # from a tmpfs, as a sandbox's layer
    load_start = os.getloadavg()[0]
    try:
        commits = await commit_times(engine, rounds, src)
        base = await engine.create(memory_mb=128)
        await engine.exec(base.id, "echo ready > /workspace/env.txt")
        snap = await engine.snapshot(base.id)
        await engine.delete(base.id)
        restore = await creates(engine, n, snapshot=snap.id)
        plain = await creates(engine, n)
        await engine.delete_snapshot(snap.id)
    finally:
        await engine.close()
        shutil.rmtree(src, ignore_errors=True)
    shutil.rmtree(state, ignore_errors=True)
    scale = 100 / n
    return {
        "snapshot_commit_ms": statistics.median(commits["default"]),
        "snapshot_frozen_ms": statistics.median(commits["default_frozen"]),
        "commit_durable_ms": statistics.median(commits["default_durable"]),
        "commit_settle_sync_ms": statistics.median(commits["settle_sync"]),
        "frozen_settle_sync_ms": statistics.median(commits["settle_sync_frozen"]),
        "commit_whole_frozen_ms": statistics.median(commits["whole"]),
        "frozen_whole_ms": statistics.median(commits["whole_frozen"]),
        "load_1min": os.getloadavg()[0],
        "load_1min_start": load_start,
        "copy_50mb_ms": statistics.median(commits["copy"]),
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
        ("commit_durable_ms", "", "copy_50mb_ms", "cp -a + sync of 50 MB"),
        ("commit_settle_sync_ms", "", "copy_50mb_ms", "cp -a + sync of 50 MB"),
        ("commit_whole_frozen_ms", "", "copy_50mb_ms", "cp -a + sync of 50 MB"),
        ("snapshot_commit_ms", "", "commit_whole_frozen_ms", "whole layer frozen (before)"),
        ("snapshot_frozen_ms", "<= 10 ms", "frozen_whole_ms", "whole layer frozen (before)"),
        ("frozen_settle_sync_ms", "", "frozen_whole_ms", "whole layer frozen (before)"),
        ("restore_100_s", "<= 1 s", "plain_create_100_s", "100 plain creates"),
    ]
    print(f"{'figure':22} {'value':>9}  {'target':>9}  baseline (same run)")
    for key, target, base, what in rows:
        print(f"{key:22} {res[key]:9.3f}  {target:>9}  {what}: {res[base]:.3f} "
              f"({res[key] / res[base]:.2f}x)")
    print(f"load (1 min) at the start: {res['load_1min_start']:.2f}, "
          f"at the end: {res['load_1min']:.2f}")
    if args.quick or args.smoke:
        print("note: quick run: restore_100_s is scaled from fewer restores")
    if args.json:
        args.json.write_text(json.dumps(res, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
