"""GPUs in tenant quotas and admission: a tenant holds at most its token's ``max_gpus``
(none without it), and a create asking for more GPUs than are free waits, like a quota,
for a GPU sandbox to end — or is refused typed with what is free."""

from __future__ import annotations

import asyncio
import os
import shutil
import stat
import tempfile
from pathlib import Path

import pytest

from corral.errors import NoGpuCapacity, QuotaExceeded
from corral.runtime.gpus import DriverFiles, GpuDevice, StaticBackend
from corral.schema import SandboxSpec
from corral.server.admission import Admission, Limits
from corral.server.caller import ADMIN
from corral.server.quotas import Quotas
from corral.server.tenants import Tenant
from tests.conftest import requires_root


def _book(**quota) -> Quotas:
    return Quotas(lambda name: Tenant(name, **quota) if name == "t" else None)


def test_a_tenant_without_max_gpus_holds_none():
    book = _book(max_sandboxes=5)
    assert book.hold("t", 10, 0.1) is not None  # CPU sandboxes as before
    with pytest.raises(QuotaExceeded) as caught:
        book.hold("t", 10, 0.1, gpus=1)
    assert caught.value.details["quota"] == "max_gpus" and caught.value.details["limit"] == 0
    assert book.alone_over("t", 10, 0.1, 1) is not None  # waiting could never help


def test_max_gpus_counts_what_is_held():
    book = _book(max_gpus=2)
    a = book.hold("t", 10, 0.1, gpus=2)
    book.settle(a, "sb-a")
    assert book.usage("t").gpus == 2
    with pytest.raises(QuotaExceeded) as caught:
        book.hold("t", 10, 0.1, gpus=1)
    assert caught.value.details == {"quota": "max_gpus", "limit": 2, "used": 2,
                                    "requested": 1, "tenant": "t"}
    book.release("sb-a")
    assert book.hold("t", 10, 0.1, gpus=1) is not None
    assert book.hold(None, 10, 0.1, gpus=8) is None  # the admin: no quota


@pytest.fixture
def gpu_backend():
    if os.geteuid() != 0:
        pytest.skip("mknod needs root")
    tmp = Path(tempfile.mkdtemp(prefix="corral-test-gpuq-"))
    tmp.chmod(0o755)
    gpus = []
    for i in (0, 1):
        os.mknod(tmp / f"nvidia{i}", stat.S_IFCHR | 0o666, os.makedev(1, 3))
        gpus.append(GpuDevice(index=i, uuid=f"GPU-0000000{i}-aaaa-bbbb-cccc-dddddddddddd",
                              name="Fake GPU", minor=i, memory_mb=1024, node=tmp / f"nvidia{i}"))
    yield StaticBackend(gpus, DriverFiles(version="580.1"))
    shutil.rmtree(tmp, ignore_errors=True)


@pytest.fixture
async def service(state_dir, gpu_backend):
    from corral.runtime.engine import Engine
    from corral.server.service import SandboxService

    engine = await Engine.open(state_dir, gpus=gpu_backend)
    admission = Admission(Limits(max_starting=4, max_sandboxes=8, max_memory_mb=4096,
                                 queue_size=8, queue_timeout=30),
                          Quotas(lambda name: Tenant(name, max_gpus=1) if name else None))
    svc = SandboxService(engine, admission)
    try:
        yield svc
    finally:
        await engine.close()


@requires_root
async def test_a_create_waits_for_a_gpu_then_gets_it(service):
    a = await service.create(SandboxSpec(gpus=2, memory_mb=64), ADMIN)
    assert service.engine.gpus.free() == []
    with pytest.raises(NoGpuCapacity) as caught:  # no wait named: refused at once
        await service.create(SandboxSpec(gpus=1, memory_mb=64), ADMIN)
    assert caught.value.details["free"] == [] and caught.value.details["total"] == 2
    waiting = asyncio.ensure_future(
        service.create(SandboxSpec(gpus=1, memory_mb=64), ADMIN, wait=60))
    await asyncio.sleep(0.3)
    assert not waiting.done()  # queued, not failed
    await service.engine.delete(a.id)  # its GPUs come back: the waiter gets one
    b = await asyncio.wait_for(waiting, 60)
    assert len(service.engine.gpus.held_by(b.id)) == 1
    usage = service.engine.usage(b.id)
    assert usage["gpus"] == list(service.engine.gpus.held_by(b.id))
    assert usage["gpu_memory_mb"] == 0  # (no NVML here: no process memory to report)
    await service.engine.delete(b.id)


@requires_root
async def test_a_waiting_gpu_create_gives_up_typed(service):
    a = await service.create(SandboxSpec(gpus=2, memory_mb=64), ADMIN)
    with pytest.raises(NoGpuCapacity):
        await service.create(SandboxSpec(gpus=1, memory_mb=64), ADMIN, wait=0.5)
    assert len(service.engine.list()) == 1  # the refused create left nothing
    await service.engine.delete(a.id)
