"""``POST /v1/run`` (create, one command, delete in one call) under attack.

A client that hangs up mid-command leaves no sandbox and no process; a run counts
against its tenant's quota like a create; a run cannot carry another tenant's lease tag
nor a tag another front-end reserves; a run's sandbox is never visible to another tenant.
"""

from __future__ import annotations

import io
import tarfile
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from itertools import pairwise

import httpx
import pytest

from tests.conftest import requires_root
from tests.security.tenants_helpers import team_daemon

pytestmark = [requires_root, pytest.mark.root, pytest.mark.timeout(300)]

SPEC = {"memory_mb": 64}


@pytest.fixture(scope="module")
def team():
    with team_daemon() as t:
        t.make_token("dave", max_sandboxes=1)
        yield t


def _running(client, tag: str) -> list[str]:
    return [s["id"] for s in client.get("/v1/sandboxes", params={"tag": tag}).json()["sandboxes"]]


def test_a_client_that_hangs_up_mid_run_leaves_no_sandbox(team):
    with team.tenant("alice") as alice:
        with pytest.raises(httpx.ReadTimeout):
            team.tenant("alice").post("/v1/run", timeout=httpx.Timeout(120, read=3), json={
                "spec": {**SPEC, "tags": ["hangup"]}, "exec": {"cmd": "sleep 60"}})
        deadline = time.monotonic() + 60
        while _running(alice, "hangup"):
            assert time.monotonic() < deadline, "the abandoned run's sandbox stayed"
            time.sleep(0.2)


def test_a_run_counts_against_the_quota(team):
    with team.tenant("dave") as dave:  # max_sandboxes=1
        held = dave.post("/v1/sandboxes", json=SPEC)
        assert held.status_code == 201, held.text
        over = dave.post("/v1/run", json={"spec": SPEC, "exec": {"cmd": "true"}})
        assert over.status_code == 429 and over.json()["error"]["code"] == "quota_exceeded"
        # while a run holds the one place, a create is refused too
        started = threading.Event()
        dave.delete(f"/v1/sandboxes/{held.json()['id']}")

        def run() -> None:
            started.set()
            with team.tenant("dave") as c:
                c.post("/v1/run", json={"spec": {**SPEC, "tags": ["q"]},
                                        "exec": {"cmd": "sleep 3"}})

        t = threading.Thread(target=run)
        deadline = time.monotonic() + 60
        while (made := dave.post("/v1/sandboxes", json=SPEC)).status_code == 429:
            assert time.monotonic() < deadline, made.text  # the place comes back
            time.sleep(0.2)
        dave.delete(f"/v1/sandboxes/{made.json()['id']}")
        t.start()
        started.wait()
        while not _running(dave, "q"):
            assert time.monotonic() < deadline
            time.sleep(0.05)
        assert dave.post("/v1/sandboxes", json=SPEC).status_code == 429
        t.join(60)


def test_a_run_cannot_carry_anothers_lease_nor_a_reserved_tag(team):
    with team.tenant("alice") as alice, team.tenant("bob") as bob:
        lease = alice.post("/v1/leases", json={"ttl": 60}).json()
        theirs = bob.post("/v1/run", json={"spec": {**SPEC, "tags": [lease["tag"]]},
                                           "exec": {"cmd": "true"}})
        assert theirs.status_code == 404, theirs.text
        assert theirs.json()["error"]["code"] == "lease_not_found"
        reserved = bob.post("/v1/run", json={"spec": {**SPEC, "tags": ["e2b.template=x"]},
                                             "exec": {"cmd": "true"}})
        assert reserved.status_code == 400, reserved.text
        alice.delete(f"/v1/leases/{lease['id']}")


def _live(admin, tenant: str) -> list[str]:
    listed = admin.get("/v1/sandboxes", params={"tenant": tenant}).json()["sandboxes"]
    return [s["id"] for s in listed if s["state"] not in ("stopped", "deleted", "failed")]


