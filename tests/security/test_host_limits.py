"""A tenant cannot exhaust the host around its quota: an image build is admitted like
a sandbox (its tenant's quota, the host's committed memory, builds at once per tenant
and per host), snapshots count against ``max_snapshot_mb`` from their real layer
sizes, and a daemon restart hands nobody a fresh quota. Real daemon, real builds."""

from __future__ import annotations

import json
import os
import shutil
import sqlite3
import threading

import httpx
import pytest

from tests.conftest import ROOT_REASON, Daemon, _base_dir, have_root_runtime
from tests.security.tenants_helpers import ADMIN_TOKEN, Team, no_traceback
from tests.server.conftest import free_port


@pytest.fixture(scope="module")
def team():
    if not have_root_runtime():
        pytest.skip(ROOT_REASON)
    port = free_port()
    d = Daemon(_base_dir(), ["--tcp", f"127.0.0.1:{port}", "--token", ADMIN_TOKEN,
                             "--max-memory-mb", "4096", "--max-builds", "2"])
    d.start()
    t = Team(d, port)
    try:
        t.make_token("builder", allow_images=True, max_memory_mb=512, max_cpus=1.0)
        t.make_token("spender", allow_images=True, max_builds=1)
        t.make_token("hoarder", max_snapshot_mb=2)
        yield t
    finally:
        d.stop()
        shutil.rmtree(d.base, ignore_errors=True)


def _spec(run: str = "true", **extra) -> dict:
    nonce = os.urandom(4).hex()  # a step never built before: the build cache is host-wide
    return {"spec": {"base": "python", "memory_mb": 256, "steps": [{"run": f"{run}; : {nonce}"}],
                     **extra}, "name": f"hl-{nonce}"}


def _build(client: httpx.Client, body: dict) -> tuple[int, list[dict], dict]:
    with client.stream("POST", "/v1/images/build", json=body, timeout=300) as r:
        if r.status_code != 200:
            return r.status_code, [], json.loads(r.read())
        return 200, [json.loads(x) for x in r.iter_lines() if x.strip()], {}


def _usage(team: Team, name: str) -> dict:
    with team.admin() as c:
        return next(t for t in c.get("/v1/tokens").json()["tokens"] if t["name"] == name)


# ------------------------------------------------------------------ builds


def test_a_build_over_the_tenants_memory_quota_is_refused(team):
    with team.tenant("builder") as b:
        status, _, err = _build(b, _spec(memory_mb=1024))  # its quota is 512
    assert status == 429, err
    assert err["error"]["code"] == "quota_exceeded"
    assert err["error"]["details"]["quota"] == "max_memory_mb"
    assert _usage(team, "builder")["usage"]["sandboxes"] == 0  # nothing held


def test_a_build_counts_against_quota_and_host_memory_while_it_runs(team):
    with team.tenant("builder") as b:
        body = _spec(run="sleep 8")
        done: list = []
        runner = threading.Thread(target=lambda: done.append(_build(b, body)))
        runner.start()
        try:
            for _ in range(200):  # bounded: until the build holds its place
                if _usage(team, "builder")["usage"].get("memory_mb", 0) == 256:
                    break
                threading.Event().wait(0.1)
            assert _usage(team, "builder")["usage"]["memory_mb"] == 256, done
            with team.admin() as c:
                assert c.get("/v1/info").json()["committed_memory_mb"] >= 256
            # its quota of 512 MB holds the build's 256: a sandbox of 512 no longer fits
            made = b.post("/v1/sandboxes", json={"memory_mb": 512})
            assert made.status_code == 429, made.text
            assert made.json()["error"]["details"]["quota"] == "max_memory_mb"
        finally:
            runner.join(300)
        assert done and done[0][0] == 200 and done[0][1][-1]["type"] == "image", done
        b.delete(f"/v1/images/{body['name']}")
    assert _usage(team, "builder")["usage"].get("memory_mb", 0) == 0  # given back


