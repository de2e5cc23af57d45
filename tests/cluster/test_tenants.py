"""Tenants on a real 3-node Ray cluster: one registry for every node's daemon, tenants
that reach the cluster without its token (ray:// with CORRAL_TOKEN, or through one
daemon's URL), isolation on every node, quotas across nodes, revoke everywhere (a
daemon Ray restarted included), and a tenant's snapshot restored on another node."""

from __future__ import annotations

import concurrent.futures
import contextlib
import os
import signal
import subprocess
import sys
import textwrap

import httpx
import pytest

import corral
from tests.cluster.conftest import NODE_ARGS, until
from tests.cluster.tenants_on_cluster import (
    admin,
    cli,
    cli_json,
    cluster_urls,
    daemons,
    entries,
    make_tenant,
    on,
    tenant_client,
    unique,
)
from tests.security.test_door_revocation import END_S, TICK, follow

TAG = "test-cluster-tenants"


@pytest.fixture
def pair(corral_cluster):
    """Two tenants made through the cluster (one with the CLI), and their clients."""
    alice, bob = unique("alice"), unique("bob")
    made = cli_json("token", "create", alice, "--json", url=f"ray://{corral_cluster.address}")
    assert made["name"] == alice and made["token"].startswith("crl_")
    tokens = {alice: made["token"], bob: make_tenant(corral_cluster, bob)}
    clients = {n: tenant_client(corral_cluster, t) for n, t in tokens.items()}
    yield tokens, clients
    for c in clients.values():
        for sb in corral.Sandbox.list(tags=[TAG], client=c):
            sb.delete()
        c.close()


def test_a_token_made_through_the_cluster_works_on_every_node_and_sees_only_its_own(
        corral_cluster, pair):
    tokens, clients = pair
    alice, bob = clients
    nodes = corral_cluster.node_ids()
    mine = {n: [corral.Sandbox.create(memory_mb=64, tags=[TAG], node=node, client=c)
                for node in nodes] for n, c in clients.items()}
    for n in (alice, bob):
        assert [sb.info.node for sb in mine[n]] == nodes
        listed = {sb.id for sb in corral.Sandbox.list(tags=[TAG], client=clients[n])}
        assert listed == {sb.id for sb in mine[n]}  # all of its own, on every node; no other
    for node, url in daemons(corral_cluster).items():  # each daemon, asked directly
        with on(url, tokens[alice]) as http:
            ids = {s["id"] for s in http.get("/v1/sandboxes").raise_for_status().json()["sandboxes"]}
            assert ids == {sb.id for sb in mine[alice] if sb.info.node == node}
            for theirs in mine[bob]:
                assert http.get(f"/v1/sandboxes/{theirs.id}").status_code == 404
    for theirs in mine[bob]:  # through alice's cluster client: as if they did not exist
        with pytest.raises(corral.SandboxNotFound):
            corral.Sandbox.connect(theirs.id, client=clients[alice]).exec("true")
        with contextlib.suppress(corral.SandboxNotFound):  # as for an id that never was
            corral.Sandbox.connect(theirs.id, client=clients[alice]).delete()
    assert all(sb.exec("echo ok", timeout=30).stdout == "ok\n" for sb in mine[bob])
    url = f"ray://{corral_cluster.address}"
    ls = cli_json("ls", "--tag", TAG, "--json", url=url, token=tokens[alice])
    assert {s["id"] for s in ls} == {sb.id for sb in mine[alice]}
    assert {s["node"] for s in ls} == set(nodes)
    done = cli("rm", "--tag", TAG, "-y", url=url, token=tokens[alice])
    assert done.returncode == 0, done.stderr
    assert corral.Sandbox.list(tags=[TAG], client=clients[alice]) == []
    assert len(corral.Sandbox.list(tags=[TAG], client=clients[bob])) == 3  # untouched


def test_placement_spreads_a_tenants_sandboxes_over_the_cluster(corral_cluster, pair):
    _, clients = pair
    c = next(iter(clients.values()))
    made = [corral.Sandbox.create(memory_mb=32, tags=[TAG], client=c) for _ in range(6)]
    assert {sb.info.node for sb in made} == set(corral_cluster.node_ids())