def _volume(client, name: str) -> None:
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w") as t:
        info = tarfile.TarInfo("secret")
        info.size = 3
        t.addfile(info, io.BytesIO(b"hi\n"))
    made = client.post(f"/v1/volumes?name={name}", content=buf.getvalue())
    assert made.status_code == 201, made.text


def test_a_run_gets_nothing_a_create_would_refuse(team):
    """The host's network without the right, GPUs without a quota, another tenant's
    volume, an unknown (privileged) option, bounds of the command's own: each refused
    typed as a create's or an exec's would be, and no sandbox is left behind."""
    with team.tenant("alice") as alice:
        _volume(alice, "alices")
    refusals = [
        ({**SPEC, "network": "host"}, {}, 403, "forbidden"),
        ({**SPEC, "gpus": 1}, {}, 429, "quota_exceeded"),
        ({**SPEC, "gpus": "all"}, {}, 429, "quota_exceeded"),
        ({**SPEC, "volumes": {"/data": "alices"}}, {}, 404, None),
        ({**SPEC, "privileged": True}, {}, 400, "invalid_argument"),
        ({**SPEC, "cap_add": ["SYS_ADMIN"]}, {}, 400, "invalid_argument"),
        (SPEC, {"max_output": 1 << 40}, 400, "invalid_argument"),
        (SPEC, {"timeout": 0}, 400, "invalid_argument"),
        (SPEC, {"timeout": 31 * 86400}, 400, "invalid_argument"),
    ]
    with team.tenant("bob") as bob, team.admin() as admin:
        for spec, extra, status, code in refusals:
            reply = bob.post("/v1/run", json={"spec": spec, "exec": {"cmd": "id", **extra}})
            assert reply.status_code == status, (spec, extra, reply.text)
            if code is not None:
                assert reply.json()["error"]["code"] == code, reply.text
        assert bob.post("/v1/run", json={"spec": SPEC}).status_code == 400  # no exec
        assert _live(admin, "bob") == []
    with team.tenant("alice") as alice:
        alice.delete("/v1/volumes/alices")


def test_a_run_that_never_ends_or_floods_is_bounded(team):
    """A command past its timeout is killed and its sandbox deleted; output past
    ``max_output`` is cut, not held whole in the daemon's memory."""
    with team.tenant("bob") as bob, team.admin() as admin:
        slow = bob.post("/v1/run", json={"spec": SPEC, "exec": {"cmd": "sleep 60",
                                                                 "timeout": 1}})
        assert slow.status_code == 200, slow.text
        assert slow.json()["result"]["timed_out"] is True
        flood = bob.post("/v1/run", json={"spec": SPEC, "exec": {
            "cmd": "head -c 50000000 /dev/zero", "max_output": 4096}})
        assert flood.status_code == 200, flood.text
        result = flood.json()["result"]
        assert result["stdout_truncated"] is True
        assert len(result["stdout"]) <= 4096
        assert _live(admin, "bob") == []


def test_revoking_a_token_mid_run_leaves_no_sandbox(team):
    """The run's call ends with its token and its sandbox is deleted, whatever
    ``--on-revoke`` does to the tenant's other sandboxes."""
    team.make_token("fred", max_sandboxes=2)
    replies: list[httpx.Response | Exception] = []

    def run() -> None:
        with team.tenant("fred") as fred:
            try:
                replies.append(fred.post("/v1/run", json={
                    "spec": {**SPEC, "tags": ["revoked"]}, "exec": {"cmd": "sleep 60"}}))
            except httpx.HTTPError as exc:
                replies.append(exc)

    t = threading.Thread(target=run)
    t.start()
    with team.admin() as admin:
        deadline = time.monotonic() + 60
        while not _live(admin, "fred"):
            assert time.monotonic() < deadline, "the run never started"
            time.sleep(0.05)
        assert admin.delete("/v1/tokens/fred").status_code == 204
        t.join(30)
        assert not t.is_alive(), "the revoked token's run went on"
        while admin.get("/v1/sandboxes", params={"tenant": "fred"}).json()["sandboxes"]:
            assert time.monotonic() < deadline, "the revoked run's sandbox stayed"
            time.sleep(0.1)


