"""Snapshots travel: taken on node A, restored on node B byte-identical, each layer
fetched once per node (counted by the receiving daemon), a corrupt layer refused. A
volume made on one node is mounted on the others, its tree fetched once per node."""

from __future__ import annotations

import concurrent.futures
import os
import time

import httpx
import pytest

import corral
from corral.cluster.directory import Directory
from corral.cluster.ids import node_tag
from corral.runtime import criu
from corral.runtime.paths import default_cache_dir
from tests.cluster.tenants_on_cluster import daemons, make_tenant, on, tenant_client, unique

TAG = "test-cluster-travel"
LISTING = (  # what a layer's digest covers (a directory's size and mtime are noise)
    "cd /tmp/t && find . ! -type d -printf '%p %y %m %U %G %s %T@ %l\\n' | sort && "
    "find . -type d -printf '%p %m %U %G\\n' | sort && sha256sum $(find . -type f | sort) && "
    "du -k sparse"
)


@pytest.fixture
def client(corral_cluster):
    with corral.Client(f"ray://{corral_cluster.address}") as c:
        yield c
        for sb in corral.Sandbox.list(tags=[TAG], client=c):
            sb.delete()


def _daemon(cluster, node: str) -> httpx.Client:
    n = Directory(cluster.address).pinned(node)
    return httpx.Client(base_url=n.url, timeout=60,
                        headers={"Authorization": f"Bearer {n.token}"})


def _stats(cluster, node: str) -> dict:
    with _daemon(cluster, node) as http:
        return http.get("/v1/peer/stats").raise_for_status().json()


def _layers_dir(cluster, node: str):
    return cluster.base / node_tag(node) / "state" / "layers"


def _fill(sb) -> None:
    r = sb.exec(["sh", "-c", "mkdir -p /tmp/t/sub && head -c 3000000 /dev/urandom > /tmp/t/big && "
             "echo hi > /tmp/t/sub/small && chmod 640 /tmp/t/sub/small && ln -s small "
             "/tmp/t/sub/link && ln /tmp/t/big /tmp/t/hard && truncate -s 50M /tmp/t/sparse"],
                timeout=60)
    assert r.returncode == 0, r.stderr


def test_a_snapshot_taken_on_a_restores_on_b_byte_identical_fetched_once(client, corral_cluster):
    a, b, c = corral_cluster.node_ids()
    base = corral.Sandbox.create(memory_mb=64, tags=[TAG], node=a, client=client)
    _fill(base)
    first = base.snapshot(name=f"travel-{base.id[-6:]}")
    mid = first.restore(node=a, tags=[TAG])
    mid.exec("echo more > /tmp/t/second", timeout=30)
    snap = mid.snapshot(name=f"travel2-{base.id[-6:]}")  # a chain of two layers
    expected = mid.exec(["sh", "-c", LISTING], timeout=60).stdout
    before_b, before_c = _stats(corral_cluster, b), _stats(corral_cluster, c)
    try:
        with concurrent.futures.ThreadPoolExecutor(2) as pool:  # two first uses at once
            copies = list(pool.map(lambda _: snap.restore(node=b, tags=[TAG]), range(2)))
        copies.append(snap.restore(node=b, tags=[TAG]))  # and one after
        copies.append(snap.restore(node=c, tags=[TAG]))
        assert [x.info.node for x in copies] == [b, b, b, c]
        for copy in copies:
            assert copy.exec(["sh", "-c", LISTING], timeout=60).stdout == expected
        after_b, after_c = _stats(corral_cluster, b), _stats(corral_cluster, c)
        fetched_b = {d: n - before_b["by_digest"].get(d, 0) for d, n in after_b["by_digest"].items()}
        fetched_b = {d: n for d, n in fetched_b.items() if n}
        assert len(snap.info.layers) == 2
        assert len(fetched_b) == 2 and set(fetched_b.values()) == {1}  # each layer once
        assert after_b["bytes"] - before_b["bytes"] > 3_000_000  # crossed, not in a sparse hole
        assert after_c["layers"] - before_c["layers"] == 2
        # the lower layer is shared: restoring the first snapshot on B fetches nothing
        assert first.restore(node=b, tags=[TAG]).files.read("/tmp/t/sub/small") == b"hi\n"
        assert _stats(corral_cluster, b)["layers"] == after_b["layers"]
        assert [s.id for s in corral.Snapshot.list(client=client)].count(snap.id) == 1
    finally:
        for s in (snap, first):
            corral.Snapshot.get(s.id, client=client).delete()
    for node in (a, b, c):  # every copy went
        with _daemon(corral_cluster, node) as http:
            assert http.get(f"/v1/snapshots/{snap.id}").status_code == 404