def test_a_tenant_reaches_the_cluster_through_one_daemon_without_ray(corral_cluster, pair):
    """cluster+http://: no Ray in the client process at all (import ray fails there)."""
    tokens, _ = pair
    name = next(iter(tokens))
    seed = next(iter(cluster_urls(corral_cluster).values()))
    script = textwrap.dedent(f"""
        import sys
        sys.modules["ray"] = None  # importing Ray fails in this process
        import corral
        nodes = {corral_cluster.node_ids()!r}
        made = [corral.Sandbox.create(memory_mb=32, tags=["{TAG}"], node=n) for n in nodes]
        made.append(corral.Sandbox.create(memory_mb=32, tags=["{TAG}"]))  # placed
        assert [m.info.node for m in made[:3]] == nodes
        assert made[0].exec("echo hi", timeout=30).stdout == "hi\\n"
        print(sorted(s.id for s in corral.Sandbox.list(tags=["{TAG}"])))
        print(sorted(m.id for m in made))
    """)
    env = {**os.environ, "CORRAL_URL": seed, "CORRAL_TOKEN": tokens[name]}
    done = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True,
                          text=True, timeout=180)
    assert done.returncode == 0, done.stderr
    listed, made = done.stdout.splitlines()
    assert listed == made


def test_a_tenants_quota_holds_across_nodes(corral_cluster):
    a, b, c = corral_cluster.node_ids()
    name = unique("quota")
    token = make_tenant(corral_cluster, name, max_sandboxes=2, max_memory_mb=512)
    with tenant_client(corral_cluster, token) as client:
        try:
            first = corral.Sandbox.create(memory_mb=64, tags=[TAG], node=a, client=client)
            corral.Sandbox.create(memory_mb=64, tags=[TAG], node=a, client=client)
            for node in (b, c):  # at its quota on A: refused on B and C
                with pytest.raises(corral.QuotaExceeded) as refused:
                    corral.Sandbox.create(wait=0, memory_mb=64, tags=[TAG], node=node, client=client)
                assert refused.value.details["quota"] == "max_sandboxes"
                assert refused.value.details["used"] == 2
            first.delete()  # room again: on another node
            corral.Sandbox.create(memory_mb=64, tags=[TAG], node=b, client=client)
            with pytest.raises(corral.QuotaExceeded):
                corral.Sandbox.create(wait=0, memory_mb=64, tags=[TAG], node=c, client=client)
            for sb in corral.Sandbox.list(tags=[TAG], client=client):
                sb.delete()
            corral.Sandbox.create(memory_mb=256, tags=[TAG], node=a, client=client)
            with pytest.raises(corral.QuotaExceeded) as refused:  # memory, summed over nodes
                corral.Sandbox.create(wait=0, memory_mb=300, tags=[TAG], node=c, client=client)
            assert refused.value.details["quota"] == "max_memory_mb"
            with admin(corral_cluster) as ad:  # `token ls` shows the cluster's use
                use = {t["name"]: t["usage"] for t in ad.request("GET", "/v1/tokens").json()["tokens"]}
                ad.request("PATCH", f"/v1/tokens/{name}", json={"max_memory_mb": 1024})
            until(lambda: _created(client, c), "the raised quota on node C")  # within a refresh
        finally:
            for sb in corral.Sandbox.list(tags=[TAG], client=client):
                sb.delete()
    assert any(u.get("sandboxes") == 1 and u.get("memory_mb") == 256 for u in use.values())


def _created(client, node: str) -> bool:
    try:
        corral.Sandbox.create(wait=0, memory_mb=300, tags=[TAG], node=node, client=client)
    except corral.QuotaExceeded:
        return False
    return True


def test_concurrent_creates_on_three_nodes_never_pass_the_quota(corral_cluster):
    nodes = corral_cluster.node_ids()
    token = make_tenant(corral_cluster, unique("race"), max_sandboxes=3)
    with tenant_client(corral_cluster, token) as client:
        def one(node: str):
            try:
                return corral.Sandbox.create(wait=0, memory_mb=32, tags=[TAG], node=node, client=client)
            except corral.QuotaExceeded:
                return None

        try:
            with concurrent.futures.ThreadPoolExecutor(9) as pool:
                made = [m for m in pool.map(one, nodes * 3) if m is not None]
            assert 1 <= len(made) <= 3  # never more than the quota, whatever the race
            while len(corral.Sandbox.list(tags=[TAG], client=client)) < 3:  # the rest fits
                corral.Sandbox.create(memory_mb=32, tags=[TAG], node=nodes[0], client=client)
            with pytest.raises(corral.QuotaExceeded):
                corral.Sandbox.create(wait=0, memory_mb=32, tags=[TAG], node=nodes[-1], client=client)
        finally:
            for sb in corral.Sandbox.list(tags=[TAG], client=client):
                sb.delete()


