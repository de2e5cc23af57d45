"""A lease taken under the client's own id (one lease on every node of a cluster): taking
it again renews it for its tenant, and another tenant cannot take it over or renew it."""

from __future__ import annotations

import sqlite3

import pytest

from corral.api.daemon_models import LeaseRequest
from corral.errors import InvalidArgument, LeaseNotFound, QuotaExceeded
from corral.server.leases import MAX_LEASES_PER_TENANT, Leases

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


def test_a_tenant_cannot_take_leases_without_bound():
    """Each lease is a registry row living up to a day that the sweep scans every half
    second: a loop of creates stops typed at the tenant's cap (a chosen id too); renewing
    and taking again what it holds still work, releasing one makes room, and another
    tenant is not affected."""
    leases = Leases(sqlite3.connect(":memory:"), engine=None)  # type: ignore[arg-type]
    held = [leases.create("mallory", 3600.0).id for _ in range(MAX_LEASES_PER_TENANT - 1)]
    leases.create("mallory", 3600.0, LEASE)
    for chosen in (None, "lease-" + "f" * 16):
        with pytest.raises(QuotaExceeded) as caught:
            leases.create("mallory", 3600.0, chosen)
        assert caught.value.details["quota"] == "max_leases"
    leases.renew("mallory", held[0])
    leases.create("mallory", 60.0, LEASE)  # its own chosen id again: a renewal
    assert leases.create("bob", 5.0).id
    leases.db.execute("DELETE FROM leases WHERE id=?", (held[0],))
    assert leases.create("mallory", 5.0).id
