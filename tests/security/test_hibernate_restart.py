"""Attacks on a hibernated sandbox across a restart of its engine (docs/live.md,
"Hibernate"; runtime/engine_hibernate.py).

A hibernated sandbox holds no process: the next engine finds it by the checkpoint its
registry row names. Another tenant must reach it no better than before the restart
(every verb answers as for an unknown id, and it stays hibernated); images edited on
disk while no engine ran restore confined or not at all; a row made to name another
sandbox's checkpoint is not resumed from it. Hibernating is no way around a maximum
lifetime (``on_timeout="hibernate"`` cycles end there), and the checkpoint a sandbox
sleeps in cannot be deleted from under it."""

from __future__ import annotations

import asyncio
import time

import pytest

from corral.errors import CorralError, InvalidState, SandboxNotFound
from corral.runtime.engine import Engine
from corral.schema import SandboxState
from tests.conftest import requires_root
from tests.security.test_live_checkpoint import _drop_seccomp, _forge_userns, _need_criu

pytestmark = [requires_root, pytest.mark.root, pytest.mark.timeout(300)]

ALICE, BOB = {"owner": "alice"}, {"owner": "bob"}


async def _hibernated_then_reopened(state_dir, n: int = 1) -> tuple[Engine, list[str]]:
    """``n`` of alice's sandboxes hibernated, then the engine closed (its sandboxes left
    as they are) and a new one opened on the same state directory."""
    first = await Engine.open(state_dir)
    try:
        ids = []
        for _ in range(n):
            sb = await first.create(network="none", checkpointable=True, tenant="alice")
            await first.exec(sb.id, ["sh", "-c", "echo kept > /tmp/mine"])
            await first.hibernate(sb.id, **ALICE)
            ids.append(sb.id)
    finally:
        await first.close(stop_sandboxes=False)
    return await Engine.open(state_dir), ids


async def test_after_a_restart_another_tenant_reaches_no_hibernated_sandbox(state_dir):
    _need_criu()
    engine, [sid] = await _hibernated_then_reopened(state_dir)
    try:
        assert engine.get(sid, **ALICE).reason == "hibernated"
        for verb in (engine.resume, engine.hibernate, engine.stop):
            with pytest.raises(SandboxNotFound):
                await verb(sid, **BOB)
        with pytest.raises(SandboxNotFound):
            engine.get(sid, **BOB)
        with pytest.raises(SandboxNotFound):
            await engine.exec(sid, ["true"], **BOB)
        with pytest.raises(SandboxNotFound):
            await engine.set_timeout(sid, 5, **BOB)
        await engine.wake(sid, **BOB)  # nothing: not bob's
        assert await engine.delete(sid, **BOB) is False
        assert engine.list_snapshots(**BOB) == []
        assert engine._get_live(sid).hibernated is not None  # still hibernated, hers
        await engine.wake(sid, **ALICE)
        r = await engine.exec(sid, ["cat", "/tmp/mine"], **ALICE)
        assert r.stdout == b"kept\n"
    finally:
        await engine.close()


@pytest.mark.parametrize("forge", [_forge_userns, _drop_seccomp])
async def test_images_edited_while_no_engine_ran_resume_confined_or_not_at_all(
        state_dir, forge):
    _need_criu()
    first = await Engine.open(state_dir)
    try:
        sb = await first.create(network="none", checkpointable=True)
        await first.hibernate(sb.id)
        images = first.checkpoint_images(first._get_live(sb.id).hibernated)
    finally:
        await first.close(stop_sandboxes=False)
    forge(images)
    engine = await Engine.open(state_dir)
    try:
        try:
            await engine.resume(sb.id)
        except CorralError as exc:  # refused: it stays hibernated, nothing of it runs
            assert exc.code, exc.message
            info = engine.get(sb.id)
            assert (info.state, info.reason) == (SandboxState.PAUSED, "hibernated")
            assert not [i for i in engine.list() if i.state == SandboxState.RUNNING]
        else:  # restored: as its new slot's own uid, confined
            live = engine._get_live(sb.id)
            pids = [p for p in live.cgroup.pids() if p != live.proc.pid]
            uids = {int(open(f"/proc/{p}/status").read().split("Uid:")[1].split()[0])
                    for p in pids}
            assert uids == {live.uid} and 0 not in uids
        assert await engine.delete(sb.id)
    finally:
        await engine.close()


