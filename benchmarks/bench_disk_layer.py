"""The writable layer on disk (``storage="disk"``) against the default tmpfs.

    python3 benchmarks/bench_disk_layer.py [--quick | --smoke] [--json OUT]

On one real engine (private state directory), alternating the two kinds so load from
elsewhere hits both alike: the create time of a sandbox (``Engine.create`` until its
agent is ready), writing 64 MiB to ``/workspace`` and syncing it, and delete. Reported:
medians and the disk/memory ratio of each. Needs root. Never fails on time.
"""

from __future__ import annotations

import asyncio
import json
import os
import statistics
import tempfile
import time
from pathlib import Path

import bench_args  # noqa: E402  (a sibling script, not a package)

from corral.runtime.engine import Engine

WRITE = "head -c 67108864 /dev/zero > /workspace/f && sync /workspace/f"


async def one(engine: Engine, storage: str) -> dict[str, float]:
    t0 = time.perf_counter()
    info = await engine.create(storage=storage, memory_mb=256, disk_mb=512)
    t1 = time.perf_counter()
    r = await engine.exec(info.id, WRITE, timeout=300)
    assert r.returncode == 0, r.stderr
    t2 = time.perf_counter()
    await engine.delete(info.id)
    t3 = time.perf_counter()
    return {"create_ms": (t1 - t0) * 1e3, "write_64m_ms": (t2 - t1) * 1e3,
            "delete_ms": (t3 - t2) * 1e3}


async def main(n: int) -> dict[str, dict[str, float]]:
    engine = await Engine.open(Path(tempfile.mkdtemp(prefix="corral-bench-disk-")))
    runs: dict[str, list[dict[str, float]]] = {"memory": [], "disk": []}
    try:
        for storage in runs:  # warm-up: the agent, the slots, mkfs's pages
            await one(engine, storage)
        for _ in range(n):
            for storage in runs:
                runs[storage].append(await one(engine, storage))
    finally:
        await engine.close()
    out = {k: {m: statistics.median(r[m] for r in v) for m in v[0]} for k, v in runs.items()}
    out["ratio_disk_to_memory"] = {m: out["disk"][m] / out["memory"][m] for m in out["memory"]}
    return out


if __name__ == "__main__":
    args = bench_args.parser(__doc__).parse_args()
    if os.geteuid() != 0:
        raise SystemExit("needs root (real sandboxes)")
    result = asyncio.run(main(bench_args.pick(args, 20, 8, 1)))
    for kind, row in result.items():
        print(f"{kind:22s}", "  ".join(f"{k} {v:8.2f}" for k, v in row.items()))
    if args.json:
        args.json.write_text(json.dumps(result, indent=2))
