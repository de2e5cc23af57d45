"""Red-team: a tenant at its ``max_gpus`` asks for one more GPU while the host has none
free. The wait for a free GPU ran before the quota check: the tenant waited (or was
refused at once) with ``NoGpuCapacity`` (503, "try later"), when no wait could help it
but the end of its own sandboxes — the answer is ``QuotaExceeded`` (429). And that 503
told a tenant which GPU indices were free, i.e. what other tenants hold: a tenant reads
only what it asked for and the host's total (as ``GET /v1/info`` tells it); the admin
still reads the free indices. (Two fake GPUs: test_gpu_quota's fixtures; the book gives
every tenant ``max_gpus=1``.)"""

from __future__ import annotations

import pytest

from corral.errors import NoGpuCapacity, QuotaExceeded
from corral.schema import SandboxSpec
from corral.server.caller import ADMIN, Caller
from corral.server.tenants import Tenant
from tests.conftest import requires_root
from tests.server import test_gpu_quota

gpu_backend, service = test_gpu_quota.gpu_backend, test_gpu_quota.service  # fixtures


@requires_root
async def test_a_tenant_at_its_gpu_quota_is_told_so_not_that_gpus_are_busy(service):
    t = Caller.of_tenant(Tenant("t", max_gpus=1))
    mine = await service.create(SandboxSpec(gpus=1, memory_mb=64), t)
    other = await service.create(SandboxSpec(gpus=1, memory_mb=64), ADMIN)  # none free now
    try:
        assert service.engine.gpus.free() == []
        for wait in (None, 0.3):  # refused at once, or after its own wait: the quota
            with pytest.raises(QuotaExceeded) as caught:
                await service.create(SandboxSpec(gpus=1, memory_mb=64), t, wait=wait)
            assert caught.value.details["quota"] == "max_gpus"
        assert [i.id for i in service.engine.list() if not i.state.terminal] == [mine.id, other.id]
    finally:
        await service.engine.delete(mine.id)
        await service.engine.delete(other.id)


@requires_root
async def test_no_gpu_capacity_does_not_tell_a_tenant_which_gpus_are_free(service):
    held = await service.create(SandboxSpec(gpus=1, memory_mb=64), ADMIN)  # GPU 0
    t = Caller.of_tenant(Tenant("t", max_gpus=1))
    try:
        free = service.engine.gpus.free()
        assert len(free) == 1
        busy = next(str(i) for i in (0, 1) if i not in free)
        with pytest.raises(NoGpuCapacity) as caught:  # within its quota, the GPU is busy
            await service.create(SandboxSpec(gpus=[busy], memory_mb=64), t)
        exc = caught.value
        assert "free" not in exc.details and exc.details["total"] == 2
        assert str(free) not in exc.message and "free [" not in exc.message
        assert exc.status == 503
        with pytest.raises(NoGpuCapacity) as caught:  # the admin's view keeps them
            await service.create(SandboxSpec(gpus=[busy], memory_mb=64), ADMIN)
        assert caught.value.details["free"] == free
    finally:
        await service.engine.delete(held.id)
