"""A DELETE or a stop that lands while a hibernated sandbox is being resumed (red team).

A resume takes the hibernated sandbox out of the engine's table and creates it again
from its checkpoint under the same id. Before: a delete then failed with InvalidState
("cannot go from running to stopped") after killing the new sandbox's agent, left its
row ``running`` and its admission slot taken for good; a delete or stop that waited for
the resume ended the *old* object and dropped the new, running sandbox from the table
(its processes unreachable, out of every quota and cap). Now both wait for the resume
and act on what it leaves.
"""

from __future__ import annotations

import asyncio

import pytest

from corral.errors import CorralError, SandboxNotFound, SandboxStartError
from corral.schema import SandboxState
from tests.conftest import requires_root
from tests.security.test_live_checkpoint import _need_criu

pytestmark = [requires_root, pytest.mark.root, pytest.mark.timeout(180)]


@pytest.mark.parametrize("verb", ["delete", "stop"])
async def test_a_delete_or_stop_during_a_resume_acts_on_the_resumed_sandbox(engine, verb):
    _need_criu()
    sb = await engine.create(network="none", checkpointable=True)
    await engine.hibernate(sb.id)
    held, go = asyncio.Event(), asyncio.Event()
    restore = engine._launch_restore

    async def held_restore(live, slot, lowers):  # the resume's create, mid-start
        held.set()
        await go.wait()
        return await restore(live, slot, lowers)

    engine._launch_restore = held_restore
    resume = asyncio.ensure_future(engine.resume(sb.id))
    await asyncio.wait_for(held.wait(), 60)
    acting = asyncio.ensure_future(getattr(engine, verb)(sb.id))
    await asyncio.sleep(0.2)  # the verb reached the engine while the resume is held
    go.set()
    done = await asyncio.wait_for(acting, 60)
    await asyncio.wait_for(resume, 60)
    if verb == "delete":
        assert done is True, "the delete answered 'not found' for the sandbox being resumed"
        with pytest.raises(SandboxNotFound):
            engine.get(sb.id)
    else:
        assert engine.get(sb.id).state == SandboxState.STOPPED
    assert sb.id not in engine._live  # nothing left running out of the engine's sight


async def test_a_delete_of_a_sandbox_still_starting_wins(engine):
    """Its id is listed (its row is written) before its agent is ready: deleting it
    then ends it; its create fails typed rather than bringing it up untracked."""
    held, go = asyncio.Event(), asyncio.Event()
    settle = engine._settle_network

    async def held_settle(live):  # its agent is ready: the create is about to finish
        held.set()
        await go.wait()
        return await settle(live)

    engine._settle_network = held_settle
    creating = asyncio.ensure_future(engine.create(network="none"))
    await asyncio.wait_for(held.wait(), 60)
    [pending] = [i.id for i in engine.list(owner=None)]
    deleting = asyncio.ensure_future(engine.delete(pending))
    await asyncio.sleep(0.2)
    go.set()
    assert await asyncio.wait_for(deleting, 60) is True
    with pytest.raises(SandboxStartError, match="deleted while it started"):
        await asyncio.wait_for(creating, 60)
    with pytest.raises(SandboxNotFound):
        engine.get(pending)
    assert pending not in engine._live


async def test_the_resumes_own_cleanup_does_not_wait_for_itself(engine):
    """A create that fails late deletes its sandbox itself (an entrypoint that cannot
    start); within a resume, that delete must not wait for the resume it is part of."""
    _need_criu()
    sb = await engine.create(network="none", checkpointable=True)
    await engine.hibernate(sb.id)
    restore = engine._launch_restore
    inner: list[bool] = []

    async def deleting_restore(live, slot, lowers):  # in the resume's own task
        async with asyncio.timeout(30):  # (not wait_for: the same task, as create's own)
            inner.append(await engine.delete(live.id, owner=None))
        return await restore(live, slot, lowers)

    engine._launch_restore = deleting_restore
    try:
        await asyncio.wait_for(engine.resume(sb.id), 60)
    except CorralError:
        pass  # its sandbox was deleted under it: a typed failure
    finally:
        engine._launch_restore = restore
    assert inner == [True]
    await engine.delete(sb.id)