def _status(url: str, token: str) -> int:
    with on(url, token) as http:
        return http.get("/v1/sandboxes").status_code


def test_revoke_through_the_cluster_ends_everything_on_every_node(corral_cluster):
    """Revoked on one node (the CLI's ray:// admin): every node refuses the token at once,
    the streams it held open on two nodes end, and (``--on-revoke stop``, the default)
    its sandboxes on every node stop."""
    carol = unique("carol")
    made = cli_json("token", "create", carol, "--json", url=f"ray://{corral_cluster.address}")
    token = made["token"]  # and how to reach the cluster outside Ray, a node's key pinned
    assert made["cluster_url"] in cluster_urls(corral_cluster).values()
    urls = daemons(corral_cluster)
    assert {_status(u, token) for u in urls.values()} == {200}
    nodes = corral_cluster.node_ids()[1:]  # two Ray-started nodes
    with tenant_client(corral_cluster, token) as c:
        sids = {n: corral.Sandbox.create(memory_mb=32, node=n, client=c).id for n in nodes}
    streaming = [httpx.Client(base_url=urls[n], timeout=None,
                              headers={"Authorization": f"Bearer {token}"}) for n in nodes]
    streams = [follow(lambda h=h, sid=sids[n]: h.stream(
        "POST", f"/v1/sandboxes/{sid}/exec/stream", json={"cmd": TICK, "timeout": 600}))
        for h, n in zip(streaming, nodes, strict=True)]
    done = cli("token", "revoke", carol, url=f"ray://{corral_cluster.address}")
    assert done.returncode == 0, done.stderr  # every node confirmed
    assert {_status(u, token) for u in urls.values()} == {401}  # no wait: at once
    for f in streams:
        assert f.ended.wait(END_S), "a stream on another node outlived the revoke"
    with admin(corral_cluster) as ad:
        for sid in sids.values():
            until(lambda sid=sid: ad.request("GET", f"/v1/sandboxes/{sid}").json()["state"]
                  == "stopped", "the revoked tenant's sandbox to stop")
            ad.request("DELETE", f"/v1/sandboxes/{sid}")
        listed = [t["name"] for t in ad.request("GET", "/v1/tokens").json()["tokens"]]
        assert carol not in listed
        with pytest.raises(corral.InvalidArgument, match="revoked"):  # the name stays taken
            ad.request("POST", "/v1/tokens", json={"name": carol})
    for h in streaming:
        h.close()


def test_a_daemon_ray_restarted_knows_the_cluster_tenants(corral_cluster):
    """A daemon killed and restarted by Ray loads the registry before it serves."""
    kept, gone = unique("kept"), unique("gone")
    kept_token, gone_token = make_tenant(corral_cluster, kept), make_tenant(corral_cluster, gone)
    node = corral_cluster.node_ids()[-1]
    before = entries(corral_cluster)[node]
    os.kill(before["pid"], signal.SIGKILL)  # our daemon of our test cluster, by its pid
    with admin(corral_cluster) as ad:  # revoked while that daemon is down
        ad.request("DELETE", f"/v1/tokens/{gone}")

    def restarted() -> str | None:
        entry = entries(corral_cluster).get(node)
        return entry["url"] if entry and entry["pid"] != before["pid"] else None

    url = until(restarted, "Ray to restart the daemon")
    until(lambda: _status(url, kept_token) == 200, "the restarted daemon to answer")
    assert _status(url, gone_token) == 401
    later = make_tenant(corral_cluster, unique("later"))  # made after: valid there too
    assert _status(url, later) == 200


