"""The cluster's pure parts, no Ray needed: ids, placement, the ray:// URL."""

from __future__ import annotations

import pytest

import corral
from corral.client._config import Endpoint
from corral.cluster.ids import id_prefix, is_node_id, node_tag, tag_of
from corral.cluster.placement import Room, choose, having_image, room

NODE = "064e3ebd758db2dfcb8ea4527923f4d80b512293fe3ca812d7d58b0f"


def _info(live: int, committed: int, queued: int = 0) -> dict:
    return {
        "capacity": {"max_sandboxes": 100, "max_memory_mb": 10_000},
        "counts": {"running": live}, "committed_memory_mb": committed, "queued": queued,
    }


def test_ids_name_their_node():
    assert is_node_id(NODE) and not is_node_id("sb-1234") and not is_node_id("zz" * 20)
    sid = id_prefix(NODE) + "a1b2c3d4e5f6"
    assert tag_of(sid) == node_tag(NODE) == NODE[:10]
    assert tag_of("sb-a1b2c3d4e5f6") is None and tag_of("sb-XYZ-1") is None


def test_room_counts_what_was_sent_since():
    r = room(_info(live=10, committed=1000), placed=5, placed_mb=500)
    assert (r.slots, r.memory_mb) == (85, 8500)
    assert r.fraction == pytest.approx(0.85)


def test_choose_prefers_local_then_most_room_then_shortest_queue():
    rooms = {"a": room(_info(50, 1000)), "b": room(_info(10, 1000)), "c": room(_info(90, 0))}
    assert choose(rooms, memory_mb=64) == "b"
    assert choose(rooms, memory_mb=64, local="c") == "c"
    assert choose(rooms, memory_mb=64, local="gone") == "b"
    full = {"a": Room(0, 0, 0.0, 7), "b": Room(0, 0, 0.0, 2)}
    assert choose(full, memory_mb=64, local="a") == "b"
    queued = {"a": Room(5, 5000, 0.5, 3), "b": Room(5, 5000, 0.4, 0)}
    assert choose(queued, memory_mb=64, local="a") == "b"
    assert choose({"a": room(_info(0, 9990))}, memory_mb=64) == "a"  # no room: queue there


def test_spreading_a_burst_evenly():
    loads = {n: _info(0, 0) for n in "abc"}
    placed = dict.fromkeys(loads, 0)
    for _ in range(30):
        rooms = {n: room(i, placed=placed[n], placed_mb=placed[n] * 64) for n, i in loads.items()}
        placed[choose(rooms, memory_mb=64)] += 1
    assert placed == {"a": 10, "b": 10, "c": 10}


def test_ray_urls():
    e = Endpoint.resolve("ray://10.0.0.5:6379")
    assert e.cluster == "10.0.0.5:6379" and e.uds is None and e.token is None
    assert Endpoint.resolve("ray://auto").cluster == "auto"
    for bad in ("ray://", "ray:///x", "ray://h:1/path"):
        with pytest.raises(corral.InvalidArgument, match="ray://HOST:PORT"):
            Endpoint.resolve(bad)
    with pytest.raises(corral.InvalidArgument, match="CORRAL_URL=ray://"):
        corral.Sandbox.create(node=NODE, client=corral.Client("http://127.0.0.1:9"))


def test_only_nodes_with_the_image_unless_none_has_it():
    rooms = {n: room(_info(0, 0)) for n in "abc"}
    images = {"a": {"python"}, "b": {"python", "mine"}, "c": {"python"}}
    assert set(having_image(rooms, images, "mine")) == {"b"}
    assert set(having_image(rooms, images, "python")) == {"a", "b", "c"}
    assert set(having_image(rooms, images, "nowhere")) == {"a", "b", "c"}


def test_corral_url_selects_the_cluster(monkeypatch):
    monkeypatch.setenv("CORRAL_URL", "ray://auto")
    monkeypatch.setenv("CORRAL_TOKEN", "crl_a-tenants")  # sent instead of the cluster's
    e = Endpoint.resolve()
    assert e.cluster == "auto" and not e.embed and e.token == "crl_a-tenants"
    assert corral.Client().router is not None
    assert corral.Client().router.directory.token == "crl_a-tenants"  # no node's read
    key = "A" * 43  # the daemon's public key, pinned for the first contact
    e = Endpoint.resolve(f"cluster+http://node-a:7070?key={key}")  # through one daemon
    assert e.cluster == f"http://node-a:7070?key={key}" and e.token == "crl_a-tenants"
    with pytest.raises(corral.InvalidArgument, match="names no key"):
        Endpoint.resolve("cluster+http://node-a:7070")  # trusted on first contact: no
    # daemons register plain-HTTP URLs: https to the first would be TLS in name only
    with pytest.raises(corral.InvalidArgument, match="in clear"):
        Endpoint.resolve("cluster+https://node-a:7070")
    monkeypatch.delenv("CORRAL_TOKEN")
    with pytest.raises(corral.InvalidArgument, match="CORRAL_TOKEN"):
        Endpoint.resolve("cluster+http://node-a:7070")
    assert Endpoint.resolve("ray://auto").token is None  # the admin: the cluster's token
    monkeypatch.delenv("CORRAL_URL")
    assert corral.Client().router is None


def test_a_node_key_in_a_cluster_address():
    """``cluster+http://HOST:PORT?key=KEY``: the key as `corral cluster up` prints it
    (base64url, 43 characters), or pasted in the standard alphabet."""
    from corral.cluster import proof

    _, public = proof.make_key()
    printed = proof.url_key(public)
    assert len(printed) == 43 and proof.parse_key(printed) == public
    assert proof.parse_key(public) == proof.parse_key(public.replace("+", " ")) == public
    assert proof.parse_key("not-a-key") is None and proof.parse_key("A" * 40) is None
    # a "+" first (one key in 64) reads as a space at the start of a query's value: it is
    # the key's, not whitespace to strip (a random key failed the line above in a full run)
    import base64

    edge = base64.b64encode(b"\xf8" + bytes(31)).decode()
    assert edge[0] == "+" and proof.parse_key(edge.replace("+", " ")) == edge
