"""corral on a Ray cluster against one daemon, and against Ray actors as sandboxes.

    python3 benchmarks/bench_cluster.py [--quick] [--json OUT]

Starts a three-node Ray cluster on this host (``ray.cluster_utils.Cluster``: one CPU
and a small object store a node, no dashboard) and ``corral cluster up`` on it; stops
both at the end. Times, in the same run, with the blocking SDK (medians):

- ``create_ready_ms`` and ``exec_rtt_ms`` (``exec("true")``) through the cluster client
  (``ray://``: placement, then straight to the node) and straight to one node's daemon
  (``http://`` with that node's token): the difference is what the cluster costs.
  Targets: placement adds <= 1 ms to a create, nothing measurable to an exec;
- ``placement_ms``: the placement decision alone (``router.place``: the nodes' loads are
  read at most once a second, so it is mostly arithmetic);
- ``creates_per_s``: 24 creates from 8 threads: straight to one daemon, through the
  cluster client pinned to one node (``node=``), and placed over the three nodes (on
  one host the nodes share its cores: this measures placement, not more machines);
- ``restore_local_ms`` against ``restore_cross_node_first_ms``: a sandbox from a snapshot
  (20 MB of files) on the node it was taken on, and on another node the first time (its
  layers fetched from the first node's daemon, checked, then the create);
  ``restore_cross_node_cold_daemon_ms`` is a daemon's very first fetch (it also imports
  Ray and reads the cluster's directory then);
  ``restore_cross_node_warm_ms`` once the layers are there;
- ``node_loss_detect_ms``: from ``remove_node`` until a call to a sandbox there raises
  ``SandboxLost``;
- baselines: a Ray actor per environment (``actor_create_ms``, ``actor_call_rtt_ms``, and
  with several alive at once ``actor_rss_mb`` / ``actor_pss_mb`` each), and Ray's own
  ``ray.experimental.sandbox`` on the same cluster, in-process (``ray_sandbox_*``) and as
  an actor per sandbox (``ray_sandbox_actor_*``): create→ready, exec RTT and PSS per idle
  sandbox (``ray_sandbox_baseline.py``), each against corral straight to one daemon
  (``*_x_corral``; ``corral_idle_pss_mb``: the PSS idle sandboxes add below their
  daemon). Ray's tools come from ``setup_ray_sandbox.py`` (``make bench`` runs it);
  when they are missing, or Ray fails, the precise reason is printed instead.

Needs root and the ``ray`` extra. Never fails on time.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import bench_args  # noqa: E402  (a sibling script, not a package)

import corral

SPEC = {"image": "python", "memory_mb": 128}
NODE_ARGS = {"num_cpus": 1, "object_store_memory": 80 << 20}
BURST, THREADS = 24, 8
POLLS = 600  # x 10 ms: how long node-loss detection is waited for


def ms_since(t: float) -> float:
    return (time.perf_counter() - t) * 1000


def create_ready(client: corral.Client, n: int) -> list[float]:
    out = []
    for _ in range(n):
        t = time.perf_counter()
        sb = corral.Sandbox.create(**SPEC, client=client)
        out.append(ms_since(t))
        sb.delete()
    return out


def exec_rtt(sb: corral.Sandbox, n: int) -> list[float]:
    sb.exec("true")  # warm
    out = []
    for _ in range(n):
        t = time.perf_counter()
        sb.exec("true")
        out.append(ms_since(t))
    return out


def creates_per_s(client: corral.Client, **where: str) -> float:
    t = time.perf_counter()
    with ThreadPoolExecutor(THREADS) as pool:
        made = list(pool.map(lambda _: corral.Sandbox.create(**SPEC, **where, client=client),
                             range(BURST)))
    rate = BURST / (time.perf_counter() - t)
    with ThreadPoolExecutor(THREADS) as pool:
        list(pool.map(lambda sb: sb.delete(), made))
    return rate


def restore_times(client: corral.Client, head: str, others: list[str], n: int) -> dict[str, float]:
    def take() -> corral.Snapshot:
        base = corral.Sandbox.create(**SPEC, node=head, client=client)
        base.exec("mkdir -p /tmp/data && for i in $(seq 20); do head -c 1000000 /dev/urandom "
                  "> /tmp/data/f$i; done", timeout=120)
        snap = base.snapshot()
        base.delete()
        return snap

    def restore(snap: corral.Snapshot, node: str) -> float:
        t = time.perf_counter()
        sb = snap.restore(node=node)
        took = ms_since(t)
        sb.delete()
        return took

    snaps = [take(), take()]
    try:
        restore(snaps[0], head)  # warm
        local = [restore(snaps[0], head) for _ in range(n)]
        # each node fetches a snapshot's layer once; the first fetch of a daemon also
        # imports Ray and reads the cluster's directory (once per daemon)
        cold = [restore(snaps[0], node) for node in others]
        first = [restore(snaps[1], node) for node in others]
        warm = [restore(snaps[1], others[i % len(others)]) for i in range(n)]
    finally:
        for snap in snaps:
            snap.delete()
    return {"restore_local_ms": statistics.median(local),
            "restore_cross_node_first_ms": statistics.median(first),
            "restore_cross_node_warm_ms": statistics.median(warm),
            "restore_cross_node_cold_daemon_ms": statistics.median(cold)}


def actor_baseline(ray, n: int, alive: int) -> dict[str, float]:
    """A Ray actor per environment: create→first call and call RTT (one at a time), then
    the memory of each of ``alive`` actors held at once (RSS and PSS of its process)."""
    from bench_engine import pss_kb

    @ray.remote(num_cpus=0)
    class Env:
        def step(self) -> int:
            return os.getpid()

    creates, calls = [], []
    for _ in range(n):
        t = time.perf_counter()
        env = Env.remote()
        ray.get(env.step.remote())
        creates.append(ms_since(t))
        t = time.perf_counter()
        ray.get(env.step.remote())
        calls.append(ms_since(t))
        ray.kill(env)
    envs = [Env.remote() for _ in range(alive)]
    try:
        pids = ray.get([e.step.remote() for e in envs], timeout=600)
        rss = [rss_kb(pid) for pid in pids]
        pss = pss_kb(pids)
    finally:
        for e in envs:
            ray.kill(e)
    return {"actor_create_ms": statistics.median(creates),
            "actor_call_rtt_ms": statistics.median(calls),
            "actor_rss_mb": statistics.median(rss) / 1024,
            "actor_pss_mb": pss / len(pids) / 1024}


def rss_kb(pid: int) -> int:
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1])
    return 0


def corral_idle_pss_mb(client: corral.Client, daemon_pid: int, k: int) -> float:
    """PSS of the processes ``k`` idle sandboxes add below their daemon (``client`` goes
    straight to it), each."""
    from bench_engine import pss_kb
    from peers import descendants

    def tree() -> int:
        return pss_kb([daemon_pid, *descendants(daemon_pid)])

    before = tree()
    made = [corral.Sandbox.create(**SPEC, client=client) for _ in range(k)]
    try:
        for sb in made:
            sb.exec("true")
        time.sleep(1.0)  # the same settle as the Ray baselines
        return (tree() - before) / k / 1024
    finally:
        for sb in made:
            sb.delete()


def ray_sandbox_ratios(res: dict[str, float | str | None]) -> list[str]:
    """Ray's sandboxes against corral straight to one daemon, same run."""
    lines = []
    for way, label in (("ray_sandbox", "in-process"), ("ray_sandbox_actor", "as actors")):
        pairs = [(f"{way}_create_ready_ms", "direct_create_ready_ms", "create->ready"),
                 (f"{way}_exec_rtt_ms", "direct_exec_rtt_ms", "exec RTT"),
                 (f"{way}_idle_pss_mb", "corral_idle_pss_mb", "PSS per idle sandbox")]
        parts = []
        for theirs, ours, what in pairs:
            a, b = res.get(theirs), res.get(ours)
            if isinstance(a, float) and isinstance(b, float) and b > 0:
                res[f"{theirs.removesuffix('_ms').removesuffix('_mb')}_x_corral"] = a / b
                parts.append(f"{what} {a / b:.1f}x")
        if parts:
            lines.append(f"Ray sandboxes {label} vs corral: " + ", ".join(parts))
    return lines