def test_a_tenants_snapshot_restores_on_another_node_for_it_alone(corral_cluster, pair):
    tokens, clients = pair
    alice, bob = clients
    a, b, c = corral_cluster.node_ids()
    sb = corral.Sandbox.create(memory_mb=64, tags=[TAG], node=a, client=clients[alice])
    sb.exec("echo alice > /tmp/mine", timeout=30)
    snap = sb.snapshot(name="shared-name")
    copy = snap.restore(node=b, tags=[TAG])  # B fetches the layers from A, for alice
    assert copy.info.node == b
    assert copy.exec("cat /tmp/mine", timeout=30).stdout == "alice\n"
    by_name = corral.Snapshot.get("shared-name", client=clients[alice])  # hers, by name
    assert by_name.id == snap.id
    with pytest.raises(corral.SnapshotNotFound):  # bob: on any node, by id
        corral.Sandbox.create(snapshot=snap.id, node=c, tags=[TAG], client=clients[bob])
    with pytest.raises(corral.SnapshotNotFound):
        corral.Sandbox.create(snapshot=snap.id, node=b, tags=[TAG], client=clients[bob])
    theirs = corral.Sandbox.create(memory_mb=64, tags=[TAG], node=c, client=clients[bob])
    theirs.exec("echo bob > /tmp/mine", timeout=30)
    own = theirs.snapshot(name="shared-name")  # the same name: his own namespace
    assert own.id != snap.id
    mine_again = corral.Sandbox.create(snapshot="shared-name", node=c, tags=[TAG],
                                       client=clients[alice])  # hers travels to C
    assert mine_again.exec("cat /tmp/mine", timeout=30).stdout == "alice\n"
    for url in daemons(corral_cluster).values():
        with on(url, tokens[bob]) as http:
            assert http.get(f"/v1/snapshots/{snap.id}").status_code == 404
            assert http.delete(f"/v1/snapshots/{snap.id}").status_code in (204, 404)
    assert corral.Snapshot.get(snap.id, client=clients[alice]).id == snap.id  # still hers
    own.delete()
    snap.delete()


def test_a_tenants_lifetime_cap_and_image_pulls_on_every_node(corral_cluster):
    token = make_tenant(corral_cluster, unique("short"), max_lifetime=60)
    urls = daemons(corral_cluster)
    with tenant_client(corral_cluster, token) as client:
        for node in urls:  # its max-lifetime, from the one registry, on every node
            with pytest.raises(corral.InvalidArgument, match="lifetime"):
                corral.Sandbox.create(memory_mb=32, timeout=120, node=node, tags=[TAG],
                                      client=client)
    first = next(iter(urls))
    for url in urls.values():  # a tenant may ask a node to pull a built image (shared)
        with on(url, token) as http:
            pulled = http.post("/v1/cluster/images/fetch", json={"image": "python", "node": first})
            assert pulled.status_code == 200 and pulled.json()["name"] == "python"
            nowhere = http.post("/v1/cluster/images/fetch",
                                json={"image": "python-x", "node": "http://10.0.0.1:1"})
            assert nowhere.status_code == 400  # a node id from the directory, never a URL


def test_a_tenants_ray_task_gets_a_local_sandbox_and_uses_a_pickled_one(corral_cluster, pair):
    import ray
    from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

    tokens, clients = pair
    name = next(iter(tokens))

    @ray.remote(num_cpus=0)
    def make_here(token: str) -> tuple[str, str]:
        with corral.Client("ray://auto", token=token) as c:
            sb = corral.Sandbox.create(memory_mb=32, tags=[TAG], client=c)
            return ray.get_runtime_context().get_node_id(), sb.info.node

    @ray.remote(num_cpus=0)
    def run_in(sb: corral.Sandbox) -> tuple[str, str | None]:
        return sb.exec("echo from-task", timeout=30).stdout, sb.client.connect_args["token"]

    for node in corral_cluster.node_ids():  # locality holds for a tenant too
        pinned = NodeAffinitySchedulingStrategy(node, soft=False)
        here, placed = ray.get(make_here.options(scheduling_strategy=pinned).remote(tokens[name]),
                               timeout=120)
        assert here == node and placed == node
    sb = corral.Sandbox.create(memory_mb=32, tags=[TAG], client=clients[name])
    out, sent = ray.get(run_in.remote(sb), timeout=120)  # its handle carries its token
    assert (out, sent) == ("from-task\n", tokens[name])
    assert len(corral.Sandbox.list(tags=[TAG], client=clients[name])) == 4


def test_a_node_that_joins_later_knows_the_cluster_tenants(corral_cluster):
    kept, gone = unique("early"), unique("early-gone")
    kept_token, gone_token = make_tenant(corral_cluster, kept), make_tenant(corral_cluster, gone)
    with admin(corral_cluster) as ad:
        ad.request("DELETE", f"/v1/tokens/{gone}")
    before = set(corral_cluster.node_ids())
    node = corral_cluster.cluster.add_node(**NODE_ARGS)  # a fourth, for this test only
    try:
        joined = until(lambda: next((u for n, u in daemons(corral_cluster).items()
                                     if n not in before), None), "a daemon on the new node")
        until(lambda: _status(joined, kept_token) == 200, "the new daemon to answer")
        assert _status(joined, gone_token) == 401
    finally:
        corral_cluster.cluster.remove_node(node)
        until(lambda: set(corral_cluster.node_ids()) == before, "the fourth node to go")
