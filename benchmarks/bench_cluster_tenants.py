"""What tenants cost on a Ray cluster: the admin against tenants, in the same run.

    python3 benchmarks/bench_cluster_tenants.py [--quick] [--json OUT]

Starts a three-node Ray cluster on this host (``ray.cluster_utils.Cluster``) and
``corral cluster up`` on it; stops both at the end. Every create is pinned to one node
(``node=``), so placement is the same for all; interleaved, medians:

- ``admin_create_ready_ms``: the admin (``ray://``, the cluster's token): the baseline;
- ``tenant_create_ready_ms``: a tenant without quotas (``ray://`` + ``CORRAL_TOKEN``);
- ``quota_create_ready_ms``: a tenant with quotas, whose every create writes its node's
  book to Ray's KV and reads the other nodes' (two GCS calls);
- ``admin_exec_rtt_ms`` / ``tenant_exec_rtt_ms``: ``exec("true")``;
- ``revoke_s``: ``DELETE /v1/tokens/NAME`` through the cluster until every node confirmed.

Needs root and the ``ray`` extra. Never fails on time.
"""

from __future__ import annotations

import json
import os
import shutil
import statistics
import sys
import tempfile
import time
import uuid
from pathlib import Path

import bench_args  # noqa: E402  (a sibling script, not a package)
from bench_cluster import NODE_ARGS, cluster_bench_args, exec_rtt, ms_since

import corral

SPEC = {"image": "python", "memory_mb": 64}


def create_ready(client: corral.Client, node: str) -> float:
    t = time.perf_counter()
    sb = corral.Sandbox.create(**SPEC, node=node, client=client)
    took = ms_since(t)
    sb.delete()
    return took


def main() -> int:
    args = cluster_bench_args(__doc__)
    if args is None:
        return 1
    import ray
    from ray.cluster_utils import Cluster

    from corral.cluster import bringup

    n = bench_args.pick(args, 40, 10, 2)
    base = Path(tempfile.mkdtemp(prefix="corral-bench-tenants-"))
    os.chmod(base, 0o711)
    cluster = Cluster(initialize_head=True, head_node_args={**NODE_ARGS, "include_dashboard": False})
    for _ in range(2):
        cluster.add_node(**NODE_ARGS)
    res: dict[str, float] = {}
    try:
        cluster.connect(namespace="corral-bench")
        bringup.up(cluster.address, state_dir=str(base))
        node = ray.get_runtime_context().get_node_id()
        url = f"ray://{cluster.address}"
        with corral.Client(url) as admin:
            def token(**quotas: int) -> tuple[str, str]:
                name = f"bench-{uuid.uuid4().hex[:8]}"
                made = admin.request("POST", "/v1/tokens", json={"name": name, **quotas})
                return name, str(made.json()["token"])

            plain = token()[1]
            limited = token(max_sandboxes=1000, max_memory_mb=1 << 20)[1]
            with corral.Client(url, token=plain) as tenant, \
                    corral.Client(url, token=limited) as quota:
                clients = {"admin": admin, "tenant": tenant, "quota": quota}
                times: dict[str, list[float]] = {k: [] for k in clients}
                for c in clients.values():
                    create_ready(c, node)  # warm: connections, directory, loads
                for _ in range(n):  # interleaved: the same machine load for each
                    for key, c in clients.items():
                        times[key].append(create_ready(c, node))
                for key in clients:
                    res[f"{key}_create_ready_ms"] = statistics.median(times[key])
                rtts: dict[str, list[float]] = {"admin": [], "tenant": []}
                boxes = {k: corral.Sandbox.create(**SPEC, node=node, client=clients[k])
                         for k in rtts}
                for _ in range(n):
                    for key, sb in boxes.items():
                        rtts[key] += exec_rtt(sb, 5)
                for key, sb in boxes.items():
                    res[f"{key}_exec_rtt_ms"] = statistics.median(rtts[key])
                    sb.delete()
            name = token()[0]
            t = time.perf_counter()
            admin.request("DELETE", f"/v1/tokens/{name}")
            res["revoke_s"] = time.perf_counter() - t
    finally:
        bringup.down(cluster.address)
        ray.shutdown()
        cluster.shutdown()
        shutil.rmtree(base, ignore_errors=True)
    print(f"{n} creates of each, interleaved, pinned to one node of three; medians")
    for key, value in res.items():
        print(f"{key:26} {value:9.3f}")
    print(f"a tenant's create costs {res['tenant_create_ready_ms'] / res['admin_create_ready_ms']:.2f}x "
          f"the admin's, with quotas {res['quota_create_ready_ms'] / res['admin_create_ready_ms']:.2f}x "
          f"(+{res['quota_create_ready_ms'] - res['admin_create_ready_ms']:.2f} ms); its exec "
          f"{res['tenant_exec_rtt_ms'] / res['admin_exec_rtt_ms']:.2f}x")
    if args.json:
        args.json.write_text(json.dumps(res, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
