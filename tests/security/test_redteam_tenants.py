"""Red-team attacks of a tenant holding a valid token against another tenant's data,
through surfaces where the daemon acts for itself (a pool's refills, background
work) or keeps data past a sandbox's life (logs, reports, counts)."""

from __future__ import annotations

import pytest

from tests.security.tenants_helpers import (
    ADMIN_TOKEN,
    no_traceback,
    sandbox_with_secret,
    team_daemon,
)


@pytest.fixture(scope="module")
def team():
    with team_daemon() as t:
        yield t


@pytest.fixture
def alice_snap(team):
    """alice's snapshot 'alice-snap' of a sandbox holding /workspace/secret."""
    with team.tenant("alice") as a:
        sid = sandbox_with_secret(a)
        snap = a.post(f"/v1/sandboxes/{sid}/snapshot", json={"name": "alice-snap"})
        assert snap.status_code in (200, 201), snap.text
    yield {"sid": sid, "snap": snap.json()["id"]}
    team.cleanup()
    no_traceback(team)


@pytest.mark.parametrize("ref", ["name", "id"])
def test_a_pool_cannot_start_from_another_tenants_snapshot(team, alice_snap, ref):
    """A pool's refills run as the daemon: the snapshot its spec names must be one its
    tenant may see, checked when the pool is made (and not found as the daemon later)."""
    snap = "alice-snap" if ref == "name" else alice_snap["snap"]
    with team.tenant("bob") as b:
        unknown = b.post("/v1/sandboxes", json={"memory_mb": 64, "snapshot": snap})
        assert unknown.status_code == 404, unknown.text
        made = b.post("/v1/pools", json={"name": "bob-pool", "spec": {
            "memory_mb": 64, "snapshot": snap}, "min_ready": 1, "max_size": 1})
        if made.status_code == 201:  # the attack's second half: what a refill holds
            got = b.post("/v1/pools/bob-pool/acquire", json={"timeout": 60})
            text = None
            if got.status_code == 200:
                sid = got.json()["id"]
                read = b.get(f"/v1/sandboxes/{sid}/files?path=/workspace/secret")
                text = read.content if read.status_code == 200 else None
            b.delete("/v1/pools/bob-pool")
            pytest.fail(f"bob's pool from alice's snapshot was made; its sandbox read {text!r}")
        assert made.status_code == 404, made.text
        assert made.json()["error"]["code"] == unknown.json()["error"]["code"]


def _report(name: str, mean: float) -> dict:
    return {"name": name, "state": "done", "done": 10, "total": 10, "n": 10, "mean": mean}


def test_evaluation_runs_are_their_reporters_own(team):
    """A tenant neither reads another's (or the admin's) evaluation runs nor overwrites
    them: a forged report would show on the admin's dashboard as the admin's run."""
    with team.tcp(ADMIN_TOKEN) as admin, team.tenant("alice") as a, team.tenant("bob") as b:
        assert admin.put("/v1/evals/ev-000000000000a0a0", json=_report("admin-policy", 0.1)
                         ).status_code == 200
        assert a.put("/v1/evals/ev-00000000000a11ce", json=_report("alice-policy", 0.2)
                     ).status_code == 200
        assert b.get("/v1/evals").json()["evals"] == []
        assert [r["name"] for r in a.get("/v1/evals").json()["evals"]] == ["alice-policy"]
        for eid in ("ev-000000000000a0a0", "ev-00000000000a11ce"):
            forged = b.put(f"/v1/evals/{eid}", json=_report("forged", 99.0))
            assert forged.status_code == 404, forged.text
        runs = {r["id"]: r for r in admin.get("/v1/evals").json()["evals"]}
        assert runs["ev-000000000000a0a0"]["mean"] == 0.1
        assert runs["ev-00000000000a11ce"]["mean"] == 0.2
        assert runs["ev-00000000000a11ce"]["owner"] == "alice"


