"""Tenants: a tenant token sees and touches only its own sandboxes, snapshots, pools
and processes, through the native HTTP API (the SDK and the CLI: test_tenants_sdk.py,
the compatibility front-ends: test_tenants_compat.py). Another tenant's id answers
exactly like an id that never existed. The admin (Unix socket, daemon token) sees all.
"""

from __future__ import annotations

import asyncio
import json
import time

import httpx
import pytest

from tests.conftest import stored_bytes
from tests.security.tenants_helpers import (
    ADMIN_TOKEN,
    UNKNOWN,
    no_traceback,
    sandbox_with_secret,
    team_daemon,
    unknown_like,
)


@pytest.fixture(scope="module")
def team():
    with team_daemon("--log-format", "json") as t:
        yield t


@pytest.fixture
def alice_sb(team):
    """A running sandbox of alice's with a file, a snapshot, a pool and a process."""
    with team.tenant("alice") as a:
        sid = sandbox_with_secret(a)
        proc = a.post(f"/v1/sandboxes/{sid}/processes", json={"cmd": ["sleep", "600"]}).json()
        snap = a.post(f"/v1/sandboxes/{sid}/snapshot", json={"name": "alice-snap"}).json()
        pool = a.post("/v1/pools", json={"name": "alice-pool", "spec": {"memory_mb": 64},
                                         "min_ready": 0, "max_size": 1})
        assert pool.status_code == 201, pool.text
    yield {"sid": sid, "proc": proc["id"], "snap": snap["id"]}
    team.cleanup()
    no_traceback(team)


def _sandbox_attacks(sid: str, proc: str) -> list[tuple[str, str, dict]]:
    sb, p = f"/v1/sandboxes/{sid}", f"/v1/sandboxes/{sid}/processes/{proc}"
    return [
        ("GET", sb, {}),
        ("POST", sb + "/exec", {"json": {"cmd": ["touch", "/workspace/pwned"]}}),
        ("POST", sb + "/exec/stream", {"json": {"cmd": ["touch", "/workspace/pwned"]}}),
        ("PUT", sb + "/files?path=/workspace/secret", {"content": b"bob was here"}),
        ("GET", sb + "/files?path=/workspace/secret", {}),
        ("DELETE", sb + "/files?path=/workspace/secret", {}),
        ("GET", sb + "/files/list?path=/workspace", {}),
        ("GET", sb + "/files/stat?path=/workspace/secret", {}),
        ("POST", sb + "/files/mkdir", {"json": {"path": "/workspace/d"}}),
        ("POST", sb + "/snapshot", {"json": {}}),
        ("POST", sb + "/fork", {"json": {"n": 1}}),
        ("POST", sb + "/pause", {}),
        ("POST", sb + "/resume", {}),
        ("POST", sb + "/kill-processes", {}),
        ("POST", sb + "/stop", {"json": {}}),
        ("POST", sb + "/processes", {"json": {"cmd": ["touch", "/workspace/pwned"]}}),
        ("GET", sb + "/processes", {}),
        ("GET", p, {}),
        ("POST", p + "/stdin", {"content": b"x"}),
        ("GET", p + "/output", {}),
        ("POST", p + "/exchange", {"content": b"x\n"}),
        ("POST", p + "/signal", {"json": {"signal": "KILL"}}),
        ("POST", p + "/resize", {"json": {"rows": 10, "cols": 10}}),
        ("DELETE", p, {}),
        ("GET", sb + "/logs", {}),
        ("GET", sb + "/logs?follow=1", {}),
        ("PATCH", sb, {"json": {"timeout": 5}}),
        ("DELETE", sb, {}),
    ]


