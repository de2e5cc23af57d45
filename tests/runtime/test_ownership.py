"""The one ownership rule at the engine: acting for one tenant, another's sandboxes,
snapshots and pools are ids that do not exist; acting for the admin (None), all are seen."""

from __future__ import annotations

import pytest

from corral.errors import NotFound, SandboxNotFound, SnapshotNotFound
from corral.runtime.ownership import Owners
from corral.runtime.pools import PoolManager
from corral.schema import SandboxSpec
from tests.conftest import requires_root


def test_stamp_and_sees():
    owners = Owners()
    spec = SandboxSpec(tenant="alice")
    assert owners.sees(spec) and owners.stamp(spec).tenant == "alice"  # the admin
    with owners.acting_as("bob"):
        assert not owners.sees(spec) and owners.stamp(spec).tenant == "bob"
        with owners.acting_as(None):
            assert owners.sees(spec)
        assert owners.acting() == "bob"
    assert owners.acting() is None


@requires_root
async def test_another_owners_things_are_unknown(engine):
    owners = engine.owners
    with owners.acting_as("alice"):
        info = await engine.create(owners.stamp(SandboxSpec(memory_mb=64)))
        snap = await engine.snapshot(info.id, name="owned-snap")
    assert info.spec.tenant == "alice"
    with owners.acting_as("bob"):
        assert engine.list() == [] and engine.list_snapshots() == []
        for call in (lambda: engine.get(info.id), lambda: engine.usage(info.id),
                     lambda: engine.list_processes(info.id)):
            with pytest.raises(SandboxNotFound):
                call()
        for coro in (lambda: engine.exec(info.id, ["true"]), lambda: engine.stop(info.id),
                     lambda: engine.snapshot(info.id),
                     lambda: engine.read_file(info.id, "/etc/hostname")):
            with pytest.raises(SandboxNotFound):
                await coro()
        assert await engine.delete(info.id) is False
        with pytest.raises(SnapshotNotFound):
            engine.get_snapshot(snap.id)
        with pytest.raises(SnapshotNotFound):
            engine.resolve_spec(SandboxSpec(snapshot="owned-snap"))
        assert await engine.delete_snapshot(snap.id) is False
    with owners.acting_as("alice"):
        assert (await engine.exec(info.id, ["true"])).returncode == 0
        assert [s.id for s in engine.list_snapshots()] == [snap.id]
    assert [i.id for i in engine.list()] == [info.id]  # the admin
    assert await engine.delete(info.id) is True
    assert await engine.delete_snapshot(snap.id) is True


@requires_root
async def test_pools_are_their_tenants(engine):
    pools = PoolManager(engine)
    try:
        with engine.owners.acting_as("alice"):
            made = pools.create_pool("alices", SandboxSpec(memory_mb=64), min_ready=0,
                                     max_size=1)
            assert made.spec.tenant == "alice"
        with engine.owners.acting_as("bob"):
            assert pools.list_pools() == []
            with pytest.raises(NotFound):
                pools.get_pool("alices")
            assert await pools.delete_pool("alices") is False
        assert [p.name for p in pools.list_pools()] == ["alices"]
    finally:
        await pools.close()