def test_info_counts_only_the_tenants_own_sandboxes(team, alice_snap):
    """/v1/info tells a tenant how many sandboxes it has in each state, not how many
    the daemon runs for everyone."""
    with team.tenant("bob") as b, team.tenant("alice") as a, team.admin() as admin:
        assert sum(b.get("/v1/info").json()["counts"].values()) == 0
        assert a.get("/v1/info").json()["counts"]["running"] == 1
        assert admin.get("/v1/info").json()["counts"]["running"] >= 1


def test_a_deleted_sandboxs_logs_stay_its_tenants_alone(team):
    """logs.db keeps a deleted sandbox's owner: its tenant reads its logs for the
    retention period; another tenant's read answers like an unknown id, also after a
    restart of the daemon (the owner is on disk, not only in memory)."""
    with team.tenant("alice") as a:
        sid = a.post("/v1/sandboxes", json={"memory_mb": 64}).json()["id"]
        ran = a.post(f"/v1/sandboxes/{sid}/exec", json={"cmd": ["echo", "alice-output"]})
        assert ran.status_code == 200, ran.text
        assert a.delete(f"/v1/sandboxes/{sid}").status_code == 204
    path, unknown_path = f"/v1/sandboxes/{sid}/logs", "/v1/sandboxes/sb-0123456789ab/logs"
    for restart in (False, True):
        if restart:
            team.daemon.stop()
            team.daemon.start()
        with team.tenant("alice") as a, team.tenant("bob") as b, team.admin() as admin:
            mine = a.get(path)
            assert mine.status_code == 200, (restart, mine.text)
            assert "alice-output" in mine.text and mine.json()["entries"][-1]["event"] == "deleted"
            theirs, unknown = b.get(path), b.get(unknown_path)
            assert theirs.status_code == 404 and "alice-output" not in theirs.text
            assert theirs.text.replace(sid, "ID") == unknown.text.replace("sb-0123456789ab", "ID")
            assert b.get(path + "?follow=1").status_code == 404
            assert "alice-output" in admin.get(path).text


def test_a_cpu_quota_counts_the_cpus_a_sandbox_gets(team):
    """The kernel gives a sandbox at least 1 ms of CPU per 100 ms (0.01 CPU), whatever
    smaller ``cpus`` it asked: the quota counts what it gets, so asking 0.0001 CPU does
    not fit a hundred times more sandboxes under max_cpus."""
    team.make_token("carol", max_cpus=0.05)
    made, refused = [], None
    with team.tenant("carol") as c:
        try:
            for _ in range(8):  # bounded: 5 fit at 0.01 each
                reply = c.post("/v1/sandboxes", json={"memory_mb": 32, "cpus": 0.0001})
                if reply.status_code != 201:
                    refused = reply
                    break
                made.append(reply.json()["id"])
        finally:
            for sid in made:
                c.delete(f"/v1/sandboxes/{sid}")
    assert len(made) == 5, len(made)
    assert refused is not None and refused.json()["error"]["code"] == "quota_exceeded"


def test_a_tenant_cannot_make_pools_without_end(team):
    """Pools with min_ready 0 cost no quota, but each is a task and state in the daemon:
    a tenant's pools are bounded (429 quota_exceeded past the bound), other tenants and
    the admin unaffected."""
    from corral.runtime.pools import MAX_POOLS_PER_TENANT

    made, refused = 0, None
    with team.tenant("bob") as b:
        try:
            for i in range(MAX_POOLS_PER_TENANT + 1):  # bounded
                reply = b.post("/v1/pools", json={"name": f"bob-{i}", "spec": {"memory_mb": 32},
                                                  "min_ready": 0, "max_size": 1})
                if reply.status_code != 201:
                    refused = reply
                    break
                made += 1
            assert made == MAX_POOLS_PER_TENANT, made
            assert refused is not None and refused.status_code == 429, refused
            assert refused.json()["error"]["details"]["quota"] == "pools"
            with team.tenant("alice") as a:
                assert a.post("/v1/pools", json={"name": "alice-ok", "spec": {"memory_mb": 32},
                                                 "min_ready": 0, "max_size": 1}).status_code == 201
        finally:
            team.cleanup()
