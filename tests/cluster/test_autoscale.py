"""Creates no node has room for: they wait for a node to join, shown to Ray's autoscaler
meanwhile (read back from the GCS as the autoscaler reads it), and the demand is
withdrawn when it is met or given up. Every daemon here takes one sandbox
(``--max-sandboxes 1``), so the three nodes are full with three."""

from __future__ import annotations

import json
import threading
import time

import pytest

import corral
from corral.cluster import _ray, autoscale, bringup
from corral.cluster.node import CONFIG_KEY, SUPERVISOR
from tests.cluster.conftest import until

TAG = "test-cluster-autoscale"
OTHERS = [{"CPU": 1.0}]  # someone else's request_resources: kept throughout
# each test brings corral down and up on the cluster (and back): minutes on a loaded
# host, which pytest-timeout counts with the test (300 s by default)
pytestmark = pytest.mark.timeout(900)



@pytest.fixture
def small_cluster(ray_cluster):
    """corral on the session's cluster with one sandbox per daemon; the session's own
    bring-up (if any) is put back afterwards."""
    gcs = _ray.gcs(ray_cluster.address)
    before = _ray.kv_get(gcs, CONFIG_KEY)
    bringup.down(ray_cluster.address)
    bringup.up(ray_cluster.address, state_dir=str(ray_cluster.base / "autoscale"),
               daemon_args=["--max-sandboxes", "1"])
    _ray.request_resources(gcs, OTHERS)
    joined: list[object] = []
    try:
        yield ray_cluster, gcs, joined
    finally:
        bringup.down(ray_cluster.address)
        for node in joined:
            ray_cluster.cluster.remove_node(node)
        _ray.request_resources(gcs, [])
        if before is not None:
            config = json.loads(before)
            bringup.up(ray_cluster.address, state_dir=config["state_dir"],
                       cache_dir=config["cache_dir"], daemon_args=config["daemon_args"])


def _tick() -> int:
    """One round of the supervisor's demand loop, now (it also runs every 2 s)."""
    import ray

    supervisor = ray.get_actor(SUPERVISOR, namespace=_ray.NAMESPACE)
    return ray.get(supervisor.demand.remote(), timeout=60)


def _asked(gcs) -> int:
    constraint = _ray.resource_constraint(gcs)
    assert [b for b in constraint if autoscale.RESOURCE not in b] == OTHERS
    assert _ray.resource_request_v1(gcs) == constraint  # what a v1 autoscaler reads
    return autoscale.count(constraint)


def test_a_full_cluster_asks_the_autoscaler_and_waits_for_a_node(small_cluster):
    from tests.cluster.conftest import NODE_ARGS

    cluster, gcs, joined = small_cluster
    with corral.Client(f"ray://{cluster.address}") as client:
        made = [corral.Sandbox.create(memory_mb=64, tags=[TAG], client=client) for _ in range(3)]
        assert len({sb.info.node for sb in made}) == 3
        assert _tick() == 3 and _asked(gcs) == 3  # the live ones keep their room

        # A fourth waits for room; Ray's autoscaler is asked for a slot more.
        client.router.placement_wait = 300.0
        result: list[object] = []
        waiter = threading.Thread(target=lambda: result.append(
            corral.Sandbox.create(memory_mb=64, tags=[TAG], client=client)))
        waiter.start()
        try:
            until(lambda: autoscale.pending(gcs) == 1, "the create's demand in the KV")
            assert _tick() == 4 and _asked(gcs) == 4
            status = bringup.status(cluster.address)["autoscaler"]
            assert status == {"resource": autoscale.RESOURCE, "waiting": 1, "requested": 4}

            # A node joins (as the autoscaler would add one): it gets a daemon, and the
            # waiting create lands there.
            node = cluster.cluster.add_node(**NODE_ARGS, resources={autoscale.RESOURCE: 1})
            joined.append(node)
        finally:
            waiter.join(timeout=300)
        assert not waiter.is_alive()
        (fourth,) = result
        assert isinstance(fourth, corral.Sandbox) and fourth.info.node == node.node_id
        assert fourth.exec("echo joined", timeout=30).stdout == "joined\n"
        assert autoscale.pending(gcs) == 0  # withdrawn once placed
        assert _tick() == 4 and _asked(gcs) == 4

        # Full again and nothing joins: the create gives up with what to do, and its
        # demand is withdrawn.
        client.router.placement_wait = 1.0
        with pytest.raises(corral.CapacityExceeded) as info:
            corral.Sandbox.create(memory_mb=64, tags=[TAG], client=client)
        message = str(info.value)
        for hint in ("corral_sandbox", "autoscaler", "CORRAL_PLACEMENT_WAIT",
                     "corral cluster status"):
            assert hint in message
        assert autoscale.pending(gcs) == 0
        assert _tick() == 4

        for sb in [*made, fourth]:
            sb.delete()
        assert _tick() == 0 and _asked(gcs) == 0  # nothing alive, nothing waiting


def test_down_withdraws_the_demand(small_cluster):
    cluster, gcs, _ = small_cluster
    with corral.Client(f"ray://{cluster.address}") as client:
        corral.Sandbox.create(memory_mb=64, tags=[TAG], client=client)
    autoscale.publish(gcs, "a-client-that-died", 5, 320, gpus={2: 1})  # one with 2 GPUs
    assert _tick() == 6 and _asked(gcs) == 6
    assert _ray.resource_constraint(gcs).count({autoscale.RESOURCE: 1.0, "GPU": 2.0}) == 1
    # An entry its client stopped refreshing no longer counts.
    assert autoscale.pending(gcs, now=time.time() + autoscale.DEMAND_TTL_S + 1) == 0
    autoscale.publish(gcs, "a-client-that-died", 5, 320)
    bringup.down(cluster.address)
    assert _asked(gcs) == 0 and autoscale.pending(gcs) == 0


def test_bad_resource_name(ray_cluster):
    with pytest.raises(corral.InvalidArgument, match="Ray resource name"):
        bringup.up(ray_cluster.address, state_dir=str(ray_cluster.base / "x"),
                   resource="no spaces")


def test_wild_demand_entries_are_dropped_or_capped(ray_cluster):
    gcs = _ray.gcs(ray_cluster.address)
    now = time.time()
    wild = {
        "not-json": b"{", "not-a-dict": b"[1]", "no-count": b'{"at": %d}' % now,
        "inf": b'{"sandboxes": 1e999, "at": %d}' % now,
        "huge": json.dumps({"sandboxes": 10**12, "at": now}).encode(),
        "negative": json.dumps({"sandboxes": -5, "at": now}).encode(),
    }
    try:
        for key, raw in wild.items():
            _ray.kv_put(gcs, autoscale.DEMAND_KEY + key, raw)
        assert autoscale.pending(gcs) == autoscale.MAX_WAITING  # only "huge" counts, capped
        left = {k.removeprefix(autoscale.DEMAND_KEY) for k in _ray.kv_keys(gcs, autoscale.DEMAND_KEY)}
        assert left == {"huge", "negative"}
    finally:
        for key in wild:
            _ray.kv_del(gcs, autoscale.DEMAND_KEY + key)
