"""A client's reserve of pooled sandboxes (``POST /v1/pools/{name}/reserve``,
``corral.Pool(reserve=N)``) under attack.

A reserve takes ready sandboxes in one call and holds them under the caller's lease.
Checked here: no sandbox is ever handed out twice (reserves and acquires racing); a
tenant can neither reserve from another's pool nor hold sandboxes under another's
lease; reserved sandboxes count against the tenant's quota; and a client that dies
leaves nothing behind: its lease expires and the daemon deletes every sandbox the
reserve took, used or not.
"""

from __future__ import annotations

import subprocess
import sys
import textwrap
import time
from concurrent.futures import ThreadPoolExecutor

import pytest

from tests.conftest import requires_root
from tests.security.tenants_helpers import team_daemon

pytestmark = [requires_root, pytest.mark.root, pytest.mark.timeout(300)]

SPEC = {"memory_mb": 64}


@pytest.fixture(scope="module")
def team():
    with team_daemon() as t:
        t.make_token("carol", max_sandboxes=2)
        yield t


def _pool(client, name: str, min_ready: int, max_size: int = 16) -> None:
    made = client.post("/v1/pools", json={"name": name, "spec": SPEC, "min_ready": min_ready,
                                          "max_size": max_size})
    assert made.status_code == 201, made.text
    deadline = time.monotonic() + 120
    while client.get(f"/v1/pools/{name}").json()["ready"] < min_ready:
        assert time.monotonic() < deadline, "the pool never filled"
        time.sleep(0.1)


def _lease(client, ttl: float = 60) -> str:
    reply = client.post("/v1/leases", json={"ttl": ttl})
    assert reply.status_code == 201, reply.text
    return reply.json()["id"]


def _gone(client, ids, timeout: float = 60) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if all(client.get(f"/v1/sandboxes/{i}").status_code == 404 for i in ids):
            return True
        time.sleep(0.2)
    return False


def test_reserves_and_acquires_racing_never_share_a_sandbox(team):
    with team.tenant("alice") as alice:
        _pool(alice, "race", 4, max_size=8)  # alice may run 8 sandboxes in all
        lease = _lease(alice)

        def reserve():
            r = alice.post("/v1/pools/race/reserve", json={"count": 2, "lease": lease})
            assert r.status_code == 200, r.text
            return [s["id"] for s in r.json()["sandboxes"]]

        def acquire():
            r = alice.post("/v1/pools/race/acquire", json={"timeout": 60})
            assert r.status_code == 200, r.text
            return [r.json()["id"]]

        with ThreadPoolExecutor(4) as ex:
            got = [i for f in [ex.submit(fn) for fn in (reserve, acquire) * 2] for i in f.result()]
        assert len(got) == len(set(got)), f"a sandbox was handed out twice: {got}"
        detail = alice.get("/v1/pools/race").json()
        assert not set(got) & set(detail["ready_ids"])  # none is offered again
        assert set(got) <= set(detail["acquired_ids"])
        alice.delete(f"/v1/leases/{lease}")
        alice.delete("/v1/pools/race")
        for sid in got:
            alice.delete(f"/v1/sandboxes/{sid}")


def test_a_tenant_cannot_reserve_from_anothers_pool_nor_under_anothers_lease(team):
    with team.tenant("alice") as alice, team.tenant("bob") as bob:
        _pool(alice, "mine", 2)
        alices = _lease(alice)
        bobs = _lease(bob)
        stolen = bob.post("/v1/pools/mine/reserve", json={"count": 2, "lease": bobs})
        assert stolen.status_code == 404 and stolen.json()["error"]["code"] == "not_found"
        _pool(bob, "bobs", 1)
        # bob's own pool, alice's lease: refused before anything is taken
        borrowed = bob.post("/v1/pools/bobs/reserve", json={"count": 1, "lease": alices})
        assert borrowed.status_code == 404, borrowed.text
        assert borrowed.json()["error"]["code"] == "lease_not_found"
        waited = bob.post("/v1/pools/bobs/acquire", json={"timeout": 5, "lease": alices})
        assert waited.status_code == 404, waited.text
        assert waited.json()["error"]["code"] == "lease_not_found"
        assert bob.get("/v1/pools/bobs").json()["ready"] == 1
        # alice's reserve is hers: bob sees none of it
        held = alice.post("/v1/pools/mine/reserve", json={"count": 2, "lease": alices}).json()
        ids = [s["id"] for s in held["sandboxes"]]
        assert len(ids) == 2
        for sid in ids:
            assert bob.get(f"/v1/sandboxes/{sid}").status_code == 404
            assert bob.delete(f"/v1/sandboxes/{sid}").status_code in (204, 404)
            assert alice.get(f"/v1/sandboxes/{sid}").json()["state"] == "running"
        # bob releasing alice's lease is a no-op; alice releasing it deletes her reserve
        assert bob.delete(f"/v1/leases/{alices}").status_code == 204
        assert alice.get(f"/v1/sandboxes/{ids[0]}").json()["state"] == "running"
        assert alice.delete(f"/v1/leases/{alices}").status_code == 204
        assert _gone(alice, ids)
        bob.delete(f"/v1/leases/{bobs}")
        alice.delete("/v1/pools/mine")
        bob.delete("/v1/pools/bobs")


