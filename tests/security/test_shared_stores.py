"""Stores shared by every tenant (the sandbox log store, the eval store) cannot be
crowded by one tenant: each owner has a bound of its own, and when the whole store is
full the owner holding the most gives way first. The real stores, on real SQLite."""

from __future__ import annotations

import contextvars

import pytest

from corral.runtime import sandbox_logs
from corral.runtime.cmdtap import TAIL_BYTES, CommandTap
from corral.runtime.events import Events
from corral.runtime.sandbox_logs import SandboxLogs
from corral.schema import ExecEvent, ExecResult
from corral.server.compat.sandboxfusion_pools import FusionPools
from corral.server.evals import EvalReport, EvalStore

OWNERS = {"sb-quiet": "quiet", "sb-admin": None}


def _owner(sid: str) -> str | None:
    return OWNERS.get(sid, "hostile")


def _command(events: Events, sid: str, i: int) -> None:
    tap = CommandTap(events, sid, ["echo", str(i)])
    tap.see(ExecEvent("stdout", b"z" * TAIL_BYTES))
    tap.see(ExecEvent("exit", result=ExecResult(0)))
    tap.end()


async def test_one_tenant_cannot_push_out_anothers_logs(tmp_path, monkeypatch):
    monkeypatch.setattr(sandbox_logs, "MAX_TOTAL_BYTES", 400_000)
    monkeypatch.setattr(sandbox_logs, "MAX_OWNER_BYTES", 150_000)
    events = Events()
    logs = SandboxLogs(tmp_path / "logs.db", owner_of=_owner)
    logs.attach(events)
    try:
        for i in range(10):
            _command(events, "sb-quiet", i)
            _command(events, "sb-admin", i)
        logs.flush()
        for n in range(60):  # many sandboxes of one tenant, each under its ring
            for i in range(20):
                _command(events, f"sb-flood-{n}", i)
            logs.flush()
        assert len(logs.read("sb-quiet")) == 10  # untouched
        assert len(logs.read("sb-admin")) == 10
        assert logs.owner_bytes("hostile") <= 150_000
        assert logs.stats()["bytes"] <= 400_000
        assert len(logs.read("sb-flood-59")) == 20  # its newest kept, its oldest gone
        assert logs.read("sb-flood-0") == []
    finally:
        await logs.close()
    # the bound is counted from the database: a reopened store (a restart) knows it
    again = SandboxLogs(tmp_path / "logs.db", owner_of=_owner)
    try:
        assert again.owner_bytes("hostile") == logs.owner_bytes("hostile") > 0
        assert again.owner_bytes("quiet") > 0
    finally:
        await again.close()


async def test_many_tenants_filling_the_store_share_it(tmp_path, monkeypatch):
    monkeypatch.setattr(sandbox_logs, "MAX_TOTAL_BYTES", 200_000)
    monkeypatch.setattr(sandbox_logs, "MAX_OWNER_BYTES", 150_000)
    events = Events()
    owners = {f"sb-{n}": f"t{n % 3}" for n in range(30)}
    logs = SandboxLogs(tmp_path / "logs.db", owner_of=owners.__getitem__)
    logs.attach(events)
    try:
        for i in range(5):
            _command(events, "sb-1", i)  # t1 has a little
        logs.flush()
        for n in range(0, 30, 3):  # t0 floods past the total
            for i in range(20):
                _command(events, f"sb-{n}", i)
            logs.flush()
        assert len(logs.read("sb-1")) == 5
        assert logs.stats()["bytes"] <= 200_000
    finally:
        await logs.close()


def _report(i: int) -> EvalReport:
    return EvalReport(name=f"policy-{i}")


@pytest.mark.parametrize("hostile_runs", [1, 60, 300])
def test_one_tenant_cannot_push_out_anothers_eval_runs(hostile_runs):
    store = EvalStore(max_runs=100, per_owner=50)
    for i in range(50):
        store.put(f"ev-{i:08x}", _report(i), "quiet")
    for i in range(40):
        store.put(f"ev-{1000 + i:08x}", _report(i), None)  # the admin's
    for i in range(hostile_runs):
        store.put(f"ev-{5000 + i:08x}", _report(i), "hostile")
    runs = store.list(None, admin=True)
    assert len(runs) <= 100
    mine = len(store.list("quiet", admin=False))
    admins = len([r for r in runs if r.owner is None])
    hostile = len(store.list("hostile", admin=False))
    # nobody is pushed below an equal share, and the newcomer never holds more
    share = 100 // 3
    assert min(admins, 40) >= min(40, share) and mine >= min(50, share), (admins, mine)
    assert hostile <= max(mine, admins) and hostile <= min(hostile_runs, 50)


async def test_one_tenant_cannot_take_every_sandboxfusion_pool():
    class Manager:
        async def delete_owned(self, owner, name):
            return True

        def detached(self):  # the daemon's context, as PoolManager.detached gives
            return contextvars.copy_context()

    pools = FusionPools(idle_s=300, max_pools=8, per_owner=2)
    for memory in (64, 65, 66):  # a hostile client's ever new shapes
        if pools.has_room("hostile"):
            pools.add(("hostile", "python", memory), f"p{memory}", Manager())
    assert len(pools.names) == 2  # its third shape runs in a plain sandbox
    assert pools.has_room("quiet") and pools.has_room(None)
    pools.add(("quiet", "python", 64), "q64", Manager())
    assert pools.get(("quiet", "python", 64)) == "q64"
    for task in [pools._sweeper]:
        if task is not None:
            task.cancel()
