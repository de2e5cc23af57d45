"""A three-node ``ray.cluster_utils.Cluster`` with Ray's token authentication on, run as
its own process (``python ray_token_cluster.py``) so the test process's Ray state (its
driver connection, Ray's process-wide token cache) is never switched to token mode.

Its environment must carry ``RAY_AUTH_MODE=token`` and ``RAY_AUTH_TOKEN`` (every node it
starts inherits them, as ``ray start`` on a real node would). It prints one JSON line
``{"address", "nodes"}``, then reads commands, one a line, answering each with a JSON
line: ``add`` (a node joins: ``{"node_id"}``), ``quit``. EOF stops the cluster too.
"""

from __future__ import annotations

import json
import sys

NODE_ARGS = {"num_cpus": 1, "object_store_memory": 80 << 20}


def main() -> None:
    from ray._private.authentication_test_utils import reset_auth_token_state
    from ray.cluster_utils import Cluster

    reset_auth_token_state()  # Ray reads RAY_AUTH_MODE from this process's environment
    cluster = Cluster(initialize_head=True,
                      head_node_args={**NODE_ARGS, "include_dashboard": False})
    try:
        nodes = [cluster.head_node.node_id]
        nodes += [cluster.add_node(**NODE_ARGS).node_id for _ in range(2)]
        print(json.dumps({"address": cluster.address, "nodes": nodes}), flush=True)
        for line in sys.stdin:
            command = line.strip()
            if command == "add":
                print(json.dumps({"node_id": cluster.add_node(**NODE_ARGS).node_id}), flush=True)
            elif command == "quit":
                break
    finally:
        cluster.shutdown()


if __name__ == "__main__":
    main()