def test_another_tenants_sandbox_is_an_unknown_id(team, alice_sb):
    sid, proc = alice_sb["sid"], alice_sb["proc"]
    with team.tenant("bob") as b:
        assert sid not in {s["id"] for s in b.get("/v1/sandboxes").json()["sandboxes"]}
        for (method, path, kw), (_, unknown_path, ukw) in zip(
            _sandbox_attacks(sid, proc), _sandbox_attacks(UNKNOWN, proc), strict=True
        ):
            reply = b.request(method, path, **kw)
            unknown = b.request(method, unknown_path, **ukw)
            unknown_like(reply, sid, unknown)
            assert reply.status_code in (404, 204), (method, path, reply.text)
        items = [{"sandbox_id": sid, "process_id": proc, "data": "x\n"}]
        many = b.post("/v1/processes/exchange", json={"items": items, "timeout": 1})
        assert many.json()["results"][0]["error"]["code"] == "sandbox_not_found"
    with team.tenant("alice") as a:  # nothing of alice's was touched
        info = a.get(f"/v1/sandboxes/{sid}").json()
        assert info["state"] == "running" and info["spec"]["tenant"] == "alice"
        assert a.get(f"/v1/sandboxes/{sid}/files?path=/workspace/secret").content == b"alice's"
        listed = a.get(f"/v1/sandboxes/{sid}/files/list?path=/workspace").json()["entries"]
        assert "pwned" not in {e["name"] for e in listed}
        assert a.get(f"/v1/sandboxes/{sid}/processes/{proc}").json()["state"] == "running"
        assert len(a.get("/v1/sandboxes").json()["sandboxes"]) == 1  # no fork landed
        assert a.get(f"/v1/sandboxes/{sid}/logs").status_code == 200
        # stopped, its files kept: still alice's alone
        assert a.post(f"/v1/sandboxes/{sid}/stop", json={}).status_code == 200
        assert a.get(f"/v1/sandboxes/{sid}/files?path=/workspace/secret").content == b"alice's"
    with team.tenant("bob") as b:
        for path in (f"/v1/sandboxes/{sid}/files?path=/workspace/secret",
                     f"/v1/sandboxes/{sid}/files/list?path=/workspace", f"/v1/sandboxes/{sid}/logs"):
            unknown_like(b.get(path), sid, b.get(path.replace(sid, UNKNOWN)))


def test_another_tenants_snapshots_and_pools_are_unknown(team, alice_sb):
    snap = alice_sb["snap"]
    with team.tenant("bob") as b:
        assert b.get("/v1/snapshots").json()["snapshots"] == []
        assert b.get("/v1/pools").json()["pools"] == []
        for ref in (snap, "alice-snap"):
            reply, unknown = b.get(f"/v1/snapshots/{ref}"), b.get("/v1/snapshots/snap-nothing")
            assert reply.status_code == 404
            assert reply.text.replace(ref, "X") == unknown.text.replace("snap-nothing", "X")
            assert b.delete(f"/v1/snapshots/{ref}").status_code == 204  # idempotent: as if none
            made = b.post("/v1/sandboxes", json={"snapshot": ref, "memory_mb": 64})
            assert made.status_code == 404 and made.json()["error"]["code"] == "snapshot_not_found"
        for method, suffix, kw in (("GET", "", {}), ("POST", "/acquire", {"json": {}}),
                                   ("DELETE", "", {})):
            reply = b.request(method, f"/v1/pools/alice-pool{suffix}", **kw)
            unknown = b.request(method, f"/v1/pools/no-pool{suffix}", **kw)
            assert reply.status_code == unknown.status_code in (404, 204), reply.text
            assert reply.text.replace("alice-pool", "X") == unknown.text.replace("no-pool", "X")
    with team.tenant("alice") as a:
        assert [s["id"] for s in a.get("/v1/snapshots").json()["snapshots"]] == [snap]
        assert [p["name"] for p in a.get("/v1/pools").json()["pools"]] == ["alice-pool"]
        acquired = a.post("/v1/pools/alice-pool/acquire", json={}).json()
        assert acquired["spec"]["tenant"] == "alice"


def test_the_admin_sees_all_and_filters_by_tenant(team, alice_sb):
    with team.tenant("bob") as b:
        bob_sid = b.post("/v1/sandboxes", json={"memory_mb": 64}).json()["id"]
    for admin in (team.admin(), team.tcp(ADMIN_TOKEN)):
        with admin:
            everyone = {s["id"]: s["spec"]["tenant"] for s in
                        admin.get("/v1/sandboxes").json()["sandboxes"]}
            assert everyone == {alice_sb["sid"]: "alice", bob_sid: "bob"}
            only = admin.get("/v1/sandboxes", params={"tenant": "bob"}).json()["sandboxes"]
            assert [s["id"] for s in only] == [bob_sid]
            assert admin.get(f"/v1/sandboxes/{alice_sb['sid']}").status_code == 200
            assert len(admin.get("/v1/snapshots").json()["snapshots"]) == 1
    with team.tenant("bob") as b:  # a tenant cannot claim another's name for a sandbox
        made = b.post("/v1/sandboxes", json={"memory_mb": 64, "tenant": "alice"}).json()
        assert made["spec"]["tenant"] == "bob"