def test_reserved_sandboxes_count_against_the_quota(team):
    with team.tenant("carol") as carol:  # max_sandboxes=2
        _pool(carol, "quota", 2, max_size=4)
        lease = _lease(carol)
        held = carol.post("/v1/pools/quota/reserve", json={"count": 2, "lease": lease}).json()
        ids = [s["id"] for s in held["sandboxes"]]
        assert len(ids) == 2
        over = carol.post("/v1/sandboxes", json=SPEC)
        assert over.status_code == 429 and over.json()["error"]["code"] == "quota_exceeded"
        carol.delete(f"/v1/leases/{lease}")
        assert _gone(carol, ids)
        carol.delete("/v1/pools/quota")
        deadline = time.monotonic() + 60
        while (made := carol.post("/v1/sandboxes", json=SPEC)).status_code == 429:
            assert time.monotonic() < deadline, made.text  # places come back as teardown ends
            time.sleep(0.2)
        assert made.status_code == 201, made.text
        carol.delete(f"/v1/sandboxes/{made.json()['id']}")


# A 15 s lease: with 1 s, a client that got no CPU for a second between its acquire and
# its exec (a loaded host) lost the lease, and the sandbox it used was deleted under it.
CLIENT = textwrap.dedent("""
    import os, sys, corral
    client = corral.Client(sys.argv[1], token=sys.argv[2])
    pool = corral.Pool(memory_mb=64, min_ready=3, max_size=8, reserve=3, reserve_ttl=15,
                       name="dies", client=client)
    pool.wait_ready(timeout=120)
    used = pool.acquire(timeout=60)
    used.exec("true")
    print(used.id, *[i.id for _, i in pool._reserve], flush=True)
    os._exit(0)  # killed: nothing closes, nothing renews
""")


def test_a_client_that_dies_leaves_no_reserved_sandbox(team):
    out = subprocess.run([sys.executable, "-c", CLIENT, team.url, team.tokens["bob"]],
                         capture_output=True, text=True, timeout=180)
    assert out.returncode == 0, out.stderr
    ids = out.stdout.split()
    assert len(ids) == 3, out.stdout
    with team.tenant("bob") as bob:
        assert _gone(bob, ids, timeout=120), "the dead client's reserve outlived its lease"
        bob.delete("/v1/pools/dies")


BAD_COUNTS = [0, -1, 65, 10**30, "2", True, 2.0, None, [2]]


def test_a_reserve_count_other_than_1_to_64_is_refused_typed_and_takes_nothing(team):
    """Edge counts (zero, negative, huge, a string, a bool, a float, none) and a lease
    that is missing or empty are each a typed 400; nothing leaves the pool."""
    with team.tenant("alice") as alice:
        _pool(alice, "edges", 1, max_size=2)
        lease = _lease(alice)
        bodies = [{"count": c, "lease": lease} for c in BAD_COUNTS]
        bodies += [{"count": 1}, {"count": 1, "lease": ""}, {"count": 1, "lease": "x" * 101},
                   {"count": 1, "lease": lease, "extra": 1}]
        for body in bodies:
            reply = alice.post("/v1/pools/edges/reserve", json=body)
            assert reply.status_code == 400, (body, reply.text)
            assert reply.json()["error"]["code"] == "invalid_argument", (body, reply.text)
        assert alice.post("/v1/pools/edges/reserve", content=b"{",
                          headers={"content-type": "application/json"}).status_code == 400
        assert alice.get("/v1/pools/edges").json()["ready"] == 1
        assert alice.get("/v1/pools/edges").json()["acquired_ids"] == []
        alice.delete(f"/v1/leases/{lease}")
        alice.delete("/v1/pools/edges")


