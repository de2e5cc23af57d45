"""A live snapshot restored on another node of a Ray cluster, against a local restore.

    python3 benchmarks/bench_live_travel.py [--quick] [--json OUT]

Starts a three-node Ray cluster on this host (as ``bench_cluster.py``) and ``corral
cluster up``; a checkpointable sandbox holding a Python process with ``HEAP_MB`` of
heap is checkpointed on the head node. Times, in the same run (medians):

- ``live_restore_local_ms``: a restore of the live snapshot on the node that took it
  (the baseline);
- ``live_restore_cross_node_first_ms``: on another node the first time (its layers
  and CRIU images fetched from the head's daemon, checked, then the restore);
- ``live_restore_cross_node_warm_ms``: on those nodes once the images are there;
- ``cross_node_fetched_mb``: what one other node fetched for its first restore
  (layers and images, ``/v1/peer/stats``).

Each restore is timed until the copy's process answers (its counter file read back).
Needs root, the ``ray`` extra and a cached CRIU. Never fails on time.
"""

from __future__ import annotations

import json
import os
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path

import bench_args  # noqa: E402  (a sibling script, not a package)
from bench_cluster import NODE_ARGS, cluster_bench_args, ms_since

import corral

HEAP_MB = 50
COUNTER = ("nohup python3 -c 'import time\nb = bytearray(range(256)) * (%d << 12)\ni = 0\n"
           "while True:\n    i += 1\n    open(\"/tmp/count\", \"w\").write(str(i))\n"
           "    time.sleep(0.05)' >/dev/null 2>&1 &") % HEAP_MB


def _counting(sb: corral.Sandbox) -> None:
    for _ in range(400):
        if sb.exec(["cat", "/tmp/count"], timeout=30).stdout.strip():
            return
        time.sleep(0.02)
    raise RuntimeError("the counter never wrote")


def _restore(snap: corral.Snapshot, node: str) -> float:
    t = time.perf_counter()
    copy = snap.restore(node=node)
    _counting(copy)
    took = ms_since(t)
    copy.delete()
    return took


def main() -> int:
    args = cluster_bench_args(__doc__)
    if args is None:
        return 1
    import ray
    from ray.cluster_utils import Cluster

    from corral.cluster import bringup
    from corral.runtime import criu
    from corral.runtime.paths import default_cache_dir

    if criu.find(default_cache_dir()) is None:
        print(f"needs a cached CRIU: {criu.BUILD}")
        return 1
    n = bench_args.pick(args, 10, 4, 1)
    base = Path(tempfile.mkdtemp(prefix="corral-bench-live-travel-"))
    os.chmod(base, 0o711)
    cluster = Cluster(initialize_head=True,
                      head_node_args={**NODE_ARGS, "include_dashboard": False})
    workers = [cluster.add_node(**NODE_ARGS) for _ in range(2)]
    res: dict[str, float] = {}
    try:
        cluster.connect(namespace="corral-bench")
        bringup.up(cluster.address, state_dir=str(base))
        head = ray.get_runtime_context().get_node_id()
        others = [w.node_id for w in workers]
        with corral.Client(f"ray://{cluster.address}") as client:
            sb = corral.Sandbox.create(memory_mb=512, network="none", checkpointable=True,
                                       node=head, client=client)
            sb.exec(["sh", "-c", COUNTER], timeout=30)
            _counting(sb)
            snap = sb.checkpoint()
            _restore(snap, head)  # warm
            local = [_restore(snap, head) for _ in range(n)]
            before = _fetched_bytes(cluster.address, others[0])
            first = [_restore(snap, node) for node in others]
            crossed = _fetched_bytes(cluster.address, others[0]) - before
            warm = [_restore(snap, others[i % len(others)]) for i in range(n)]
            snap.delete()
            sb.delete()
        res = {"live_restore_local_ms": statistics.median(local),
               "live_restore_cross_node_first_ms": statistics.median(first),
               "live_restore_cross_node_warm_ms": statistics.median(warm),
               "cross_node_fetched_mb": crossed / 1e6}
    finally:
        bringup.down(cluster.address)
        ray.shutdown()
        cluster.shutdown()
        shutil.rmtree(base, ignore_errors=True)
    print(f"a {HEAP_MB} MB process; {n} restores each way; medians")
    for key, value in res.items():
        print(f"{key:34} {value:9.2f}")
    print(f"a live restore on another node takes "
          f"{res['live_restore_cross_node_first_ms'] / res['live_restore_local_ms']:.2f}x a "
          "local one the first time (its images travel), "
          f"{res['live_restore_cross_node_warm_ms'] / res['live_restore_local_ms']:.2f}x after")
    if args.json:
        args.json.write_text(json.dumps(res, indent=2) + "\n")
    return 0


def _fetched_bytes(address: str, node: str) -> int:
    """What ``node``'s daemon fetched from peers so far (layers and images)."""
    import httpx

    from corral.cluster.directory import Directory

    entry = Directory(address).pinned(node)
    with httpx.Client(base_url=entry.url, timeout=60,
                      headers={"Authorization": f"Bearer {entry.token}"}) as http:
        return int(http.get("/v1/peer/stats").raise_for_status().json()["bytes"])


if __name__ == "__main__":
    sys.exit(main())
