"""Red-team: a tenant parks creates waiting for a GPU. Creates waiting for a tenant's quota
are bounded (``queue_size`` a tenant, server/admission.py); the wait for a free GPU came
before that and was not: every create of a tenant could wait ``queue_timeout`` for a GPU
another tenant holds, each an open request and a task on the daemon."""

from __future__ import annotations

import asyncio

import pytest

from corral.errors import NoGpuCapacity
from corral.schema import SandboxSpec
from corral.server.caller import ADMIN, Caller
from corral.server.tenants import Tenant
from tests.conftest import requires_root
from tests.server import test_gpu_quota

gpu_backend, service = test_gpu_quota.gpu_backend, test_gpu_quota.service  # fixtures


@requires_root
async def test_a_tenant_waits_for_a_gpu_with_at_most_queue_size_creates(service):
    held = await service.create(SandboxSpec(gpus=2, memory_mb=64), ADMIN)  # both GPUs
    queue_size = service.admission.limits.queue_size
    t = Caller.of_tenant(Tenant("t", max_gpus=queue_size + 1))  # all fit its quota
    service.admission.quotas._quota_of = lambda name: Tenant(name, max_gpus=queue_size + 1)
    parked = [asyncio.ensure_future(service.create(SandboxSpec(gpus=1, memory_mb=64), t,
                                                   wait=30))
              for _ in range(queue_size)]
    await asyncio.sleep(0.3)
    assert not any(p.done() for p in parked)  # waiting, as they may
    with pytest.raises(NoGpuCapacity, match="creates waiting already"):  # one more: not parked
        await service.create(SandboxSpec(gpus=1, memory_mb=64), t, wait=30)
    for p in parked:
        p.cancel()
    await asyncio.gather(*parked, return_exceptions=True)
    await service.engine.delete(held.id)
