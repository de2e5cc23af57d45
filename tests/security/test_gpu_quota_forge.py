"""Red-team: a tenant with ``max_gpus=1`` tries to hold more GPUs than its quota by the
shape of its request: ``"all"``, a count, a list naming one GPU by index and another by
UUID (or the same GPU twice), a fork of its GPU sandbox, a ``tenant`` field naming
nobody (the admin's, unquota'd). Every one is refused typed before anything is held,
and the GPUs stay where they were. (Two fake GPUs: test_gpu_quota's fixtures.)"""

from __future__ import annotations

import pytest

from corral.errors import QuotaExceeded
from corral.schema import SandboxSpec
from corral.server.caller import Caller
from corral.server.tenants import Tenant
from tests.conftest import requires_root
from tests.server import test_gpu_quota

gpu_backend, service = test_gpu_quota.gpu_backend, test_gpu_quota.service  # fixtures


@requires_root
async def test_no_request_shape_holds_more_gpus_than_the_quota(service):
    t = Caller.of_tenant(Tenant("t", max_gpus=1))
    uuid1 = service.engine.gpus.describe()[1]["uuid"]
    for gpus in ("all", 2, ["0", "1"], ["0", uuid1]):
        with pytest.raises(QuotaExceeded):
            await service.create(SandboxSpec(gpus=gpus, memory_mb=64), t)
    assert service.engine.gpus.free() == [0, 1] and service.engine.list() == []
    forged = SandboxSpec.parse(gpus=2, memory_mb=64, tenant=None)  # "the admin's"
    with pytest.raises(QuotaExceeded):
        await service.create(forged, t)
    a = await service.create(SandboxSpec(gpus=1, memory_mb=64), t)  # its one
    try:
        assert a.spec.tenant == "t" and len(service.engine.gpus.held_by(a.id)) == 1
        for spec in (SandboxSpec(gpus=1, memory_mb=64),
                     SandboxSpec(gpus=1, gpu_shared=True, memory_mb=64)):
            with pytest.raises(QuotaExceeded):
                await service.create(spec, t)
        with pytest.raises(QuotaExceeded):  # a copy inherits its GPUs: over the quota
            await service.fork(a.id, 1, t, live=False)
        assert len(service.engine.gpus.free()) == 1
        assert [i.id for i in service.engine.list() if not i.state.terminal] == [a.id]
    finally:
        await service.engine.delete(a.id)
