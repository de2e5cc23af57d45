"""Red-team: one tenant takes every private network of the host.

A private network takes a /24 of ``CORRAL_NET_PRIVATE`` (256 by default) while a
sandbox is on it, and a tenant may name 256 networks: a tenant with 256 sandboxes, each
on a network of its own, left no private network to any other tenant (``CapacityExceeded``
for all of them until it let go). A tenant's sandboxes are now on at most half of them
at once; the admin's are not limited. (Places are taken in memory first, as a create
does: :meth:`PrivateNets.reserve`; a range of four networks stands in for the 256.)"""

from __future__ import annotations

import pytest

from corral.errors import CapacityExceeded
from corral.runtime.net.private import PRIVATE_ENV, PrivateNets


def test_a_tenant_holds_at_most_half_the_private_networks(monkeypatch):
    monkeypatch.setenv(PRIVATE_ENV, "10.220.0.0/22")  # four networks
    nets = PrivateNets("corral_redteam")
    for i in range(2):
        nets.reserve("mallory", f"ep{i}", f"sb-m{i}", None)
    nets.reserve("mallory", "ep0", "sb-m9", None)  # another member of one it is on: fine
    with pytest.raises(CapacityExceeded) as caught:
        nets.reserve("mallory", "ep2", "sb-m2", None)
    assert caught.value.details["total"] == 4
    for i in range(2):  # the others' share is left to them
        nets.reserve("alice", f"ep{i}", f"sb-a{i}", None)
    with pytest.raises(CapacityExceeded):  # the host is full now: for everyone
        nets.reserve(None, "admin-ep", "sb-x", None)
    nets.leave("sb-a0")  # (its bridge was never made: nothing to remove)
    nets.reserve(None, "admin-ep", "sb-x", None)  # the admin's: no share of its own