def test_concurrent_builds_are_bounded_per_tenant_and_per_host(team):
    slow = _spec(run="sleep 6")
    done: list = []
    with team.tenant("spender") as s, team.admin() as admin_client:
        runner = threading.Thread(target=lambda: done.append(_build(s, slow)))
        runner.start()
        try:
            for _ in range(200):
                if _usage(team, "spender")["usage"].get("sandboxes", 0) == 1:
                    break
                threading.Event().wait(0.1)
            status, _, err = _build(s, _spec(run="true"))  # its second at once
            assert status == 429, err
            assert err["error"]["code"] == "quota_exceeded"
            assert err["error"]["details"]["quota"] == "max_builds"
            # the host runs at most 2: the admin's one fits, a third does not
            admin_slow = _spec(run="sleep 6")
            second = threading.Thread(target=lambda: done.append(_build(admin_client, admin_slow)))
            second.start()
            try:
                with team.tenant("builder") as b:
                    for _ in range(200):
                        with team.admin() as c:
                            if c.get("/v1/info").json().get("builds", 0) == 2:
                                break
                        threading.Event().wait(0.1)
                    status, _, err = _build(b, _spec(run="true"))
                assert status == 503, err
                assert err["error"]["code"] == "capacity_exceeded"
                assert err["error"]["details"]["limit"] == "max_builds"
            finally:
                second.join(300)
        finally:
            runner.join(300)
    assert len(done) == 2 and all(d[0] == 200 for d in done), done
    with team.admin() as c:
        for body in (slow, admin_slow):
            c.delete(f"/v1/images/{body['name']}")
    no_traceback(team)


# --------------------------------------------------------------- snapshots


def _sandbox_with(client: httpx.Client, size: int) -> str:
    made = client.post("/v1/sandboxes", json={"memory_mb": 64})
    assert made.status_code == 201, made.text
    sid = made.json()["id"]
    put = client.put(f"/v1/sandboxes/{sid}/files?path=/workspace/blob", content=os.urandom(size))
    assert put.status_code == 204, put.text
    return sid


def _layer_dirs(team: Team) -> list[str]:
    layers = team.daemon.state_dir / "layers"
    return sorted(p.name for p in layers.iterdir()) if layers.is_dir() else []


def test_snapshot_disk_quota_refuses_and_leaves_nothing(team):
    with team.tenant("hoarder") as h:
        sid = _sandbox_with(h, 3 << 20)  # 3 MB: over its 2 MB
        before = _layer_dirs(team)
        snap = h.post(f"/v1/sandboxes/{sid}/snapshot", json={"name": "too-big"})
        assert snap.status_code == 429, snap.text
        err = snap.json()["error"]
        assert err["code"] == "quota_exceeded" and err["details"]["quota"] == "max_snapshot_mb"
        assert "delete snapshots" in err["message"]
        assert h.get("/v1/snapshots").json()["snapshots"] == []
        assert _layer_dirs(team) == before  # no layer, no staged copy left
        fork = h.post(f"/v1/sandboxes/{sid}/fork", json={"n": 1})  # a fork snapshots too
        assert fork.status_code == 429, fork.text
        assert len(h.get("/v1/sandboxes").json()["sandboxes"]) == 1
        assert h.get(f"/v1/sandboxes/{sid}").json()["state"] == "running"
        h.delete(f"/v1/sandboxes/{sid}")
    team.cleanup()


def test_snapshot_quota_counts_shared_layers_once(team):
    with team.tenant("hoarder") as h:
        sid = _sandbox_with(h, 900 << 10)
        first = h.post(f"/v1/sandboxes/{sid}/snapshot", json={"name": "one"})
        assert first.status_code == 201, first.text
        # a copy started from it and snapshotted with a small change: its parent's
        # layer is shared, counted once
        child = h.post("/v1/sandboxes", json={"snapshot": "one"}).json()["id"]
        h.put(f"/v1/sandboxes/{child}/files?path=/workspace/small", content=b"x" * 1000)
        second = h.post(f"/v1/sandboxes/{child}/snapshot", json={"name": "two"})
        assert second.status_code == 201, second.text
        used = _usage(team, "hoarder")["usage"]["snapshot_mb"]
        assert 0.8 < used < 1.5, used
        # but another MB of its own does not fit under 2
        big = _sandbox_with(h, 1200 << 10)
        third = h.post(f"/v1/sandboxes/{big}/snapshot", json={"name": "three"})
        assert third.status_code == 429, third.text
    team.cleanup()


def test_stopped_sandboxes_kept_files_count_against_the_disk_quota(team):
    team.make_token("stopper", max_snapshot_mb=2)
    with team.tenant("stopper") as s:
        first = _sandbox_with(s, 1500 << 10)
        assert s.post(f"/v1/sandboxes/{first}/stop", json={}).status_code == 200
        kept = s.get(f"/v1/sandboxes/{first}/files?path=/workspace/blob")
        assert kept.status_code == 200 and len(kept.content) == 1500 << 10
        assert 1.4 < _usage(team, "stopper")["usage"]["kept_mb"] < 1.7
        # a loop of create, fill, stop: past the quota the files are not kept
        second = _sandbox_with(s, 1500 << 10)
        assert s.post(f"/v1/sandboxes/{second}/stop", json={}).status_code == 200
        assert s.get(f"/v1/sandboxes/{second}/files?path=/workspace/blob").status_code != 200
        assert 1.4 < _usage(team, "stopper")["usage"]["kept_mb"] < 1.7
        stopped = team.daemon.state_dir / "stopped"
        assert sorted(p.name for p in stopped.iterdir()) == [first]  # nothing half-kept
        # and a snapshot does not fit beside them until they go
        third = _sandbox_with(s, 1 << 20)
        snap = s.post(f"/v1/sandboxes/{third}/snapshot", json={})
        assert snap.status_code == 429, snap.text
        assert "stopped sandboxes" in snap.json()["error"]["message"]
        assert s.delete(f"/v1/sandboxes/{first}").status_code == 204
        assert s.post(f"/v1/sandboxes/{third}/snapshot", json={}).status_code == 201
    team.cleanup()


