"""Client leases across tenants (docs/restart.md): a lease is its tenant's own.

Another tenant cannot renew a lease (keeping a victim's orphaned sandboxes alive),
release it (stopping the victim's sandboxes), nor tie its own sandboxes to it; and a
lease's expiry stops only its own tenant's sandboxes.
"""

from __future__ import annotations

import time

import pytest

from tests.conftest import requires_root
from tests.security.tenants_helpers import team_daemon

pytestmark = [requires_root, pytest.mark.root, pytest.mark.timeout(300)]


def test_a_lease_is_its_tenants_own():
    with team_daemon() as team, team.tenant("alice") as alice, team.tenant("bob") as bob:
        lease = alice.post("/v1/leases", json={"ttl": 15}).json()  # (3 s ran out before its renew under load)
        lid = lease["id"]
        mine = alice.post("/v1/sandboxes", json={"memory_mb": 64, "tags": [lease["tag"]]})
        assert mine.status_code == 201, mine.text
        # bob: as if it did not exist
        for reply in (bob.post(f"/v1/leases/{lid}/renew"),
                      bob.post("/v1/sandboxes", json={"memory_mb": 64, "tags": [lease["tag"]]})):
            assert reply.status_code == 404, reply.text
            assert reply.json()["error"]["code"] == "lease_not_found"
        assert bob.delete(f"/v1/leases/{lid}").status_code == 204  # idempotent, and a no-op
        assert alice.post(f"/v1/leases/{lid}/renew").status_code == 200  # still alice's
        # a lease tag of no lease of bob's is refused too
        theirs = bob.post("/v1/sandboxes", json={"memory_mb": 64, "tags": ["lease=decoy"]})
        assert theirs.status_code == 404
        plain = bob.post("/v1/sandboxes", json={"memory_mb": 64}).json()["id"]
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline:  # the lease expires without renewals
            state = alice.get(f"/v1/sandboxes/{mine.json()['id']}").json()["state"]
            if state == "stopped":
                break
            time.sleep(0.2)
        assert state == "stopped"
        assert bob.get(f"/v1/sandboxes/{plain}").json()["state"] == "running"
        team.cleanup()
