"""A real Ray cluster of three nodes on this host (``ray.cluster_utils.Cluster``), and
corral brought up on it with each node's daemon in its own state directory.

Frugal on purpose (the host is shared): one CPU and a small object store per node, no
dashboard, one cluster for the whole session, stopped at the end.
"""

from __future__ import annotations

import os
import shutil
import tempfile
import time
from pathlib import Path

import pytest

from tests.conftest import ROOT_REASON, have_root_runtime

NODES = 3
NODE_ARGS = {"num_cpus": 1, "object_store_memory": 80 << 20}
HEAD_ARGS = {**NODE_ARGS, "include_dashboard": False}
POLLS = 600  # x 0.1 s: how long the tests wait for the cluster to change


def until(predicate, what: str):
    """``predicate()``'s first truthy value, asked every 0.1 s (at most :data:`POLLS`)."""
    for _ in range(POLLS):
        value = predicate()
        if value:
            return value
        time.sleep(0.1)
    raise AssertionError(f"gave up waiting for {what}")


class RayCluster:
    """The session's cluster: a head (this process is its driver) and two workers."""

    def __init__(self) -> None:
        from ray.cluster_utils import Cluster

        self.cluster = Cluster(initialize_head=True, head_node_args=HEAD_ARGS)
        try:
            self.workers = [self.cluster.add_node(**NODE_ARGS) for _ in range(NODES - 1)]
            self.cluster.connect(namespace="corral-tests")
        except BaseException:
            self.cluster.shutdown()
            raise
        self.address = self.cluster.address
        self.base = Path(tempfile.mkdtemp(prefix="corral-test-cluster-"))
        os.chmod(self.base, 0o711)  # sandboxes' uid traverses it to their root

    def node_ids(self) -> list[str]:
        import ray

        return sorted(n["NodeID"] for n in ray.nodes() if n["Alive"])

    def head_id(self) -> str:
        import ray

        return ray.get_runtime_context().get_node_id()

    def worker_id(self, node: object) -> str:
        return node.node_id  # type: ignore[attr-defined]

    def remove_worker(self, node: object) -> None:
        """Kill ``node``: its raylet and everything on it, as when a machine dies."""
        self.cluster.remove_node(node)

    def add_worker(self, instead_of: object) -> None:
        """A fresh node in place of one removed (the session keeps three), once its
        daemon (started by the supervisor) answers."""
        from corral.cluster import bringup

        self.workers.remove(instead_of)
        self.workers.append(self.cluster.add_node(**NODE_ARGS))

        def three_daemons() -> bool:
            nodes = bringup.status(self.address)["nodes"]
            return sum(bool(n["alive"] and n["daemon"]) for n in nodes) == NODES

        until(three_daemons, "a daemon on the node that joined")

    def shutdown(self) -> None:
        import ray

        ray.shutdown()
        self.cluster.shutdown()
        shutil.rmtree(self.base, ignore_errors=True)


def require_ray_and_root() -> None:
    """Skip (saying why) unless this host can run sandboxes and has Ray."""
    if not have_root_runtime():
        pytest.skip(ROOT_REASON)
    pytest.importorskip("ray", reason="needs Ray: pip install -e '.[ray]' (CI has it)")


_SHARED = pytest.StashKey["RayCluster"]()


def _start_cluster(attempts: int = 2) -> RayCluster:
    """A new cluster; a second try when Ray gives up on a node's start (it waits a fixed
    30 s for the raylet to register, which a loaded host can miss)."""
    for attempt in range(attempts):
        try:
            return RayCluster()
        except Exception as e:  # noqa: BLE001 - Ray raises a bare Exception for this
            if attempt == attempts - 1 or "timed out during startup" not in str(e):
                raise
    raise AssertionError("unreachable")


@pytest.fixture(scope="session")
def ray_cluster(request):
    """The session's one cluster: a test module elsewhere (tests/security) that imports
    these fixtures gets the same one, stopped once when the session ends."""
    require_ray_and_root()
    config = request.config
    if _SHARED not in config.stash:
        c = config.stash[_SHARED] = _start_cluster()

        def stop() -> None:
            from corral.cluster import bringup

            try:
                bringup.down(c.address)
            finally:
                c.shutdown()

        config.add_cleanup(stop)
    return config.stash[_SHARED]


@pytest.fixture(scope="session")
def corral_cluster(ray_cluster):
    """corral brought up on the session's cluster (brought down when the session ends)."""
    from corral.cluster import bringup

    bringup.up(ray_cluster.address, state_dir=str(ray_cluster.base))
    return ray_cluster