def test_token_update_changes_a_quota(team):
    with team.admin() as c:
        up = c.patch("/v1/tokens/hoarder", json={"max_snapshot_mb": 8})
        assert up.status_code == 200, up.text
        assert up.json()["max_snapshot_mb"] == 8
        bad = c.patch("/v1/tokens/nobody", json={"max_snapshot_mb": 8})
        assert bad.status_code == 404, bad.text
    with team.tenant("hoarder") as h:
        sid = _sandbox_with(h, 3 << 20)
        snap = h.post(f"/v1/sandboxes/{sid}/snapshot", json={"name": "fits-now"})
        assert snap.status_code == 201, snap.text
        assert h.patch("/v1/tokens/hoarder", json={"max_snapshot_mb": 100}).status_code == 403
    with team.admin() as c:
        assert c.patch("/v1/tokens/hoarder", json={"max_snapshot_mb": 2}).status_code == 200
    team.cleanup()


# ----------------------------------------------------------------- restart


def test_a_restart_hands_no_tenant_a_fresh_quota():
    if not have_root_runtime():
        pytest.skip(ROOT_REASON)
    port = free_port()
    d = Daemon(_base_dir(), ["--tcp", f"127.0.0.1:{port}", "--token", ADMIN_TOKEN])
    d.start()
    t = Team(d, port)
    try:
        t.make_token("keeper", max_snapshot_mb=2, max_sandboxes=2)
        with t.tenant("keeper") as k:
            sid = _sandbox_with(k, 1500 << 10)
            assert k.post(f"/v1/sandboxes/{sid}/snapshot", json={"name": "a"}).status_code == 201
            stopped = _sandbox_with(k, 300 << 10)  # its kept files count too
            assert k.post(f"/v1/sandboxes/{stopped}/stop", json={}).status_code == 200
        used = _usage(t, "keeper")["usage"]
        assert used["snapshot_mb"] > 1.4 and used["kept_mb"] > 0.25, used
        d.stop()
        d.start()
        again = _usage(t, "keeper")["usage"]  # from the registry and the kept trees
        assert (again["snapshot_mb"], again["kept_mb"]) == (used["snapshot_mb"], used["kept_mb"])
        with t.tenant("keeper") as k:
            # the sandbox did not survive the restart: its place is free, nothing more
            assert _usage(t, "keeper")["usage"].get("sandboxes", 0) == 0
            sid = _sandbox_with(k, 1 << 20)
            snap = k.post(f"/v1/sandboxes/{sid}/snapshot", json={"name": "b"})
            assert snap.status_code == 429, snap.text  # 1.5 + 1 MB > 2 MB, as before
            assert k.post("/v1/sandboxes", json={"memory_mb": 64}).status_code == 201
            over = k.post("/v1/sandboxes", json={"memory_mb": 64})
            assert over.status_code == 429, over.text  # max_sandboxes 2, restart or not
        no_traceback(t)
    finally:
        d.stop()
        shutil.rmtree(d.base, ignore_errors=True)


def test_a_tenants_log_entries_count_against_its_own_bound(team):
    with team.tenant("hoarder") as h:
        made = h.post("/v1/sandboxes", json={"memory_mb": 64})
        assert made.status_code == 201, made.text
        sid = made.json()["id"]
        assert h.post(f"/v1/sandboxes/{sid}/exec", json={"cmd": ["echo", "hi"]}).status_code == 200
        db = sqlite3.connect(team.daemon.state_dir / "logs.db")
        try:
            owners: set = set()
            for _ in range(100):  # bounded: until the writer flushed (every 0.2 s)
                owners = {o for (o,) in db.execute(
                    "SELECT owner FROM entries WHERE sandbox_id = ?", (sid,))}
                if owners:
                    break
                threading.Event().wait(0.1)
        finally:
            db.close()
        assert owners == {"hoarder"}
        h.delete(f"/v1/sandboxes/{sid}")
