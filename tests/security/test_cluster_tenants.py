"""Attacks of a tenant on a corral cluster (a real 3-node Ray cluster, shared with
tests/cluster): the daemon-to-daemon routes, the cluster's token, other tenants'
snapshots on other nodes, and a revoked token on each node, including one whose
daemon could not be told (it fails closed)."""

from __future__ import annotations

import os
import signal
import time

import pytest

import corral
from corral.cluster import _ray, auth
from tests.cluster.conftest import corral_cluster, ray_cluster  # noqa: F401 (the session's)
from tests.cluster.tenants_on_cluster import (
    admin_tokens,
    cli,
    daemons,
    entries,
    make_tenant,
    on,
    secrets,
    tenant_client,
    unique,
)

TAG = "test-security-cluster-tenants"


@pytest.fixture
def tenant(corral_cluster):  # noqa: F811
    name = unique("eve")
    token = make_tenant(corral_cluster, name)
    with tenant_client(corral_cluster, token) as client:
        yield name, token, client
        for sb in corral.Sandbox.list(tags=[TAG], client=client):
            sb.delete()


def _digests(url: str, admin: str, snap: str) -> list[str]:
    with on(url, admin) as http:
        desc = http.get(f"/v1/peer/snapshots/{snap}").raise_for_status().json()
    return [layer["digest"] for layer in desc["layers"]]


def test_a_tenant_token_is_refused_by_every_peer_route_on_every_node(corral_cluster, tenant):  # noqa: F811
    name, token, client = tenant
    a = corral_cluster.node_ids()[0]
    sb = corral.Sandbox.create(memory_mb=64, tags=[TAG], node=a, client=client)
    snap = sb.snapshot()
    urls = daemons(corral_cluster)
    digest = _digests(urls[a], admin_tokens(corral_cluster)[a], snap.id)[0]
    for url in urls.values():
        with on(url, token) as http:
            for method, path, body in (
                ("GET", f"/v1/peer/snapshots/{snap.id}", None),
                ("GET", f"/v1/peer/snapshots/{snap.id}?owner={name}", None),
                ("GET", f"/v1/peer/layers/{digest}", None),
                ("GET", "/v1/peer/images/python", None),
                ("GET", "/v1/peer/stats", None),
                ("POST", "/v1/peer/snapshots/fetch", {"snapshot": snap.id, "node": a}),
                ("POST", "/v1/peer/images/fetch", {"image": "python", "node": a}),
                ("POST", "/v1/peer/tenants/refresh", {"name": name}),
                ("POST", "/v1/tokens", {"name": unique("mine")}),
                ("GET", "/v1/tokens", None),
            ):
                reply = http.request(method, path, json=body)
                assert reply.status_code == 403, (method, path, reply.text)
                assert b"tar" not in reply.headers.get("content-type", "").encode()


def _expand(path: str, ids: dict[str, str]) -> str:
    for key, value in ids.items():
        path = path.replace("{" + key + "}", value)
    return path


