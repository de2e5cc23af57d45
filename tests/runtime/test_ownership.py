"""The one ownership rule at the engine: for one tenant (``owner=``, passed with every
call), another's sandboxes, snapshots and pools are ids that do not exist; for the
admin (None), all are seen. Nothing is ambient: an engine call names its owner."""

from __future__ import annotations

import pytest

from corral.errors import InternalError, NotFound, SandboxNotFound, SnapshotNotFound
from corral.runtime.ownership import UNSET, Owners
from corral.runtime.pools import PoolManager
from corral.schema import SandboxSpec
from tests.conftest import requires_root


def test_stamp_and_sees():
    owners = Owners()
    spec = SandboxSpec(tenant="alice")
    assert owners.sees(spec, None) and owners.stamp(spec, None).tenant == "alice"  # the admin
    assert not owners.sees(spec, "bob") and owners.stamp(spec, "bob").tenant == "bob"
    assert owners.sees(spec, "alice")
    assert owners.of(UNSET) is None  # a library engine, told nothing: the admin
    owners.require_caller()
    with pytest.raises(InternalError, match="no caller"):
        owners.sees(spec, UNSET)
    assert owners.of(None) is None and owners.of("bob") == "bob"  # named: as ever


@requires_root
async def test_another_owners_things_are_unknown(engine):
    info = await engine.create(SandboxSpec(memory_mb=64, tenant="alice"))
    snap = await engine.snapshot(info.id, name="owned-snap", owner="alice")
    assert info.spec.tenant == "alice"
    bob = {"owner": "bob"}
    assert engine.list(**bob) == [] and engine.list_snapshots(**bob) == []
    for call in (lambda: engine.get(info.id, **bob), lambda: engine.usage(info.id, **bob),
                 lambda: engine.list_processes(info.id, **bob)):
        with pytest.raises(SandboxNotFound):
            call()
    for coro in (lambda: engine.exec(info.id, ["true"], **bob),
                 lambda: engine.stop(info.id, **bob), lambda: engine.snapshot(info.id, **bob),
                 lambda: engine.pause(info.id, **bob),
                 lambda: engine.read_file(info.id, "/etc/hostname", **bob)):
        with pytest.raises(SandboxNotFound):
            await coro()
    assert await engine.delete(info.id, **bob) is False
    with pytest.raises(SnapshotNotFound):
        engine.get_snapshot(snap.id, **bob)
    with pytest.raises(SnapshotNotFound):
        engine.resolve_spec(SandboxSpec(snapshot="owned-snap"), **bob)
    assert await engine.delete_snapshot(snap.id, **bob) is False
    assert (await engine.exec(info.id, ["true"], owner="alice")).returncode == 0
    assert [s.id for s in engine.list_snapshots(owner="alice")] == [snap.id]
    assert [i.id for i in engine.list(owner=None)] == [info.id]  # the admin
    assert await engine.delete(info.id, owner="alice") is True
    assert await engine.delete_snapshot(snap.id, owner=None) is True


@requires_root
async def test_pools_are_their_tenants(engine):
    pools = PoolManager(engine)
    try:
        made = pools.create_pool("alices", SandboxSpec(memory_mb=64), min_ready=0,
                                 max_size=1, owner="alice")
        assert made.spec.tenant == "alice"
        assert pools.list_pools(owner="bob") == []
        with pytest.raises(NotFound):
            pools.get_pool("alices", owner="bob")
        assert await pools.delete_pool("alices", owner="bob") is False
        assert [p.name for p in pools.list_pools(owner=None)] == ["alices"]
    finally:
        await pools.close()