def test_a_run_can_neither_pass_as_another_tenant_nor_start_from_its_snapshot(team):
    """``spec.tenant`` is the daemon's to set (a run naming another tenant still counts
    against its caller's quota), and another tenant's snapshot is as if it did not
    exist."""
    with team.tenant("alice") as alice:
        made = alice.post("/v1/sandboxes", json={**SPEC, "env": {"SECRET": "alices"}})
        assert made.status_code == 201, made.text
        sid = made.json()["id"]
        snap = alice.post(f"/v1/sandboxes/{sid}/snapshot", json={"name": "alices-snap"})
        assert snap.status_code in (200, 201), snap.text
        snap_id = snap.json()["id"]
        alice.delete(f"/v1/sandboxes/{sid}")
    with team.tenant("dave") as dave:  # max_sandboxes=1
        held = dave.post("/v1/sandboxes", json=SPEC)
        assert held.status_code == 201, held.text
        spoofed = dave.post("/v1/run", json={"spec": {**SPEC, "tenant": "alice"},
                                             "exec": {"cmd": "true"}})
        assert spoofed.status_code == 429, spoofed.text
        dave.delete(f"/v1/sandboxes/{held.json()['id']}")
    with team.tenant("bob") as bob:
        for ref in (snap_id, "alices-snap"):
            stolen = bob.post("/v1/run", json={"spec": {**SPEC, "snapshot": ref},
                                               "exec": {"cmd": "echo $SECRET"}})
            assert stolen.status_code == 404, stolen.text
            assert stolen.json()["error"]["code"] == "snapshot_not_found", stolen.text
    with team.tenant("alice") as alice:
        alice.delete(f"/v1/snapshots/{snap_id}")


def test_concurrent_runs_never_exceed_the_quota(team):
    """Six runs at once for a tenant of one sandbox: those admitted never overlap (each
    command prints when it began and ended), the others are refused typed."""
    def run(_: int) -> httpx.Response:
        with team.tenant("dave") as c:  # max_sandboxes=1
            return c.post("/v1/run", json={"spec": SPEC, "exec": {
                "cmd": "date +%s.%N; sleep 1; date +%s.%N"}})

    deadline = time.monotonic() + 60
    with team.admin() as admin:
        while _live(admin, "dave"):  # earlier tests' places come back
            assert time.monotonic() < deadline
            time.sleep(0.1)
    with ThreadPoolExecutor(6) as ex:
        replies = list(ex.map(run, range(6)))
    spans = []
    for r in replies:
        if r.status_code == 200:
            begun, ended = map(float, r.json()["result"]["stdout"].split())
            spans.append((begun, ended))
        else:
            assert r.status_code == 429, r.text
            assert r.json()["error"]["code"] == "quota_exceeded"
    assert spans, [r.text for r in replies]
    spans.sort()
    for (_, ended), (begun, _) in pairwise(spans):
        assert begun >= ended, f"two runs of a one-sandbox tenant overlapped: {spans}"


def test_hanging_up_at_any_point_of_a_run_leaves_no_sandbox(team):
    """Hang-ups during the create, between create and command, during the command:
    whatever point each falls on, no sandbox stays (nor counts)."""
    for read in (0.02, 0.05, 0.1, 0.2, 0.4, 0.8):
        with team.tenant("bob") as c, pytest.raises(httpx.ReadTimeout):
            c.post("/v1/run", timeout=httpx.Timeout(60, read=read), json={
                "spec": {**SPEC, "tags": ["hangups"]}, "exec": {"cmd": "sleep 30"}})
    deadline = time.monotonic() + 60
    with team.admin() as admin:
        while [s for s in admin.get("/v1/sandboxes", params={"tag": "hangups"}).json()[
                "sandboxes"]]:
            assert time.monotonic() < deadline, "an abandoned run's sandbox stayed"
            time.sleep(0.2)