def test_revoking_a_token_ends_its_leases_and_their_reserves(team):
    """A revoked tenant's leases end at revocation, not a ``ttl`` later: each sandbox
    its reserves took is deleted (they were only stopped, and their lease, with a ttl
    of up to a day, went on holding them). A name once revoked is never issued again,
    so no later token finds the lease."""
    team.make_token("erin", max_sandboxes=4)
    with team.tenant("erin") as erin:
        _pool(erin, "doomed", 2, max_size=4)
        lease = _lease(erin, ttl=3600)
        held = erin.post("/v1/pools/doomed/reserve", json={"count": 2, "lease": lease})
        ids = [s["id"] for s in held.json()["sandboxes"]]
        assert len(ids) == 2, held.text
    with team.admin() as admin:
        assert admin.delete("/v1/tokens/erin").status_code == 204
        assert _gone(admin, ids, timeout=30), "a revoked tenant's reserve outlived it"
        reissued = admin.post("/v1/tokens", json={"name": "erin"})
        assert reissued.status_code == 400, reissued.text



def test_a_reserve_racing_its_leases_release_keeps_nothing(team):
    """The lease released while a reserve takes (each take awaits a liveness check):
    whatever the reserve got is deleted, none held under no lease."""
    with team.tenant("bob") as bob:
        _pool(bob, "racing", 2, max_size=8)
        for _ in range(3):
            _pool_ready(bob, "racing", 2)
            lease = _lease(bob)
            with ThreadPoolExecutor(2) as ex:
                took = ex.submit(bob.post, "/v1/pools/racing/reserve",
                                 json={"count": 2, "lease": lease})
                ex.submit(bob.delete, f"/v1/leases/{lease}").result()
                reply = took.result()
            if reply.status_code == 200:
                ids = [s["id"] for s in reply.json()["sandboxes"]]
            else:
                assert reply.json()["error"]["code"] == "lease_not_found", reply.text
                ids = []
            assert _gone(bob, ids, timeout=30), f"{ids} outlived their released lease"
        bob.delete("/v1/pools/racing")


def _pool_ready(client, name: str, count: int) -> None:
    deadline = time.monotonic() + 120
    while client.get(f"/v1/pools/{name}").json()["ready"] < count:
        assert time.monotonic() < deadline, "the pool never refilled"
        time.sleep(0.1)


def test_a_reserve_held_under_a_renewed_lease_lives_no_longer_than_its_tenant_may(team):
    """Renewing the lease forever does not stretch what it holds: each reserved sandbox
    keeps its tenant's maximum lifetime (``max_lifetime``), counted from its create."""
    team.make_token("hana", max_lifetime=30.0)
    with team.tenant("hana") as hana:
        _pool(hana, "forever", 1, max_size=2)
        lease = _lease(hana, ttl=86400)
        held = hana.post("/v1/pools/forever/reserve", json={"count": 1, "lease": lease})
        (info,) = held.json()["sandboxes"]
        assert info["spec"]["timeout"] is not None and info["spec"]["timeout"] <= 30, info
        stretched = hana.patch(f"/v1/sandboxes/{info['id']}", json={"timeout": 3600})
        assert stretched.status_code == 400, stretched.text
        assert hana.post(f"/v1/leases/{lease}/renew").status_code == 200
        hana.delete(f"/v1/leases/{lease}")
        hana.delete("/v1/pools/forever")


def test_a_reserved_sandbox_consumed_leaves_no_place_taken(team):
    """``consume`` deletes a reserved sandbox (the way a pre-started judge is used): the
    pool no longer counts it acquired, the tenant's quota place is free again (carol may
    run 2), bob cannot consume it, and its lease ends cleanly."""
    with team.tenant("carol") as carol, team.tenant("bob") as bob:
        _pool(carol, "judges", 1, max_size=1)
        lease = _lease(carol)
        r = carol.post("/v1/pools/judges/reserve", json={"count": 1, "lease": lease})
        assert r.status_code == 200, r.text
        sid = r.json()["sandboxes"][0]["id"]
        spawned = carol.post(f"/v1/sandboxes/{sid}/processes",
                             json={"cmd": ["python3", "-c", "print(input())"]})
        assert spawned.status_code == 201, spawned.text
        path = f"/v1/sandboxes/{sid}/processes/{spawned.json()['id']}/consume"
        assert bob.post(path, content=b"x\n").status_code == 404
        reply = carol.post(path, content=b"verdict\n", params={"timeout": "30"})
        assert reply.status_code == 200, reply.text
        assert reply.json()["data"] == "verdict\n"
        assert _gone(carol, [sid])
        assert sid not in carol.get("/v1/pools/judges").json()["acquired_ids"]
        deadline = time.monotonic() + 120  # the pool refilled its place
        while carol.get("/v1/pools/judges").json()["ready"] < 1:
            assert time.monotonic() < deadline, "the pool never refilled"
            time.sleep(0.1)
        extra = carol.post("/v1/sandboxes", json=SPEC)  # the pool's 1 + this one: 2
        assert extra.status_code == 201, extra.text
        carol.delete(f"/v1/sandboxes/{extra.json()['id']}")
        assert carol.delete(f"/v1/leases/{lease}").status_code == 204
        carol.delete("/v1/pools/judges")
