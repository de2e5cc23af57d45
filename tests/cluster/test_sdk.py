"""The SDK, unchanged, on a cluster: ``ray://`` routes every call to the right node."""

from __future__ import annotations

import pickle
from collections import Counter

import pytest

import corral
from corral.cluster.ids import node_tag

TAG = "test-cluster-sdk"


@pytest.fixture
def client(corral_cluster):
    with corral.Client(f"ray://{corral_cluster.address}") as c:
        yield c
        for sb in corral.Sandbox.list(tags=[TAG], client=c):
            sb.delete()


def test_placement_spreads_and_calls_go_to_the_node(client, corral_cluster):
    made = [corral.Sandbox.create(memory_mb=64, tags=[TAG], client=client) for _ in range(9)]
    per_node = Counter(sb.info.node for sb in made)
    assert sorted(per_node) == corral_cluster.node_ids()
    assert max(per_node.values()) - min(per_node.values()) <= 1
    for sb in made:
        assert sb.id.startswith(f"sb-{node_tag(sb.info.node)}-")
    r = made[0].exec(["sh", "-c", "echo hi"], timeout=30)
    assert r.stdout == "hi\n"
    listed = corral.Sandbox.list(tags=[TAG], client=client)
    assert sorted(sb.id for sb in listed) == sorted(sb.id for sb in made)
    assert {sb.info.node for sb in listed} == set(corral_cluster.node_ids())


def test_pinning_and_bad_node(client, corral_cluster):
    node = corral_cluster.node_ids()[-1]
    sb = corral.Sandbox.create(memory_mb=64, tags=[TAG], node=node, client=client)
    assert sb.info.node == node
    assert corral.Sandbox.connect(sb.id, client=client).info.node == node
    with pytest.raises(corral.InvalidArgument, match="corral cluster status"):
        corral.Sandbox.create(memory_mb=64, node="f" * 56, client=client)


def test_a_handle_pickles(client):
    sb = corral.Sandbox.create(memory_mb=64, tags=[TAG], client=client)
    copy = pickle.loads(pickle.dumps(sb))
    assert copy.id == sb.id and copy.client.url == client.url
    assert copy.exec("echo ok", timeout=30).stdout == "ok\n"