async def test_a_row_naming_another_sandboxs_checkpoint_is_not_resumed_from_it(state_dir):
    """Two of alice's sandboxes hibernated; the registry row of one is edited (the
    database is root's: a bug or a hand) to name the other's checkpoint: the next
    engine does not resume one sandbox into another's processes, it fails it."""
    _need_criu()
    engine, (a, b) = await _hibernated_then_reopened(state_dir, n=2)
    try:
        other = engine._get_live(b).hibernated
    finally:
        await engine.close(stop_sandboxes=False)
    first = await Engine.open(state_dir)
    first.registry.set_hibernated(a, other)
    await first.close(stop_sandboxes=False)
    engine = await Engine.open(state_dir)
    try:
        info = engine.get(a)
        assert info.state == SandboxState.FAILED, info
        assert engine.get(b).reason == "hibernated"
        await engine.wake(b, **ALICE)
        assert (await engine.exec(b, ["cat", "/tmp/mine"])).stdout == b"kept\n"
    finally:
        await engine.close()


async def test_hibernating_at_each_timeout_does_not_outlive_the_maximum_lifetime(engine):
    """A sandbox whose timeout hibernates it, woken again each time, gets a fresh
    lifetime only within its owner's maximum counted from its create (the server's
    ``lifetime_cap``, as ``SandboxService.lifetime_left``): then its resume is refused,
    typed, and, never to be resumed, it ends (it held its places in the quotas for good:
    auto-pause was a way around the maximum), its checkpoint kept as a snapshot to
    restore as a new sandbox."""
    _need_criu()
    maximum = 5.0
    engine.lifetime_cap = lambda info: maximum - (time.time() - info.created_at)
    sb = await engine.create(network="none", checkpointable=True, timeout=2.0,
                             on_timeout="hibernate")
    for _ in range(20):  # bounded: each round is at least its 2 s lifetime
        for _ in range(600):
            if (info := engine.get(sb.id)).reason == "hibernated" or info.state.terminal:
                break
            await asyncio.sleep(0.1)
        if engine.get(sb.id).state.terminal:
            break  # ended by the reaper, at its maximum, before the wake came
        try:
            await engine.wake(sb.id)
        except InvalidState as exc:
            assert exc.details["cause"] == "max_lifetime", exc.message
            break
        assert engine.get(sb.id).spec.timeout <= maximum
    else:
        raise AssertionError("woken past its maximum lifetime")
    for _ in range(600):
        if engine.get(sb.id).state.terminal:
            break
        await asyncio.sleep(0.05)
    ended = engine.get(sb.id)
    assert ended.state.terminal and ended.reason.startswith("max lifetime"), ended.reason
    assert ended.ended_at - ended.created_at >= maximum
    [snap] = engine.list_snapshots()  # its processes, kept: restored as a new sandbox
    again = await engine.create(snapshot=snap.id)
    assert (await engine.exec(again.id, ["echo", "up"])).stdout == b"up\n"
    await engine.delete(again.id)
    assert await engine.delete_snapshot(snap.id)


async def test_the_checkpoint_a_sandbox_sleeps_in_cannot_be_deleted_from_under_it(engine):
    _need_criu()
    sb = await engine.create(network="none", checkpointable=True, tenant="alice")
    await engine.hibernate(sb.id, **ALICE)
    [snap] = engine.list_snapshots(**ALICE)
    assert await engine.delete_snapshot(snap.id, **BOB) is False  # another's: unknown
    with pytest.raises(InvalidState):
        await engine.delete_snapshot(snap.id, **ALICE)
    await engine.wake(sb.id, **ALICE)  # still resumable
    assert (await engine.exec(sb.id, ["true"], **ALICE)).returncode == 0
    assert await engine.delete(sb.id, **ALICE)
