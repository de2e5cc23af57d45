"""The cluster registry's lease runs on CLOCK_BOOTTIME: a suspended node wakes up
with its copy expired, so a token revoked meanwhile is refused until it re-reads."""

from __future__ import annotations

import time

from corral.server import cluster_tenants
from corral.server.cluster_tenants import LEASE_S, ClusterTokenStore, _Copy, lease_clock


def test_a_copy_expires_across_a_suspend(monkeypatch):
    store = ClusterTokenStore(gcs=None)
    store._copy = _Copy(started=lease_clock())
    assert store.fresh()
    real = time.clock_gettime
    slept = LEASE_S + 1  # a suspend: CLOCK_BOOTTIME goes on, CLOCK_MONOTONIC does not

    def suspended(clock: int) -> float:
        return real(clock) + (slept if clock == time.CLOCK_BOOTTIME else 0.0)

    monkeypatch.setattr(cluster_tenants.time, "clock_gettime", suspended)
    assert not store.fresh()
