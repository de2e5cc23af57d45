"""Red-team: a GPU sandbox and hibernation. Hibernating would give its GPU back (its
processes gone) while its tenant's quota kept counting it; a restarted daemon counted
each adopted sandbox by the GPUs it held, none for a hibernated one, so a tenant at
``max_gpus=1`` could hibernate, wait for a restart, take another GPU and resume: two.
Today CRIU refuses a sandbox with a GPU device (typed, it keeps running and its GPU),
and the restarted daemon counts a hibernated sandbox's GPUs from its spec (service
``count_adopted``) should that change; ``on_timeout="hibernate"`` with GPUs is refused at
create (tests/runtime/test_checkpoint.py). (Two fake GPUs: test_gpu_quota's fixtures.)"""

from __future__ import annotations

import pytest

from corral.errors import Unsupported
from corral.schema import SandboxSpec
from corral.server.caller import Caller
from corral.server.tenants import Tenant
from tests.conftest import requires_root
from tests.security.test_live_checkpoint import _need_criu
from tests.server import test_gpu_quota

gpu_backend, service = test_gpu_quota.gpu_backend, test_gpu_quota.service  # fixtures

pytestmark = [requires_root, pytest.mark.root, pytest.mark.timeout(120)]


async def test_a_gpu_sandbox_does_not_hibernate_out_of_its_quota(service):
    _need_criu()
    t = Caller.of_tenant(Tenant("t", max_gpus=1))
    engine = service.engine
    spec = SandboxSpec(gpus=1, memory_mb=64, network="none", checkpointable=True)
    a = await service.create(spec, t)
    try:
        with pytest.raises(Unsupported):
            await engine.hibernate(a.id, owner="t")
        assert len(engine.gpus.held_by(a.id)) == 1
        assert (await engine.exec(a.id, ["echo", "up"], owner="t")).stdout == b"up\n"
    finally:
        await engine.delete(a.id)