def test_a_tenant_cannot_manage_tokens_or_images(team):
    with team.tenant("bob") as b:
        for method, path, kw in (("GET", "/v1/tokens", {}), ("DELETE", "/v1/tokens/alice", {}),
                                 ("POST", "/v1/tokens", {"json": {"name": "mallory"}}),
                                 ("DELETE", "/v1/images/python", {}),
                                 ("POST", "/v1/images/build", {"json": {"name": "x", "base": "python"}}),
                                 ("POST", "/v1/images/import?name=x", {"content": b"x"})):
            reply = b.request(method, path, **kw)
            assert reply.status_code == 403, (path, reply.text)
            assert reply.json()["error"]["code"] == "forbidden"
        assert b.get("/v1/images/python").status_code == 200  # shared read-only
        for path in ("/v1/peer/stats", "/v1/peer/layers/" + "0" * 64,
                     "/v1/peer/snapshots/x", "/v1/peer/images/python"):
            assert b.get(path).status_code == 403, path  # daemon to daemon: the admin's
    with team.tcp(ADMIN_TOKEN) as admin:  # the daemon's own token is the admin on TCP
        assert admin.get("/v1/tokens").status_code == 200
    token = team.make_token("imager", allow_images=True)
    with team.tcp(token) as c:  # granted: gets past the rights check
        assert c.delete("/v1/images/no-such-image").status_code == 204


def test_a_revoked_token_is_refused_at_once(team):
    token = team.make_token("shortlived")
    with team.tcp(token) as c:
        sid = c.post("/v1/sandboxes", json={"memory_mb": 64}).json()["id"]
        assert c.post("/v1/pools", json={"name": "shortlived-pool", "spec": {"memory_mb": 32},
                                         "min_ready": 1, "max_size": 2}).status_code == 201
        assert c.get("/v1/sandboxes").status_code == 200
        with team.admin() as admin:
            assert admin.delete("/v1/tokens/shortlived").status_code == 204
        for path in ("/v1/sandboxes", f"/v1/sandboxes/{sid}"):
            reply = c.get(path)  # the same connection, the very next request
            assert reply.status_code == 401 and reply.json()["error"]["code"] == "unauthorized"
    with team.admin() as admin:  # its sandbox stays, the admin's to delete; its pool goes
        assert admin.get(f"/v1/sandboxes/{sid}").json()["spec"]["tenant"] == "shortlived"
        assert admin.get("/v1/pools/shortlived-pool").status_code == 404
        assert admin.delete(f"/v1/sandboxes/{sid}").status_code == 204
        assert admin.delete("/v1/tokens/shortlived").status_code == 404


def test_tokens_are_stored_hashed(team):
    token = team.make_token("hashed")
    # (the walk skips what vanishes under it: tests.conftest.stored_bytes)
    raw = b"".join(data for _path, data in stored_bytes(team.daemon.state_dir, "registry.db*"))
    assert token.encode() not in raw
    assert token[4:].encode() not in raw
    with team.admin() as admin:
        listed = admin.get("/v1/tokens").json()["tokens"]
        assert "hashed" in {t["name"] for t in listed}
        assert token not in admin.get("/v1/tokens").text


# ------------------------------------------------------------------ quotas


def test_quota_race_admits_exactly_the_quota(team):
    token = team.make_token("racer", max_sandboxes=5)

    async def race() -> list[httpx.Response]:
        async with httpx.AsyncClient(base_url=team.url, timeout=300,
                                     headers={"Authorization": f"Bearer {token}"}) as c:
            return await asyncio.gather(
                *(c.post("/v1/sandboxes", json={"memory_mb": 32}) for _ in range(20))
            )

    try:
        replies = asyncio.run(race())
        codes = sorted(r.status_code for r in replies)
        assert codes == [201] * 5 + [429] * 15, [r.text for r in replies if r.status_code >= 500]
        refused = next(r for r in replies if r.status_code == 429).json()["error"]
        assert refused["code"] == "quota_exceeded"
        assert refused["details"]["quota"] == "max_sandboxes"
        assert refused["details"]["limit"] == 5 and refused["details"]["used"] == 5
        assert "max_sandboxes" in refused["message"] and "5" in refused["message"]
        with team.tcp(token) as c:
            assert len(c.get("/v1/sandboxes").json()["sandboxes"]) == 5
            one = c.get("/v1/sandboxes").json()["sandboxes"][0]["id"]
            assert c.delete(f"/v1/sandboxes/{one}").status_code == 204  # room again
            assert c.post("/v1/sandboxes", json={"memory_mb": 32}).status_code == 201
    finally:
        team.cleanup()