def test_no_corral_route_gives_a_tenant_a_daemons_token(corral_cluster, tenant, monkeypatch):  # noqa: F811
    name, token, client = tenant
    read: list[str] = []
    real = _ray.kv_get
    monkeypatch.setattr(_ray, "kv_get", lambda gcs, key: (read.append(key), real(gcs, key))[1])
    with tenant_client(corral_cluster, token) as fresh:  # its client never reads the token
        sb = corral.Sandbox.create(memory_mb=64, tags=[TAG], client=fresh)
        proc = sb.exec("env; cat /proc/1/environ /proc/self/environ | tr '\\0' '\\n'", timeout=30)
        corral.Sandbox.list(tags=[TAG], client=fresh)
    assert read and not [k for k in read if k.startswith(auth.NODE_TOKEN_KEY)
                         or k in (auth.PEER_TOKEN_KEY, auth.LEGACY_TOKEN_KEY)]
    hidden = secrets(corral_cluster)
    assert len(hidden) == len(daemons(corral_cluster)) + 1
    assert not [h for h in hidden if h in proc.stdout + proc.stderr]
    sb = corral.Sandbox.connect(sb.id, client=client)
    snap = sb.snapshot(name="probe")
    pool = corral.Pool(name=unique("pool"), min_ready=0, max_size=1, client=client)
    ids = {"sandbox_id": sb.id, "id_or_name": snap.id, "name": pool.name, "digest": "0" * 64,
           "process_id": "p-0", "eval_id": "e-0"}
    with on(daemons(corral_cluster)[sb.info.node], admin_tokens(corral_cluster)[sb.info.node]
            ) as http:
        routes = http.get("/openapi.json").raise_for_status().json()["paths"]
    seen = 0
    for url in daemons(corral_cluster).values():
        with on(url, token) as http:
            for path, methods in routes.items():
                if "get" not in methods:
                    continue
                reply = http.get(_expand(path, ids), params={"path": "/"})
                body = reply.content + str(reply.headers).encode()
                assert not [h for h in hidden if h.encode() in body], path
                seen += 1
            listing = http.get("/v1/cluster/nodes").raise_for_status().json()["nodes"]
            assert {n["node_id"] for n in listing} == set(corral_cluster.node_ids())
            # key: the public key its daemon proves itself with (cluster/proof.py)
            assert all(set(n) <= {"node_id", "tag", "url", "alive", "capacity", "key"}
                       for n in listing)
    assert seen > 30
    pool.delete()
    snap.delete()


def _same_as_unknown(http, method: str, path: str, real: str, fake: str, **kw) -> None:
    """``real`` (another tenant's) answers exactly as ``fake`` (nothing's) does."""
    theirs = http.request(method, path.format(real), **kw)
    nothing = http.request(method, path.format(fake), **{
        k: ({**v, "snapshot": fake} if isinstance(v, dict) else v) for k, v in kw.items()})
    assert theirs.status_code == nothing.status_code, (path, theirs.text)
    assert theirs.text.replace(real, "X") == nothing.text.replace(fake, "X"), path


def test_probing_another_tenants_snapshot_ids_on_other_nodes_learns_nothing(
        corral_cluster, tenant):  # noqa: F811
    _, token, client = tenant
    a, b, c = corral_cluster.node_ids()
    sb = corral.Sandbox.create(memory_mb=64, tags=[TAG], node=a, client=client)
    sb.exec("echo secret > /tmp/s", timeout=30)
    snap = sb.snapshot(name=unique("hers"))
    snap.restore(node=b, tags=[TAG])  # copies on A and B; none on C
    fake = snap.id[:-6] + ("000000" if not snap.id.endswith("000000") else "111111")
    mallory = make_tenant(corral_cluster, unique("mallory"))
    urls = daemons(corral_cluster)
    for node in (a, b, c):
        with on(urls[node], mallory) as http:
            _same_as_unknown(http, "GET", "/v1/snapshots/{}", snap.id, fake)
            _same_as_unknown(http, "GET", "/v1/snapshots/{}", snap.name, "no-such-name")
            _same_as_unknown(http, "DELETE", "/v1/snapshots/{}", snap.id, fake)
            _same_as_unknown(http, "POST", "/v1/sandboxes", snap.id, fake,
                             json={"snapshot": snap.id, "tags": [TAG]})
            for holder in (a, b):
                _same_as_unknown(http, "POST", "/v1/cluster/snapshots/fetch", snap.id, fake,
                                 json={"snapshot": snap.id, "node": holder})
            assert snap.id not in http.get("/v1/snapshots").text
    with tenant_client(corral_cluster, mallory) as theirs:
        with pytest.raises(corral.SnapshotNotFound):
            corral.Sandbox.create(snapshot=snap.id, node=c, tags=[TAG], client=theirs)
        assert corral.Sandbox.list(tags=[TAG], client=theirs) == []
    again = snap.restore(node=c, tags=[TAG])  # still hers, untouched, everywhere
    assert again.exec("cat /tmp/s", timeout=30).stdout == "secret\n"
    snap.delete()