def test_a_corrupt_layer_from_a_peer_is_refused_and_nothing_is_left(client, corral_cluster):
    a, b, _ = corral_cluster.node_ids()
    base = corral.Sandbox.create(memory_mb=64, tags=[TAG], node=a, client=client)
    base.files.write("/tmp/secret", b"the right bytes")
    snap = base.snapshot(name=f"corrupt-{base.id[-6:]}")
    top = _layers_dir(corral_cluster, a) / snap.info.layers[0]
    layer = top / "tree" / "tmp" / "secret"
    # the layer is hashed just after the commit (its settle writes the manifest): the
    # rot comes later, as rot does
    for _ in range(600):
        if (top / "manifest.json").exists():
            break
        time.sleep(0.1)
    try:
        with open(layer, "r+b") as f:  # the peer's copy rots on its disk
            f.write(b"THE")
        before = set(os.listdir(_layers_dir(corral_cluster, b)))
        with pytest.raises(corral.LayerTransferError, match="hash to"):
            snap.restore(node=b, tags=[TAG])
        assert set(os.listdir(_layers_dir(corral_cluster, b))) == before  # no .tmp-, no layer
        with _daemon(corral_cluster, b) as http:
            assert http.get(f"/v1/snapshots/{snap.id}").status_code == 404
    finally:
        corral.Snapshot.get(snap.id, client=client).delete()


def test_fetching_from_a_node_without_the_snapshot_or_an_unknown_node(client, corral_cluster):
    a, b, _ = corral_cluster.node_ids()
    with _daemon(corral_cluster, b) as http:
        r = http.post("/v1/peer/snapshots/fetch", json={"snapshot": "snap-000000000000", "node": a})
        assert r.status_code == 404 and r.json()["error"]["code"] == "snapshot_not_found"
        r = http.post("/v1/peer/snapshots/fetch", json={"snapshot": "x", "node": "f" * 56})
        assert r.status_code == 400 and "corral cluster status" in r.json()["error"]["message"]
        r = http.get("/v1/peer/layers/..%2F..%2Fetc%2Fpasswd")
        assert r.status_code in (400, 404)
        r = http.get("/v1/peer/layers/sha256:" + "0" * 64)
        assert r.status_code == 404


def test_a_volume_made_on_one_node_mounts_on_every_node_fetched_once(client, corral_cluster,
                                                                     tmp_path):
    nodes = corral_cluster.node_ids()
    (tmp_path / "rows").mkdir()
    (tmp_path / "rows" / "a.csv").write_text("1,2,3\n")
    big = os.urandom(2_000_000)
    (tmp_path / "big").write_bytes(big)
    name = f"travel-{time.time_ns() % 10**9}"
    corral.Volume.create(name, tmp_path, client=client)  # on the client's home node
    home = next(n for n in nodes if _volume_status(corral_cluster, n, name) == 200)
    b, c = (n for n in nodes if n != home)
    before_b, before_c = _stats(corral_cluster, b), _stats(corral_cluster, c)
    made = []
    try:
        for node, mode in ((b, "cow"), (b, "ro"), (c, "cow")):
            made.append(corral.Sandbox.create(memory_mb=64, tags=[TAG], node=node, client=client,
                                              volumes={"/data": f"{name}:{mode}"}))
        for sb in made:
            assert sb.files.read("/data/big") == big
        made[0].exec("echo mine > /data/rows/a.csv", timeout=30)  # cow: its own
        assert made[1].files.read("/data/rows/a.csv") == b"1,2,3\n"
        after_b, after_c = _stats(corral_cluster, b), _stats(corral_cluster, c)
        assert after_b["layers"] - before_b["layers"] == 1  # two sandboxes, one fetch
        assert after_b["bytes"] - before_b["bytes"] > len(big)
        assert after_c["layers"] - before_c["layers"] == 1
        with _daemon(corral_cluster, b) as http:
            assert http.get(f"/v1/volumes/{name}").json()["home"] == home
        # rw: the volume itself, so on its home (placed there), never on a copy
        made.append(corral.Sandbox.create(memory_mb=64, tags=[TAG], client=client,
                                          volumes={"/data": f"{name}:rw"}))
        assert made[-1].info.node == home
        with pytest.raises(corral.InvalidState, match="copy"):
            corral.Sandbox.create(memory_mb=64, tags=[TAG], node=b, client=client,
                                  volumes={"/data": f"{name}:rw"})
        for sb in made:
            sb.delete()
        made = []
        vol = corral.Volume.get(name, client=client)  # sent to its home, not to a copy:
        vol.upload(tmp_path / "rows" / "a.csv", "added.csv")
        vol.snapshot(f"{name}-1").delete()
        with _daemon(corral_cluster, home) as http:
            assert http.get(f"/v1/volumes/{name}").json()["files"] == 4
    finally:
        for sb in made:
            sb.delete()
        corral.Volume.get(name, client=client).delete()  # and its copies
    assert [_volume_status(corral_cluster, n, name) for n in nodes] == [404] * 3


