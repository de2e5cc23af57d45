"""Red team: races on the cluster's tenant registry and its cluster-wide quotas, in
Ray's real KV (the session's Ray cluster; no corral daemon needed for these).

- A create cancelled (its client hung up: ``unless_gone`` cancels it) while it checks
  the other nodes' books must not leave its reservation behind: that place would be
  counted against the tenant on every node until the daemon restarts.
- A ``token update`` that reads the entry just before a ``token revoke`` writes its
  tombstone must not write the live entry (its hash) back over the tombstone: the
  revoked token would work again on every node.
- A create that fails or is abandoned while it waits for room frees its place on the
  other nodes at once, not at the next periodic sync.
- A lost node's book is deleted once Ray marks the node dead (Ray forgets old dead
  nodes, and the book would count again).
"""

from __future__ import annotations

import asyncio

import pytest

from corral.cluster import _ray, tenant_registry
from corral.errors import CorralError
from corral.server.cluster_quotas import ClusterQuotas
from corral.server.cluster_tenants import ClusterTokenStore
from corral.server.tenants import Tenant
from tests.cluster.conftest import ray_cluster, until  # noqa: F401 (the session's)
from tests.cluster.tenants_on_cluster import unique

SPINS = 10_000  # event-loop turns a test waits for a create to reach the GCS
POLLS = 200  # x 0.05 s: how long a test waits for a write on a thread to land


@pytest.fixture
def gcs(ray_cluster):  # noqa: F811
    return _ray.gcs(ray_cluster.address)


def test_a_create_cancelled_during_the_cluster_check_gives_its_place_back(gcs):
    name = unique("hangup")
    node = unique("no-such-node")  # a book of its own: no daemon's book is touched
    quota = Tenant(name, max_sandboxes=1)
    book = ClusterQuotas(lambda t: quota if t == name else None, gcs, node)

    async def attack() -> None:
        create = asyncio.ensure_future(book.acquire(name, 64, 0.5))
        for _ in range(SPINS):  # until it holds its place and asks the GCS (a thread)
            await asyncio.sleep(0)
            if name in book.local() or create.done():
                break
        assert not create.done() and name in book.local()
        create.cancel()  # the client hung up
        with pytest.raises(asyncio.CancelledError):
            await create
        assert name not in book.local()  # its place is free again, here...
        hold = await book.acquire(name, 64, 0.5)  # ...so the tenant's one create fits
        assert hold is not None
        book.settle(hold, None)

    try:
        asyncio.run(attack())
        book.sync(*book.book())
        usage = tenant_registry.read_usage(gcs).get(node, {})
        assert name not in usage  # ...and on every other node, which read this book
    finally:
        _ray.kv_del(gcs, tenant_registry.USAGE_KEY + node)


def test_an_update_racing_a_revoke_does_not_bring_the_token_back(gcs, monkeypatch):
    name = unique("undead")
    store, admin2 = ClusterTokenStore(gcs), ClusterTokenStore(gcs)
    _, token = store.create(name, max_sandboxes=2)
    assert store.lookup(token) is not None
    real_get, raced = tenant_registry.get, []

    def get_then_revoke(client, wanted):  # the other admin revokes right after the read
        entry = real_get(client, wanted)
        if wanted == name and not raced:
            raced.append(True)
            admin2.revoke(name)
        return entry

    monkeypatch.setattr(tenant_registry, "get", get_then_revoke)
    with pytest.raises(CorralError):  # the update finds it revoked...
        store.update(name, {"max_sandboxes": 5})
    monkeypatch.undo()
    assert raced
    for daemon in (store, admin2, ClusterTokenStore(gcs)):  # ...and it stays revoked
        daemon.reload()
        assert daemon.lookup(token) is None
        assert daemon.revoked(name)
    with pytest.raises(CorralError):  # nor is the name given again
        store.create(name)


def test_a_lost_nodes_book_is_deleted_so_it_never_counts_again(ray_cluster, gcs):  # noqa: F811
    """Ray forgets dead nodes past a count (``maximum_gcs_dead_node_cached_count``);
    a lost node's book left in the KV would then count again, on every node, and hold
    its tenants at their quotas for good."""
    name = unique("lost")
    quota = Tenant(name, max_sandboxes=2)
    doomed = ray_cluster.cluster.add_node(num_cpus=0, object_store_memory=80 << 20)
    node = doomed.node_id
    try:
        tenant_registry.publish_usage(gcs, node, {name: [2, 128, 1.0]})
        ray_cluster.cluster.remove_node(doomed)  # the machine dies with its sandboxes
        until(lambda: not _ray.node_states(gcs).get(node, {"alive": True})["alive"],
              "Ray to mark the lost node dead")
        here = unique("no-such-node")
        book = ClusterQuotas(lambda t: quota if t == name else None, gcs, here)
        try:
            book.sync(*book.book())
            assert node not in tenant_registry.read_usage(gcs)  # forgotten in the KV
            assert book.usage(name).sandboxes == 0
        finally:
            _ray.kv_del(gcs, tenant_registry.USAGE_KEY + here)
    finally:
        _ray.kv_del(gcs, tenant_registry.USAGE_KEY + node)


def test_an_abandoned_create_frees_its_place_on_the_other_nodes_at_once(gcs):
    """A create that fails or whose client hangs up while it waits for room gives its
    place back; the other nodes must see that at once, not at the next periodic sync,
    or the tenant's next create elsewhere is refused for a place nothing holds."""
    name = unique("abandoned")
    node = unique("no-such-node")
    quota = Tenant(name, max_sandboxes=1)
    book = ClusterQuotas(lambda t: quota if t == name else None, gcs, node)

    def published() -> dict:
        return tenant_registry.read_usage(gcs).get(node, {})

    async def attack() -> None:
        hold = await book.acquire(name, 64, 0.5)
        assert name in published()  # the other nodes count it while it starts
        book.settle(hold, None)  # ...the create failed (or its client left)
        for _ in range(POLLS):
            if name not in published():
                return
            await asyncio.sleep(0.05)
        raise AssertionError("the other nodes still count the place an abandoned create held")

    try:
        asyncio.run(attack())
    finally:
        _ray.kv_del(gcs, tenant_registry.USAGE_KEY + node)
