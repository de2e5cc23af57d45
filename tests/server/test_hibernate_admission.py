"""A hibernated sandbox and the daemon's caps (server/admission.py).

Hibernated, a sandbox holds no process and no memory: it leaves ``max_sandboxes`` and
``max_memory_mb`` (before, it kept its place, and a daemon full of sleeping sandboxes
refused new ones). It stays in its tenant's quota (tests/security/test_hibernate_quota.py).
Its resume waits for room like a create: with none, it fails typed with
``CapacityExceeded``, and the sandbox is still hibernated with its processes and files,
to resume once there is room.
"""

from __future__ import annotations

import pytest

from corral.errors import CapacityExceeded
from corral.runtime.engine import Engine
from corral.schema import SandboxSpec
from corral.server.admission import Admission, Limits
from corral.server.caller import Caller
from corral.server.sandbox_verbs import SandboxVerbs
from corral.server.service import SandboxService
from tests.conftest import requires_root
from tests.runtime.test_checkpoint import HEAP_COUNTER, heap_count
from tests.security.test_live_checkpoint import _need_criu

pytestmark = [requires_root, pytest.mark.root, pytest.mark.timeout(180)]


def _service(engine: Engine) -> SandboxService:
    # room for one sandbox of 64 MB; a create or resume without room waits 0.2 s for it
    limits = Limits(max_starting=4, max_sandboxes=1, max_memory_mb=64, queue_size=8,
                    queue_timeout=0.2)
    svc = SandboxService(engine, Admission(limits))
    svc.count_adopted()  # as the daemon does at its start
    return svc


async def test_a_hibernated_sandbox_frees_the_caps_and_its_resume_waits_for_room(state_dir):
    _need_criu()
    admin = Caller()  # the admin
    spec = SandboxSpec(memory_mb=64, network="none", checkpointable=True)
    engine = await Engine.open(state_dir)
    try:
        svc = _service(engine)
        a = await svc.create(spec, admin)
        await engine.exec(a.id, ["sh", "-c", "echo kept > /tmp/file; " + HEAP_COUNTER])
        count0, heap0 = await heap_count(engine, a.id)
        with pytest.raises(CapacityExceeded):  # the daemon is full
            await svc.create(spec, admin)
        await engine.hibernate(a.id)
        assert svc.admission.alive == 0 and svc.admission.committed_memory_mb == 0
        b = await svc.create(spec, admin)  # before: CapacityExceeded (max_sandboxes)
        verbs = SandboxVerbs(engine, admin)
        for resume in (lambda: engine.resume(a.id), lambda: verbs.exec(a.id, ["true"])):
            with pytest.raises(CapacityExceeded) as err:  # no room to run it again
                await resume()
            assert err.value.details["limit"] == "max_sandboxes"
            info = engine.get(a.id)  # hibernated still, nothing lost
            assert (info.state.value, info.reason) == ("paused", "hibernated")
        assert svc.admission.alive == 1
        await svc.delete(b.id, admin)
    finally:
        await engine.close(stop_sandboxes=False)
    # across a restart: the sleeping one is not counted, its resume takes the room
    engine = await Engine.open(state_dir)
    try:
        svc = _service(engine)
        assert svc.admission.alive == 0
        info = await engine.resume(a.id)
        assert info.state.value == "running" and svc.admission.alive == 1
        count, heap = await heap_count(engine, a.id)
        assert heap == heap0 and count >= count0  # its process counts on, its heap intact
        assert (await engine.exec(a.id, ["cat", "/tmp/file"])).stdout == b"kept\n"
        with pytest.raises(CapacityExceeded):  # counted again
            await svc.create(spec, admin)
        await svc.delete(a.id, admin)
        assert svc.admission.alive == 0
    finally:
        await engine.close()