def test_memory_and_cpu_quotas_and_pools_count(team):
    token = team.make_token("sized", max_memory_mb=210, max_cpus=2)
    try:
        with team.tcp(token) as c:
            assert c.post("/v1/sandboxes", json={"memory_mb": 128, "cpus": 1}).status_code == 201
            over = c.post("/v1/sandboxes", json={"memory_mb": 128, "cpus": 0.5})
            assert over.status_code == 429
            details = over.json()["error"]["details"]
            assert details.items() >= {"quota": "max_memory_mb", "limit": 210, "used": 128,
                                       "tenant": "sized"}.items()
            assert c.post("/v1/sandboxes", json={"memory_mb": 64, "cpus": 1}).status_code == 201
            cpu = c.post("/v1/sandboxes", json={"memory_mb": 16, "cpus": 0.5})
            assert cpu.status_code == 429 and cpu.json()["error"]["details"]["quota"] == "max_cpus"
            # bob deleting one of sized's (an unknown id to him) gives sized no room
            sid = c.get("/v1/sandboxes").json()["sandboxes"][0]["id"]
            with team.tenant("bob") as b:
                assert b.delete(f"/v1/sandboxes/{sid}").status_code == 204
            assert c.post("/v1/sandboxes", json={"memory_mb": 16, "cpus": 0.5}).status_code == 429
        team.cleanup()
        pooled = team.make_token("pooled", max_sandboxes=2)
        with team.tcp(pooled) as c:
            made = c.post("/v1/pools", json={"name": "p2", "spec": {"memory_mb": 32},
                                             "min_ready": 2, "max_size": 4})
            assert made.status_code == 201, made.text
            deadline = time.monotonic() + 120
            while c.get("/v1/pools/p2").json()["ready"] < 2 and time.monotonic() < deadline:
                time.sleep(0.2)
            assert c.get("/v1/pools/p2").json()["ready"] == 2
            over = c.post("/v1/sandboxes", json={"memory_mb": 32})  # the pool holds the quota
            assert over.status_code == 429 and over.json()["error"]["code"] == "quota_exceeded"
        with team.admin() as admin:
            usage = {t["name"]: t["usage"] for t in admin.get("/v1/tokens").json()["tokens"]}
            assert usage["pooled"]["sandboxes"] == 2
    finally:
        team.cleanup()


def test_token_names_and_quotas_are_checked(team):
    with team.admin() as admin:
        for body in ({"name": "Bad Name"}, {"name": ""}, {"name": "x", "max_sandboxes": -1},
                     {"name": "x", "max_cpus": "2"}, {"name": "x", "extra": 1}):
            reply = admin.post("/v1/tokens", json=body)
            assert reply.status_code == 400, (body, reply.text)
        assert admin.post("/v1/tokens", json={"name": "bob"}).status_code == 400  # taken
        assert admin.delete("/v1/tokens/nobody").status_code == 404


def test_metrics_and_the_access_log_name_the_tenant(team, alice_sb):
    with team.admin() as admin:
        text = admin.get("/metrics").text
    assert 'corral_tenant_sandboxes{tenant="alice"} 1.0' in text
    with team.tenant("bob") as b:  # the whole host's figures are the admin's
        assert b.get("/metrics").status_code == 403
    lines = [json.loads(line) for line in team.daemon.log.read_text().splitlines()
             if line.startswith("{")]
    access = [r for r in lines if r.get("logger") == "corral.access"]
    assert {"alice", "bob", "admin"} <= {r["tenant"] for r in access}
    assert any(r["tenant"] == "alice" and r["route"] == "/v1/sandboxes" and r["status"] == 201
               for r in access)
