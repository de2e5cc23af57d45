"""Snapshot and pool names are per tenant: tenant bob neither learns that alice has a
snapshot or pool named ``x`` (his "x" is free, his lookup of "x" finds his own or
nothing, byte for byte like a name nobody holds) nor squats names alice will use.
The admin has its own namespace; by name it finds its own first, else the one
tenant's that holds the name, else (several tenants) an error listing their ids."""

from __future__ import annotations

import json
import sqlite3

import httpx
import pytest

from corral.runtime.registry import Registry, SnapshotRow
from corral.schema import SandboxSpec
from tests.security.tenants_helpers import ADMIN_TOKEN, no_traceback, team_daemon


@pytest.fixture(scope="module")
def team():
    with team_daemon() as t:
        yield t


@pytest.fixture
def clean(team):
    yield team
    for name in team.tokens:  # tenants' pools first: the admin cannot name a shared one
        with team.tenant(name) as c:
            for p in c.get("/v1/pools").json().get("pools", []):  # a revoked token: none
                c.delete(f"/v1/pools/{p['name']}")
    team.cleanup()
    no_traceback(team)


def _sandbox(client, content: bytes) -> str:
    reply = client.post("/v1/sandboxes", json={"memory_mb": 64})
    assert reply.status_code == 201, reply.text
    sid = reply.json()["id"]
    assert client.put(f"/v1/sandboxes/{sid}/files?path=/workspace/who",
                      content=content).status_code == 204
    return sid


def _snapshot(client, content: bytes, name: str) -> str:
    sid = _sandbox(client, content)
    snap = client.post(f"/v1/sandboxes/{sid}/snapshot", json={"name": name})
    assert snap.status_code in (200, 201), snap.text
    assert client.delete(f"/v1/sandboxes/{sid}").status_code in (200, 204)
    return snap.json()["id"]


def _restored(client, snapshot: str) -> bytes:
    """What /workspace/who holds in a sandbox restored from ``snapshot``."""
    made = client.post("/v1/sandboxes", json={"memory_mb": 64, "snapshot": snapshot})
    assert made.status_code == 201, made.text
    sid = made.json()["id"]
    read = client.get(f"/v1/sandboxes/{sid}/files?path=/workspace/who")
    assert read.status_code == 200, read.text
    client.delete(f"/v1/sandboxes/{sid}")
    return read.content


def _same_as_free(reply, free, name: str, free_name: str) -> None:
    assert reply.status_code == free.status_code, (reply.text, free.text)
    def masked(text: str, n: str) -> str:  # the name as quoted in messages and details
        return text.replace(f"'{n}'", "'N'").replace(f'"{n}"', '"N"')
    assert masked(reply.text, name) == masked(free.text, free_name)


def test_two_tenants_each_have_their_own_snapshot_x(clean):
    team = clean
    with team.tenant("alice") as a, team.tenant("bob") as b:
        # before bob has one, alice's name answers like a name nobody holds
        alice_x = _snapshot(a, b"alice", "x")
        _same_as_free(b.get("/v1/snapshots/x"), b.get("/v1/snapshots/free-name"),
                      "x", "free-name")
        _same_as_free(b.delete("/v1/snapshots/x"), b.delete("/v1/snapshots/free-name"),
                      "x", "free-name")
        bob_x = _snapshot(b, b"bob", "x")  # not "already exists": alice's is not his
        assert bob_x != alice_x
        assert a.get("/v1/snapshots/x").json()["id"] == alice_x
        assert b.get("/v1/snapshots/x").json()["id"] == bob_x
        assert [s["id"] for s in b.get("/v1/snapshots").json()["snapshots"]] == [bob_x]
        # restore by name: the caller's own
        assert _restored(a, "x") == b"alice" and _restored(b, "x") == b"bob"
        # "already exists" is about one's own namespace only, and names one's own id
        sid = _sandbox(b, b"bob again")
        again = b.post(f"/v1/sandboxes/{sid}/snapshot", json={"name": "x"})
        assert again.status_code == 409, again.text
        assert bob_x in again.text and alice_x not in again.text
        b.delete(f"/v1/sandboxes/{sid}")
        # delete by name: the caller's
        assert b.delete("/v1/snapshots/x").status_code in (200, 204)
        assert b.get("/v1/snapshots/x").status_code == 404
        assert a.get("/v1/snapshots/x").json()["id"] == alice_x
        assert _restored(a, "x") == b"alice"


