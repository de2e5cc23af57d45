"""Attacks on hibernate / resume and the restores behind it (issue 29;
runtime/engine_hibernate.py, runtime/live_images.py, docs/live.md).

A sandbox's lifetime is a quota (its spec's ``timeout``, capped by ``--max-lifetime`` and
a tenant's ``max_lifetime``, counted from its start; ``set_timeout`` never lets it pass
that maximum counted from its create). Hibernating and resuming a sandbox restores its
processes into a new slot under the same id: if that counted as a new start, a tenant
could hibernate just before its lifetime ran out and resume for another full one,
forever. The resumed sandbox keeps its create time and only what was left of its
timeout (main's rule; tests/security/test_hibernate_restart.py has the maximum).

A hibernated sandbox has no processes, cgroup or writable layer: the verbs that need
them answer typed (``InvalidState``), never an internal error. After a resume the agent
is as unreachable as before, and a restore (done or refused half-way) leaves its
checkpoint's images as they were, with no uid's read access left behind.
"""

from __future__ import annotations

import asyncio
import errno
import hashlib
import os
import struct

import pytest

from corral.errors import InvalidState
from corral.runtime import criu
from corral.runtime.paths import default_cache_dir
from tests.conftest import requires_root

pytestmark = [requires_root, pytest.mark.root, pytest.mark.timeout(120)]


def _need_criu():
    if criu.find(default_cache_dir()) is None:
        pytest.skip(f"no cached CRIU: {criu.BUILD}")


async def test_resume_does_not_give_a_hibernated_sandbox_a_new_lifetime(engine):
    """Hibernated by hand just before its timeout, it resumes with what was left, not a
    fresh lifetime, and keeps its create time (its maximum counts from it)."""
    _need_criu()
    sb = await engine.create(network="none", checkpointable=True, timeout=600, tenant="alice")
    alice = {"owner": "alice"}
    try:
        before = engine.get(sb.id, **alice)
        await asyncio.sleep(0.5)  # some of its lifetime spent
        await engine.hibernate(sb.id, **alice)
        after = await engine.resume(sb.id, **alice)
        assert (await engine.exec(sb.id, ["echo", "up"], **alice)).stdout.strip() == b"up"
        again = engine.get(sb.id, **alice)
        assert after.created_at == again.created_at == before.created_at
        assert again.spec.timeout <= 600 - 0.5  # what was left of it
    finally:
        await engine.delete(sb.id)


async def test_verbs_on_a_hibernated_sandbox_answer_typed(engine):
    _need_criu()
    sb = await engine.create(network="none", checkpointable=True, tenant="alice")
    alice = {"owner": "alice"}
    try:
        await engine.hibernate(sb.id, **alice)
        for verb in (engine.snapshot, engine.checkpoint, engine.kill_processes):
            with pytest.raises(InvalidState):
                await verb(sb.id, **alice)
        with pytest.raises(InvalidState):
            await engine.fork(sb.id, 1, live=False, **alice)
        assert engine._get_live(sb.id).hibernated is not None  # untouched
        await engine.resume(sb.id, **alice)
        snap = await engine.snapshot(sb.id, **alice)  # once resumed, as any sandbox
        await engine.delete_snapshot(snap.id, **alice)
    finally:
        await engine.delete(sb.id)


async def test_the_agent_is_out_of_reach_after_a_resume(engine):
    """CRIU restores every process as it was dumped: the agent comes back non-dumpable,
    its memory, descriptors and environment still closed to the code it runs."""
    _need_criu()
    from tests.security.conftest import assert_honest, run_json
    from tests.security.test_agent_boundary import ATTACK, PROC_ATTACKS
    from tests.syscall_probe import numbers

    sb = await engine.create(network="none", checkpointable=True)
    try:
        await engine.hibernate(sb.id)
        await engine.resume(sb.id)
        res = await run_json(engine, sb.id, ATTACK, numbers(), "1")
        for name in PROC_ATTACKS:
            assert res[name] in (errno.EACCES, errno.EPERM), (name, res[name])
        control = await run_json(engine, sb.id, ATTACK, numbers(), "sibling")
        assert all(control[name] == "ok" for name in PROC_ATTACKS), control  # the probe works
        await assert_honest(engine, sb.id)
    finally:
        await engine.delete(sb.id)


def _seen(images) -> dict:
    """Each image file: its digest, its links, the uids its ACL lets read it."""
    out = {}
    for p in sorted(images.iterdir()):
        if p.is_dir():
            continue
        try:
            acl = os.getxattr(p, "system.posix_acl_access")
            users = [i for t, _, i in struct.iter_unpack("<HHI", acl[4:]) if t == 0x02]
        except OSError as exc:
            assert exc.errno == errno.ENODATA
            users = []
        out[p.name] = (hashlib.sha256(p.read_bytes()).hexdigest(), p.stat().st_nlink, users)
    return out


async def test_restores_leave_the_checkpoints_images_as_they_were(engine):
    """Restores read a checkpoint through hard links (CRIU runs as root): after two
    restores, and after one refused half-way (an entry that is not a plain file), its
    images are byte for byte the same, linked nowhere else, and no uid keeps the read
    access a restore was given (a slot's uid goes to another sandbox, maybe another
    tenant's, next)."""
    _need_criu()
    sb = await engine.create(network="none", checkpointable=True)
    snap = await engine.checkpoint(sb.id)
    images = engine.checkpoint_images(snap.id)
    try:
        before = _seen(images)
        assert all(n == 1 and users == [] for _, n, users in before.values()), before
        copies = [await engine.create(snapshot=snap.id) for _ in range(2)]
        assert _seen(images) == before
        for c in copies:
            await engine.delete(c.id)
        (images / "odd.img").mkdir()  # staged after some links were made, most likely
        with pytest.raises(InvalidState):
            await engine.create(snapshot=snap.id)
        assert _seen(images) == before
    finally:
        await engine.delete(sb.id)
        await engine.delete_snapshot(snap.id)