def _refused_everywhere(urls, token: str) -> None:
    for url in urls:
        with on(url, token) as http:
            assert http.get("/v1/sandboxes").status_code == 401
            assert http.get("/sandboxes", headers={"X-API-Key": token}).status_code == 401


def test_a_revoked_token_is_refused_on_each_node_and_its_pools_go(corral_cluster):  # noqa: F811
    name = unique("revoked")
    token = make_tenant(corral_cluster, name)
    with tenant_client(corral_cluster, token) as client:
        pool = corral.Pool(name="spread", min_ready=0, max_size=3, spread=True, client=client)
        assert pool.name == "spread"
    urls = daemons(corral_cluster).values()
    own = admin_tokens(corral_cluster)

    def pools_of_tenant() -> int:
        count = 0
        for node, url in daemons(corral_cluster).items():
            with on(url, own[node]) as http:
                pools = http.get("/v1/pools").raise_for_status().json()["pools"]
                count += sum(p["spec"].get("tenant") == name for p in pools)
        return count

    assert pools_of_tenant() == 3  # one on each node
    done = cli("token", "revoke", name, url=f"ray://{corral_cluster.address}")
    assert done.returncode == 0, done.stderr
    _refused_everywhere(urls, token)
    assert pools_of_tenant() == 0  # gone on every node


def test_a_node_that_cannot_be_told_of_a_revoke_refuses_the_token_anyway(corral_cluster):  # noqa: F811
    """Fail closed: a daemon frozen during the revoke is named, the revoke waits out the
    lease, and once thawed that daemon refuses the token before it reads anything."""
    name = unique("frozen")
    token = make_tenant(corral_cluster, name)
    node = corral_cluster.node_ids()[1]
    entry = entries(corral_cluster)[node]
    assert _status(entry["url"], token) == 200
    os.kill(entry["pid"], signal.SIGSTOP)  # our test cluster's daemon, by its pid
    try:
        began = time.monotonic()
        done = cli("token", "revoke", name, url=f"ray://{corral_cluster.address}")
        waited = time.monotonic() - began
    finally:
        os.kill(entry["pid"], signal.SIGCONT)
    assert done.returncode == 1
    assert node in done.stderr and "did not confirm" in done.stderr
    from corral.server.cluster_tenants import LEASE_S

    assert waited >= LEASE_S  # the lease was waited out, not a timing threshold
    assert _status(entry["url"], token) == 401  # at once after the thaw
    _refused_everywhere(daemons(corral_cluster).values(), token)


def _status(url: str, token: str) -> int:
    with on(url, token) as http:
        return http.get("/v1/sandboxes").status_code


def test_the_peer_credential_may_ask_for_a_registry_reload_and_nothing_new_else(corral_cluster):  # noqa: F811
    peer = secrets(corral_cluster)[-1]  # every daemon holds it: it must stay this narrow
    node, url = next(iter(daemons(corral_cluster).items()))
    with on(url, peer) as http:
        reloaded = http.post("/v1/peer/tenants/refresh", json={"name": None})
        assert reloaded.status_code == 200 and set(reloaded.json()) == {"tenants", "revoked"}
        for method, path, body in (
            ("GET", "/v1/cluster/nodes", None),
            ("POST", "/v1/cluster/snapshots/fetch", {"snapshot": "x", "node": node}),
            ("POST", "/v1/cluster/images/fetch", {"image": "python", "node": node}),
            ("POST", "/v1/tokens", {"name": unique("by-peer")}),
            ("GET", "/v1/tokens", None),
            ("DELETE", "/v1/tokens/anyone", None),
            ("GET", "/v1/peer/tenants/refresh", None),
            ("POST", "/v1/peer/tenants/refresh/", {"name": None}),
        ):
            reply = http.request(method, path, json=body)
            assert reply.status_code == 403, (method, path, reply.text)