def test_admin_names_its_own_first_then_a_single_tenants(clean):
    team = clean
    with team.tenant("alice") as a, team.tenant("bob") as b, team.admin() as admin:
        alice_x = _snapshot(a, b"alice", "x")
        assert admin.get("/v1/snapshots/x").json()["id"] == alice_x  # one holder
        bob_x = _snapshot(b, b"bob", "x")
        both = admin.get("/v1/snapshots/x")  # two tenants: ambiguous, by id instead
        assert both.status_code == 400, both.text
        assert alice_x in both.text and bob_x in both.text
        assert admin.delete("/v1/snapshots/x").status_code == 400
        assert admin.get(f"/v1/snapshots/{bob_x}").json()["id"] == bob_x
        admin_x = _snapshot(admin, b"admin", "x")  # the admin's own namespace
        assert len({admin_x, alice_x, bob_x}) == 3
        assert admin.get("/v1/snapshots/x").json()["id"] == admin_x
        assert _restored(admin, "x") == b"admin"
        assert b.get("/v1/snapshots/x").json()["id"] == bob_x  # tenants unaffected
        assert admin.delete("/v1/snapshots/x").status_code in (200, 204)
        assert a.get("/v1/snapshots/x").json()["id"] == alice_x
        assert b.get("/v1/snapshots/x").json()["id"] == bob_x


def _pool(client, name: str):
    return client.post("/v1/pools", json={"name": name, "spec": {"memory_mb": 64},
                                          "min_ready": 0, "max_size": 2})


def _acquired_by(client, pool: str) -> str:
    got = client.post(f"/v1/pools/{pool}/acquire", json={"timeout": 60})
    assert got.status_code == 200, got.text
    return got.json()["id"]


def test_two_tenants_each_have_their_own_pool_x(clean):
    team = clean
    with team.tenant("alice") as a, team.tenant("bob") as b:
        assert _pool(a, "x").status_code == 201
        _same_as_free(b.get("/v1/pools/x"), b.get("/v1/pools/free-name"), "x", "free-name")
        _same_as_free(b.post("/v1/pools/x/acquire", json={"timeout": 1}),
                      b.post("/v1/pools/free-name/acquire", json={"timeout": 1}),
                      "x", "free-name")
        made = _pool(b, "x")  # not "already exists": alice's is not his
        assert made.status_code == 201, made.text
        assert made.json()["spec"]["tenant"] == "bob"
        assert a.get("/v1/pools/x").json()["spec"]["tenant"] == "alice"
        assert b.get("/v1/pools/x").json()["spec"]["tenant"] == "bob"
        assert [p["name"] for p in b.get("/v1/pools").json()["pools"]] == ["x"]
        # acquire by name: a sandbox of the caller's own pool
        a_sid, b_sid = _acquired_by(a, "x"), _acquired_by(b, "x")
        assert a.get(f"/v1/sandboxes/{a_sid}").json()["spec"]["tenant"] == "alice"
        assert b.get(f"/v1/sandboxes/{b_sid}").json()["spec"]["tenant"] == "bob"
        assert b.get(f"/v1/sandboxes/{a_sid}").status_code == 404
        again = _pool(b, "x")  # his own: taken
        assert again.status_code == 409, again.text
        with team.tcp(ADMIN_TOKEN) as admin:  # one series per pool, not two named "x"
            text = admin.get("/metrics").text
        assert 'corral_pool_ready{pool="alice/x"}' in text
        assert 'corral_pool_ready{pool="bob/x"}' in text
        # delete by name: the caller's
        assert b.delete("/v1/pools/x").status_code == 204
        assert b.get("/v1/pools/x").status_code == 404
        assert a.get("/v1/pools/x").json()["spec"]["tenant"] == "alice"
        assert _acquired_by(a, "x")


def test_admin_pools_own_first_then_a_single_tenants(clean):
    team = clean
    with team.tenant("alice") as a, team.tenant("bob") as b, team.admin() as admin:
        assert _pool(a, "x").status_code == 201
        assert admin.get("/v1/pools/x").json()["spec"]["tenant"] == "alice"
        assert _pool(b, "x").status_code == 201
        both = admin.get("/v1/pools/x")
        assert both.status_code == 400, both.text
        assert "alice" in both.text and "bob" in both.text
        assert admin.delete("/v1/pools/x").status_code == 400  # deletes neither
        assert len(admin.get("/v1/pools").json()["pools"]) == 2
        assert _pool(admin, "x").status_code == 201  # the admin's own namespace
        assert admin.get("/v1/pools/x").json()["spec"]["tenant"] is None
        sid = _acquired_by(admin, "x")
        assert admin.get(f"/v1/sandboxes/{sid}").json()["spec"]["tenant"] is None
        assert admin.delete("/v1/pools/x").status_code == 204
        assert a.get("/v1/pools/x").json()["spec"]["tenant"] == "alice"
        assert b.get("/v1/pools/x").json()["spec"]["tenant"] == "bob"


def test_revoking_a_tenant_deletes_its_pools_not_others_of_the_same_name(clean):
    team = clean
    team.make_token("carol")
    with team.tenant("alice") as a, team.tenant("carol") as c, team.admin() as admin:
        for client in (a, c, admin):
            assert _pool(client, "x").status_code == 201
        assert admin.delete("/v1/tokens/carol").status_code == 204
        owners = sorted(str(p["spec"]["tenant"]) for p in admin.get("/v1/pools").json()["pools"])
        assert owners == ["None", "alice"]
        assert a.get("/v1/pools/x").json()["spec"]["tenant"] == "alice"
    del team.tokens["carol"]