@pytest.mark.parametrize("verb", ["delete", "stop", "wake"])
async def test_another_tenants_verb_does_not_wait_for_a_resume(engine, verb):
    """Red team 13: another tenant's delete, stop or wake of an id being resumed answers
    as for an unknown id, at once (it waited for the resume: its time said the id was
    someone's, resuming), and leaves the resume alone."""
    _need_criu()
    sb = await engine.create(network="none", checkpointable=True, tenant="alice")
    await engine.hibernate(sb.id, owner="alice")
    held, go = asyncio.Event(), asyncio.Event()
    restore = engine._launch_restore

    async def held_restore(live, slot, lowers):
        held.set()
        await go.wait()
        return await restore(live, slot, lowers)

    engine._launch_restore = held_restore
    resume = asyncio.ensure_future(engine.resume(sb.id, owner="alice"))
    try:
        await asyncio.wait_for(held.wait(), 60)
        acting = asyncio.ensure_future(getattr(engine, verb)(sb.id, owner="bob"))
        finished, _ = await asyncio.wait({acting}, timeout=30)  # the resume is held
        assert finished, f"bob's {verb} waited for alice's resume"
        if verb == "delete":
            assert acting.result() is False
        elif verb == "stop":
            with pytest.raises(SandboxNotFound):
                acting.result()
    finally:
        go.set()
        await asyncio.wait_for(resume, 60)
    assert engine.get(sb.id, owner="alice").state == SandboxState.RUNNING
    await engine.delete(sb.id, owner="alice")


@pytest.mark.parametrize("where", ["out_of_the_table", "starting"])
@pytest.mark.parametrize("verb", ["resume", "exec"])
async def test_its_owners_resume_or_command_during_a_resume_waits_for_it(engine, verb, where):
    """Red team 13: a second resume, or a command (its wake), by the owner while the
    first resume runs waited for nothing: it found the sandbox out of the table (not
    found: held here before the resume's create writes it again) or pending (InvalidState
    'create a new one': held while it starts). It now waits, and finds it running."""
    _need_criu()
    sb = await engine.create(network="none", checkpointable=True, tenant="alice")
    await engine.hibernate(sb.id, owner="alice")
    held, go = asyncio.Event(), asyncio.Event()

    def holding(step):
        async def held_step(*args):
            held.set()
            await go.wait()
            return await step(*args)
        return held_step

    if where == "starting":
        engine._launch_restore = holding(engine._launch_restore)
    else:
        engine.snapshots.lowers = holding(engine.snapshots.lowers)
    resume = asyncio.ensure_future(engine.resume(sb.id, owner="alice"))
    try:
        await asyncio.wait_for(held.wait(), 60)
        if verb == "resume":
            second = asyncio.ensure_future(engine.resume(sb.id, owner="alice"))
        else:
            async def command():  # what the service layer does: wake, then the verb
                await engine.wake(sb.id, owner="alice")
                return await engine.exec(sb.id, ["true"], owner="alice")
            second = asyncio.ensure_future(command())
        await asyncio.sleep(0.2)
        go.set()
        got = await asyncio.wait_for(second, 60)
    finally:
        go.set()
        await asyncio.wait_for(resume, 60)
    if verb == "resume":
        assert got.state == SandboxState.RUNNING
    else:
        assert got.returncode == 0
    await engine.delete(sb.id, owner="alice")


async def test_a_sandbox_being_resumed_stays_in_its_owners_view(engine):
    """Red team 13: its row was deleted as its resume began and written again by the
    resume's create: a GET or listing in between (an image's layers looked up, a slot
    taken) answered not found, and a client polling its state took it for deleted."""
    _need_criu()
    sb = await engine.create(network="none", checkpointable=True, tenant="alice")
    await engine.hibernate(sb.id, owner="alice")
    held, go = asyncio.Event(), asyncio.Event()
    lowers = engine.snapshots.lowers

    async def held_lowers(*args):
        held.set()
        await go.wait()
        return await lowers(*args)

    engine.snapshots.lowers = held_lowers
    resume = asyncio.ensure_future(engine.resume(sb.id, owner="alice"))
    try:
        await asyncio.wait_for(held.wait(), 60)
        assert engine.get(sb.id, owner="alice").state == SandboxState.PAUSED
        assert sb.id in [i.id for i in engine.list(owner="alice")]
    finally:
        go.set()
        await asyncio.wait_for(resume, 60)
    assert engine.get(sb.id, owner="alice").state == SandboxState.RUNNING
    await engine.delete(sb.id, owner="alice")