def _volume_status(cluster, node: str, name: str) -> int:
    with _daemon(cluster, node) as http:
        return http.get(f"/v1/volumes/{name}").status_code


def test_a_pool_spread_over_every_node(client, corral_cluster):
    nodes = corral_cluster.node_ids()
    with corral.Pool(memory_mb=64, min_ready=3, max_size=6, spread=True, tags=[TAG],
                     client=client) as pool:
        stats = pool.wait_ready(timeout=120)
        assert (stats.min_ready, stats.max_size, stats.ready) == (3, 6, 3)  # 1 + 1 + 1
        got = [pool.acquire(timeout=60) for _ in range(3)]
        assert sorted(sb.info.node for sb in got) == nodes  # each from a node with one ready
        assert got[0].exec("echo spread", timeout=30).stdout == "spread\n"
        assert pool.stats().acquired == 3
        for sb in got:
            sb.delete()
        name = pool.name
    for node in nodes:  # closing it deleted every node's
        with _daemon(corral_cluster, node) as http:
            assert http.get(f"/v1/pools/{name}").status_code == 404
    with pytest.raises(corral.InvalidArgument, match="not both"):
        corral.Pool(memory_mb=64, spread=True, node=nodes[0], client=client)


# a process with 2 MB of heap and a counter: a copy that restored its memory goes on
LIVE_COUNTER = (
    "nohup python3 -c 'import time\nb = bytearray(range(256)) * (8 << 10)\ni = 0\n"
    "while True:\n    i += 1\n    open(\"/tmp/count\", \"w\").write(f\"{i} {sum(b)}\")\n"
    "    time.sleep(0.05)' >/dev/null 2>&1 &"
)


def _count(sb) -> tuple[int, int]:
    for _ in range(200):
        out = sb.exec(["cat", "/tmp/count"], timeout=30).stdout.split()
        if len(out) == 2:
            return int(out[0]), int(out[1])
        time.sleep(0.05)
    raise AssertionError("the counter never wrote")


def test_a_live_snapshot_taken_on_a_restores_on_b_with_its_processes(corral_cluster):
    """A tenant's live snapshot: its CRIU images cross once (digest-checked, as that
    tenant), land root-only on B, and the copy's process goes on counting with its heap
    intact; another tenant's fetch finds no such snapshot (docs/live.md)."""
    if criu.find(default_cache_dir()) is None:
        pytest.skip(f"no cached CRIU: {criu.BUILD}")
    a, b, c = corral_cluster.node_ids()
    alice, bob = unique("live"), unique("other")
    tokens = {n: make_tenant(corral_cluster, n) for n in (alice, bob)}
    with tenant_client(corral_cluster, tokens[alice]) as client:
        sb = corral.Sandbox.create(memory_mb=256, network="none", checkpointable=True,
                                   tags=[TAG], node=a, client=client)
        sb.exec(["sh", "-c", LIVE_COUNTER], timeout=30)
        before, heap = _count(sb)
        snap = sb.checkpoint(name=f"live-{sb.id[-6:]}")
        assert snap.info.kind == "live"
        images = corral_cluster.base / node_tag(b) / "state" / "checkpoints" / alice / snap.id
        fetched = _stats(corral_cluster, b)["bytes"]
        try:
            with on(daemons(corral_cluster)[c], tokens[bob]) as other:  # not bob's to fetch
                r = other.post("/v1/cluster/snapshots/fetch", json={"snapshot": snap.id, "node": a})
                assert r.status_code == 404 and r.json()["error"]["code"] == "snapshot_not_found"
            copy = snap.restore(node=b, tags=[TAG])
            assert copy.info.node == b
            assert images.stat().st_mode & 0o777 == 0o700 and images.stat().st_uid == 0
            assert all(f.stat().st_mode & 0o077 == 0 for f in images.iterdir())
            assert _stats(corral_cluster, b)["bytes"] - fetched > 1_000_000  # memory crossed
            n, copied_heap = _count(copy)
            assert n >= before and copied_heap == heap
            later = n
            for _ in range(200):  # and it keeps counting on B
                n, _ = _count(copy)
                if n > later:
                    break
                time.sleep(0.05)
            assert n > later
        finally:
            corral.Snapshot.get(snap.id, client=client).delete()
            for x in corral.Sandbox.list(tags=[TAG], client=client):
                x.delete()
    assert not images.exists()  # deleted with `corral snapshot rm` on every node
