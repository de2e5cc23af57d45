"""Red-team: hibernation and a tenant's quotas.

- A checkpoint's process images count in its tenant's snapshot quota. The quota was
  checked before the dump (room left) and again at the commit of its files, with the
  fresh images counted: refused there, the images stayed on disk, under no snapshot,
  counted in the tenant's quota for good (nothing deleted them). A timeout that
  hibernates (``on_timeout="hibernate"``, E2B's auto-pause) failed half-way the same way
  and left them too; now it ends the sandbox as any timeout does, nothing left.
- A hibernated sandbox still counts in ``max_sandboxes`` (it resumes without asking),
  before and after a daemon restart: hibernating is no way to hold more sandboxes.
"""

from __future__ import annotations

import asyncio

import pytest

from corral.errors import QuotaExceeded
from corral.runtime.engine import Engine
from corral.schema import SandboxSpec
from corral.server.admission import Admission, Limits
from corral.server.caller import Caller
from corral.server.quotas import Quotas
from corral.server.service import SandboxService
from corral.server.tenants import Tenant
from tests.conftest import requires_root
from tests.security.test_live_checkpoint import _need_criu

pytestmark = [requires_root, pytest.mark.root, pytest.mark.timeout(180)]


def _images(engine: Engine, tenant: str) -> list[str]:
    root = engine.layout.state_dir / "checkpoints" / tenant
    return sorted(p.name for p in root.iterdir()) if root.exists() else []


async def test_a_checkpoint_refused_at_its_commit_leaves_no_images(engine):
    _need_criu()
    engine.snapshots.quota_of = lambda owner: (256 << 10) if owner == "alice" else None
    alice = {"owner": "alice"}
    sb = await engine.create(network="none", checkpointable=True, tenant="alice")
    try:
        await engine.exec(sb.id, ["sh", "-c", "head -c 1048576 /dev/urandom > /tmp/big"],
                          **alice)
        for verb in (engine.checkpoint, engine.hibernate):
            with pytest.raises(QuotaExceeded):  # under the quota before, over at commit
                await verb(sb.id, **alice)
            assert _images(engine, "alice") == [] and engine.list_snapshots(**alice) == []
            assert engine.images_bytes("alice") == 0
        assert engine.get(sb.id).state.value == "running"  # untouched
    finally:
        await engine.delete(sb.id)
    # the same at its timeout: the sandbox ends, with the cause, and nothing is left
    sb = await engine.create(network="none", checkpointable=True, tenant="alice",
                             timeout=600, on_timeout="hibernate")
    await engine.exec(sb.id, ["sh", "-c", "head -c 1048576 /dev/urandom > /tmp/big"], **alice)
    # then it times out (a 1 s lifetime from the create could end before the write came)
    await engine.set_timeout(sb.id, 0.5, **alice)
    for _ in range(1200):
        if engine.get(sb.id).state.terminal:
            break
        await asyncio.sleep(0.05)
    ended = engine.get(sb.id)
    assert ended.state.terminal and "could not hibernate" in (ended.reason or ""), ended
    assert _images(engine, "alice") == [] and engine.list_snapshots(**alice) == []


def _service(engine: Engine) -> SandboxService:
    admission = Admission(Limits(max_starting=4, max_sandboxes=8, max_memory_mb=4096,
                                 queue_size=8, queue_timeout=30),
                          Quotas(lambda name: Tenant(name, max_sandboxes=1) if name else None))
    svc = SandboxService(engine, admission)
    svc.count_adopted()  # as the daemon does at its start
    return svc


async def test_a_hibernated_sandbox_counts_in_max_sandboxes_across_a_restart(state_dir):
    _need_criu()
    t = Caller.of_tenant(Tenant("t", max_sandboxes=1))
    spec = SandboxSpec(memory_mb=64, network="none", checkpointable=True)
    first = await Engine.open(state_dir)
    try:
        svc = _service(first)
        a = await svc.create(spec, t)
        await first.hibernate(a.id, owner="t")
        with pytest.raises(QuotaExceeded):
            await svc.create(spec, t)
    finally:
        await first.close(stop_sandboxes=False)
    engine = await Engine.open(state_dir)
    try:
        svc = _service(engine)
        assert engine.get(a.id, owner="t").reason == "hibernated"
        with pytest.raises(QuotaExceeded):
            await svc.create(spec, t)
        await svc.delete(a.id, t)
        b = await svc.create(spec, t)  # its place given back with it
        await svc.delete(b.id, t)
    finally:
        await engine.close()