# ---------------------------------------------------------------- migration

_OLD_SCHEMA = """
CREATE TABLE snapshots (
    id TEXT PRIMARY KEY, name TEXT, image TEXT NOT NULL, image_digest TEXT NOT NULL,
    layers TEXT NOT NULL, created_at REAL NOT NULL, size INTEGER NOT NULL,
    source_sandbox TEXT, spec TEXT NOT NULL, deleted INTEGER NOT NULL DEFAULT 0,
    users INTEGER NOT NULL DEFAULT 0
);
CREATE UNIQUE INDEX snapshots_name ON snapshots(name) WHERE deleted = 0;
"""


def _row(sid: str, name: str, tenant: str | None) -> SnapshotRow:
    return SnapshotRow(id=sid, name=name, image="base", image_digest="d", layers=[f"L{sid}"],
                       created_at=1.0, size_bytes=1, source_sandbox=None,
                       spec=SandboxSpec.parse({"tenant": tenant}))


def test_a_registry_of_one_namespace_is_migrated(tmp_path):
    """A registry made when names were one namespace: its rows get their owner from
    their spec, and the index becomes per owner."""
    path = tmp_path / "registry.db"
    old = sqlite3.connect(path)
    old.executescript(_OLD_SCHEMA)
    for sid, name, tenant in (("snap-a", "x", "alice"), ("snap-n", "y", None)):
        spec = SandboxSpec.parse({"tenant": tenant}).model_dump_json()
        old.execute("INSERT INTO snapshots VALUES (?, ?, 'base', 'd', ?, 1.0, 1, NULL, ?, 0, 0)",
                    (sid, name, json.dumps([f"L{sid}"]), spec))
    old.commit()
    with pytest.raises(sqlite3.IntegrityError):  # the old rule: one namespace
        old.execute("INSERT INTO snapshots VALUES ('snap-b', 'x', 'base', 'd', '[]', 1.0, 1, "
                    "NULL, '{}', 0, 0)")
    old.close()
    reg = Registry(path)
    try:
        owners = dict(reg.db.execute("SELECT id, tenant FROM snapshots"))
        assert owners == {"snap-a": "alice", "snap-n": ""}
        reg.add_snapshot(_row("snap-b", "x", "bob"), ("Lsnap-b", "d", 1))  # bob's own "x"
        reg.add_snapshot(_row("snap-m", "x", None), ("Lsnap-m", "d", 1))  # the admin's
        with pytest.raises(sqlite3.IntegrityError):
            reg.add_snapshot(_row("snap-c", "x", "alice"), ("Lsnap-c", "d", 1))
        with pytest.raises(sqlite3.IntegrityError):
            reg.add_snapshot(_row("snap-o", "y", None), ("Lsnap-o", "d", 1))
        assert sorted(r.id for r in reg.named("x")) == ["snap-a", "snap-b", "snap-m"]
    finally:
        reg.close()
    again = Registry(path)  # reopening migrates nothing twice
    try:
        assert len(again.named("x")) == 3
        indexes = {r[0] for r in again.db.execute(
            "SELECT name FROM sqlite_master WHERE type='index' AND tbl_name='snapshots'")}
        assert "snapshots_name" not in indexes and "snapshots_tenant_name" in indexes
    finally:
        again.close()


# ------------------------------------------------------- a front-end's pools

def test_a_tenant_cannot_squat_the_admins_sandboxfusion_pool():
    """SandboxFusion names the admin's pool of a shape ``sandboxfusion-python-64``:
    bob's pool of that name is his own, and the admin's request neither runs in his
    sandbox nor is refused; it gets (and makes) a pool of the admin's own."""
    from tests.server.conftest import uds_client
    from tests.server.test_compat_sandboxfusion import serving, verl_request

    with serving() as d:
        with uds_client(d.socket) as admin:
            made = admin.post("/v1/tokens", json={"name": "bob"})
            assert made.status_code == 201, made.text
            bob_token = made.json()["token"]
            with httpx.Client(base_url=f"http://127.0.0.1:{d.port}", timeout=120,
                              headers={"Authorization": f"Bearer {bob_token}"}) as b:
                squat = b.post("/v1/pools", json={
                    "name": "sandboxfusion-python-64", "min_ready": 1, "max_size": 1,
                    "spec": {"image": "python", "memory_mb": 64}})
                assert squat.status_code == 201, squat.text
                r = verl_request(d, memory_limit_MB=64, stdin="ab")
                assert (r.json().get("run_result") or {}).get("stdout") == "ba\n", r.text
                mine = b.get("/v1/pools/sandboxfusion-python-64").json()
                assert mine["acquires"] == 0 and mine["spec"]["tenant"] == "bob"
                owners = sorted(str(p["spec"]["tenant"]) for p in
                                admin.get("/v1/pools").json()["pools"])
                assert owners == ["None", "bob"]
                assert b.delete("/v1/pools/sandboxfusion-python-64").status_code == 204
        assert "Traceback" not in d.log.read_text(errors="replace")
