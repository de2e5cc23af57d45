"""A lease taken under the client's own id (one lease on every node of a cluster): taking
it again renews it for its tenant, and another tenant cannot take it over or renew it."""

from __future__ import annotations

import sqlite3

import pytest

from corral.api.daemon_models import LeaseRequest
from corral.errors import InvalidArgument, LeaseNotFound
from corral.server.leases import Leases

LEASE = "lease-0123456789abcdef"


def test_a_chosen_id_is_taken_renewed_and_kept_from_other_tenants():
    leases = Leases(sqlite3.connect(":memory:"), engine=None)  # type: ignore[arg-type]
    first = leases.create("alice", 5.0, LEASE)
    assert first.id == LEASE and first.tag == f"lease={LEASE}"
    again = leases.create("alice", 9.0, LEASE)  # a second node's copy, or a retry
    assert again.id == LEASE and again.ttl == 9.0 and again.expires_at >= first.expires_at
    with pytest.raises(InvalidArgument, match="taken"):
        leases.create("bob", 5.0, LEASE)
    with pytest.raises(LeaseNotFound):
        leases.renew("bob", LEASE)
    assert leases.create("bob", 5.0).id != LEASE


@pytest.mark.parametrize("bad", ["lease-xyz", "sb-0123456789abcdef", "lease-" + "0" * 17])
def test_a_chosen_id_must_look_like_one(bad):
    with pytest.raises(ValueError):
        LeaseRequest(ttl=5, id=bad)
