"""``POST /v1/run`` (create, one command, delete in one call) under attack.

A client that hangs up mid-command leaves no sandbox and no process; a run counts
against its tenant's quota like a create; a run cannot carry another tenant's lease tag
nor a tag another front-end reserves; a run's sandbox is never visible to another tenant.
"""

from __future__ import annotations

import threading
import time

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