def detect_node_loss(cluster, worker, client: corral.Client) -> float | None:
    sb = corral.Sandbox.create(**SPEC, node=worker.node_id, client=client)
    t = time.perf_counter()
    cluster.remove_node(worker)
    for _ in range(POLLS):
        try:
            sb.exec("true", timeout=5)
        except corral.SandboxLost:
            return ms_since(t)
        except corral.DaemonUnavailable:
            pass
        time.sleep(0.01)
    return None


def cluster_bench_args(doc: str) -> argparse.Namespace | None:
    """The arguments of a cluster benchmark (``--quick``, ``--json``), or None after
    saying what is missing (root, the ``ray`` extra)."""
    ap = bench_args.parser(doc)
    args = ap.parse_args()
    if os.geteuid() != 0:
        print("needs root (the daemons run real sandboxes)")
        return None
    try:
        import ray  # noqa: F401
    except ImportError:
        print("needs Ray: pip install -e '.[ray]'")
        return None
    return args


def main() -> int:
    args = cluster_bench_args(__doc__)
    if args is None:
        return 1
    import ray
    from peers.ray_sandbox import use_tools as use_ray_sandbox_tools
    from ray.cluster_utils import Cluster
    from ray_sandbox_baseline import baseline as ray_sandbox_baseline

    from corral.cluster import _ray, auth, bringup
    from corral.runtime.images import ImageStore
    from corral.runtime.paths import Layout

    n = bench_args.pick(args, 40, 10, 2)
    idle = bench_args.pick(args, 5, 3, 1)  # idle sandboxes at once (100 Ray actors swamp 2 cores)
    use_ray_sandbox_tools()  # before the cluster starts: its workers inherit PATH
    base = Path(tempfile.mkdtemp(prefix="corral-bench-cluster-"))
    os.chmod(base, 0o711)
    cluster = Cluster(initialize_head=True,
                      head_node_args={**NODE_ARGS, "include_dashboard": False})
    workers = [cluster.add_node(**NODE_ARGS) for _ in range(2)]
    res: dict[str, float | str | None] = {}
    try:
        cluster.connect(namespace="corral-bench")
        entries = bringup.up(cluster.address, state_dir=str(base))
        head = ray.get_runtime_context().get_node_id()
        token = auth.node_token(_ray.gcs(cluster.address), head)  # that daemon's own
        url = next(e["url"] for e in entries if e["node_id"] == head)
        with corral.Client(f"ray://{cluster.address}") as routed, \
                corral.Client(url, token=token) as direct:
            for c in (routed, direct):
                create_ready(c, 2)  # warm: connections, directory, loads
            direct_creates, routed_creates = [], []
            for _ in range(n):  # interleaved, so both see the same machine load
                direct_creates += create_ready(direct, 1)
                routed_creates += create_ready(routed, 1)
            sb = corral.Sandbox.create(**SPEC, node=head, client=routed)
            same = corral.Sandbox.connect(sb.id, client=direct)
            direct_exec, routed_exec = [], []
            for _ in range(n):
                direct_exec += exec_rtt(same, 5)
                routed_exec += exec_rtt(sb, 5)
            sb.delete()
            res.update({
                "direct_create_ready_ms": statistics.median(direct_creates),
                "cluster_create_ready_ms": statistics.median(routed_creates),
                "direct_exec_rtt_ms": statistics.median(direct_exec),
                "cluster_exec_rtt_ms": statistics.median(routed_exec),
                "creates_per_s_direct": creates_per_s(direct),
                "creates_per_s_1_node": creates_per_s(routed, node=head),
                "creates_per_s_3_nodes": creates_per_s(routed),
            })
            placements = []
            for _ in range(20 * n):
                t = time.perf_counter()
                routed.router.place(SPEC["memory_mb"])
                placements.append(ms_since(t))
            res["placement_ms"] = statistics.median(placements)
            res.update(restore_times(routed, head, [w.node_id for w in workers], n))
            res.update(actor_baseline(ray, n, alive=bench_args.pick(args, 20, 5, 1)))
            daemon_pid = next(e["pid"] for e in entries if e["node_id"] == head)
            res["corral_idle_pss_mb"] = corral_idle_pss_mb(direct, daemon_pid, idle)
            res.update(ray_sandbox_baseline(
                ray, ImageStore(Layout.create().images_dir).get(SPEC["image"]).rootfs, base,
                n=bench_args.pick(args, 8, 3, 1), idle=idle))
            res["node_loss_detect_ms"] = detect_node_loss(cluster, workers[0], routed)
    finally:
        bringup.down(cluster.address)
        ray.shutdown()
        cluster.shutdown()
        shutil.rmtree(base, ignore_errors=True)
    print(f"{n} creates and {5 * n} execs each way, interleaved; medians")
    for key, value in res.items():
        shown = f"{value:9.2f}" if isinstance(value, float) else f"  {value}"
        print(f"{key:28} {shown}")
    create_cost = res["cluster_create_ready_ms"] - res["direct_create_ready_ms"]  # type: ignore[operator]
    exec_cost = res["cluster_exec_rtt_ms"] - res["direct_exec_rtt_ms"]  # type: ignore[operator]
    print(f"placement adds {create_cost:+.2f} ms to a create (target <= 1), "
          f"routing {exec_cost:+.3f} ms to an exec")
    print(f"a restore on another node takes {res['restore_cross_node_first_ms'] / res['restore_local_ms']:.1f}x "  # type: ignore[operator]
          "a local one the first time (the layers travel), "
          f"{res['restore_cross_node_warm_ms'] / res['restore_local_ms']:.2f}x after")  # type: ignore[operator]
    for line in ray_sandbox_ratios(res):
        print(line)
    if args.json:
        args.json.write_text(json.dumps(res, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
