"""Warm pools on a real engine: hand-out, liveness, refill, max_size, deletion."""

from __future__ import annotations

import asyncio

import pytest

from corral.errors import (
    CapacityExceeded,
    ImageNotFound,
    InvalidArgument,
    InvalidState,
    NotFound,
    SandboxStartError,
)
from corral.pool_schema import pool_tag
from corral.runtime.pools import PoolManager
from corral.schema import SandboxSpec, SandboxState
from tests.conftest import requires_root

pytestmark = [requires_root, pytest.mark.root]

SPEC = SandboxSpec(memory_mb=64, tags=["runtime-pool-test"])
POLLS = 600  # x 0.05 s: the bound of every "until" below (a busy CI machine is slow)


async def until(predicate, what: str) -> None:
    for _ in range(POLLS):
        if predicate():
            return
        await asyncio.sleep(0.05)
    raise AssertionError(f"never reached: {what}")


@pytest.fixture
async def pools(engine):
    manager = PoolManager(engine)
    yield manager
    await manager.close()


def alive(engine, name: str) -> set[str]:
    live = (SandboxState.PENDING, SandboxState.RUNNING, SandboxState.PAUSED)
    return {i.id for i in engine.list(tags=[pool_tag(name)], state=live)}


async def test_acquire_hands_out_a_working_sandbox_once_and_refills(engine, pools):
    info = pools.create_pool("py", SPEC, min_ready=2, max_size=4)
    assert (info.name, info.min_ready, info.max_size) == ("py", 2, 4)
    assert info.spec.tags == ["runtime-pool-test", "pool=py"]
    await until(lambda: pools.get_pool("py").ready == 2, "two ready")

    seen = set()
    for _ in range(5):  # more than max_size: each one is deleted before the next
        got = await pools.acquire("py", timeout=60)
        assert got.state == SandboxState.RUNNING and "pool=py" in got.tags
        assert got.id not in seen, "a sandbox was handed out twice"
        seen.add(got.id)
        assert got.id in pools.get_pool("py").acquired_ids
        r = await engine.exec(got.id, ["sh", "-c", "test ! -e /tmp/used && touch /tmp/used"])
        assert r.returncode == 0, "a handed-out sandbox had been used before"
        await engine.delete(got.id)
        pools.release(got.id)
        assert got.id not in pools.get_pool("py").acquired_ids

    await until(lambda: pools.get_pool("py").ready == 2, "refilled to min_ready")
    stats = pools.get_pool("py")
    assert stats.acquired == 0 and stats.acquires == 5 and stats.failed == 0
    assert stats.created >= 5 + 2 - 2  # what was handed out was replaced
    assert stats.acquire_wait_ms_p50 is not None and stats.acquire_wait_ms_p50 > 0
    assert not seen & set(stats.ready_ids)
    assert alive(engine, "py") == set(stats.ready_ids)


async def test_a_dead_ready_sandbox_is_skipped_not_handed_out(engine, pools):
    pools.create_pool("dead", SPEC, min_ready=2, max_size=3)
    await until(lambda: pools.get_pool("dead").ready == 2, "two ready")
    victim = pools.get_pool("dead").ready_ids[0]  # the next to be handed out
    # Killed from the loop's own thread, so the engine has not yet seen its agent's
    # channel close: the registry still says "running" and only a real check can tell.
    engine.cgroup(victim).kill_all()
    assert engine.get(victim).state == SandboxState.RUNNING
    assert not engine.agent_connected(victim)  # the kernel knows already: its end closed

    got = await pools.acquire("dead", timeout=60)
    assert got.id != victim
    assert (await engine.exec(got.id, ["true"])).returncode == 0
    stats = pools.get_pool("dead")
    assert stats.discarded >= 1 and victim not in stats.ready_ids + stats.acquired_ids
    await until(lambda: victim not in alive(engine, "dead"), "the dead one removed")
    await engine.delete(got.id)
    pools.release(got.id)


async def test_beyond_max_size_an_acquire_waits_then_fails_typed(engine, pools):
    pools.create_pool("small", SPEC, min_ready=0, max_size=2)
    first = await pools.acquire("small", timeout=60)  # none ready: made on the spot
    second = await pools.acquire("small", timeout=60)
    with pytest.raises(CapacityExceeded) as caught:
        await pools.acquire("small", timeout=0.3)
    err = caught.value
    assert err.details["pool"] == "small" and err.details["limit"] == "max_size"
    assert "max_size" in err.message and "handed out" in err.message
    assert pools.get_pool("small").waiting == 0

    waiter = asyncio.create_task(pools.acquire("small", timeout=60))
    await until(lambda: pools.get_pool("small").waiting == 1, "the acquire waits")
    await engine.delete(first.id)
    pools.release(first.id)  # a place is free: one is made for the waiter
    third = await waiter
    assert third.id not in (first.id, second.id)
    for sid in (second.id, third.id):
        await engine.delete(sid)
        pools.release(sid)


async def test_an_acquired_sandbox_that_ends_by_itself_frees_its_place(engine, pools):
    pools.create_pool("ends", SPEC, min_ready=0, max_size=1)
    got = await pools.acquire("ends", timeout=60)
    await engine.stop(got.id, grace=0)  # nobody tells the pool: it notices
    again = await pools.acquire("ends", timeout=60)
    assert again.id != got.id
    for sid in (got.id, again.id):
        await engine.delete(sid)


async def test_deleting_a_pool_deletes_its_ready_sandboxes_only(engine, pools):
    pools.create_pool("gone", SPEC, min_ready=3, max_size=5)
    await until(lambda: pools.get_pool("gone").ready == 3, "three ready")
    kept = await pools.acquire("gone", timeout=60)
    await until(lambda: pools.get_pool("gone").ready == 3, "refilled")
    ready = set(pools.get_pool("gone").ready_ids)

    assert await pools.delete_pool("gone") is True
    assert await pools.delete_pool("gone") is False
    assert alive(engine, "gone") == {kept.id}  # handed out: its user's to delete
    assert not ready & {i.id for i in engine.list()}, "ready sandboxes left records"
    with pytest.raises(NotFound, match="no pool 'gone'") as caught:
        await pools.acquire("gone", timeout=1)
    assert caught.value.details == {"pool": "gone"}
    assert [p.name for p in pools.list_pools()] == []
    await engine.delete(kept.id)


async def held_and_waiting(pools, name: str):
    """A pool of one, handed out, and an acquire waiting for it (a task)."""
    pools.create_pool(name, SPEC, min_ready=0, max_size=1)
    held = await pools.acquire(name, timeout=60)
    waiter = asyncio.create_task(pools.acquire(name, timeout=60))
    await until(lambda: pools.get_pool(name).waiting == 1, "the acquire waits")
    return held, waiter


async def test_deleting_a_pool_fails_its_waiting_acquires(engine, pools):
    held, waiter = await held_and_waiting(pools, "busy")
    await pools.delete_pool("busy")
    with pytest.raises(NotFound, match="deleted while this acquire waited"):
        await waiter
    await engine.delete(held.id)


async def test_a_cancelled_acquire_leaves_the_queue(engine, pools):
    held, waiter = await held_and_waiting(pools, "cancel")
    waiter.cancel()
    with pytest.raises(asyncio.CancelledError):
        await waiter
    assert pools.get_pool("cancel").waiting == 0
    await engine.delete(held.id)
    pools.release(held.id)
    got = await pools.acquire("cancel", timeout=60)
    assert pools.get_pool("cancel").acquired_ids == [got.id]
    await engine.delete(got.id)


async def test_an_acquire_cancelled_during_the_check_gives_the_sandbox_back(
        engine, pools, monkeypatch):
    monkeypatch.setattr("corral.runtime.pools.TRUSTED_S", 0.0)  # the agent is asked
    pools.create_pool("back", SPEC, min_ready=1, max_size=1)
    await until(lambda: pools.get_pool("back").ready == 1, "one ready")
    (sid,) = pools.get_pool("back").ready_ids
    engine.cgroup(sid).freeze()  # behind the engine's back: its agent cannot answer yet
    try:
        acquiring = asyncio.create_task(pools.acquire("back", timeout=60))
        await until(lambda: pools.get_pool("back").acquired_ids == [sid], "being checked")
        acquiring.cancel()
        with pytest.raises(asyncio.CancelledError):
            await acquiring
        assert pools.get_pool("back").ready_ids == [sid]  # unused: back at the front
    finally:
        engine.cgroup(sid).thaw()
    got = await pools.acquire("back", timeout=60)
    assert got.id == sid
    await engine.delete(got.id)


async def test_ready_sandboxes_are_replaced_at_half_their_lifetime(engine, pools):
    # A lifetime of 3 s: a ready one is replaced after 1.5 s, on a timer (no poll).
    pools.create_pool("aging", SPEC.model_copy(update={"timeout": 3}), min_ready=1, max_size=2)
    await until(lambda: pools.get_pool("aging").ready == 1, "one ready")
    (first,) = pools.get_pool("aging").ready_ids
    await until(lambda: first not in alive(engine, "aging"), "the first one replaced")
    await until(lambda: pools.get_pool("aging").discarded >= 1, "counted as discarded")


async def test_failed_creates_back_off_and_are_reported(engine):
    failures = 3

    async def flaky(spec: SandboxSpec):
        nonlocal failures
        if failures:
            failures -= 1
            raise SandboxStartError("simulated start failure")
        return await engine.create(spec)

    pools = PoolManager(engine, create=flaky)
    try:
        pools.create_pool("flaky", SPEC, min_ready=1, max_size=2)
        await until(lambda: pools.get_pool("flaky").ready == 1, "ready despite failures")
        stats = pools.get_pool("flaky")
        assert stats.failed == 3 and stats.created == 1
        assert stats.last_error == "simulated start failure"
    finally:
        await pools.close()
    assert alive(engine, "flaky") == set()


async def test_pool_arguments_are_checked(engine, pools):
    with pytest.raises(InvalidArgument, match="min_ready"):
        pools.create_pool("x", SPEC, min_ready=5, max_size=2)
    with pytest.raises(InvalidArgument, match="invalid pool name"):
        pools.create_pool("no spaces", SPEC, min_ready=0, max_size=1)
    with pytest.raises(ImageNotFound):
        pools.create_pool("x", SandboxSpec(image="no-such-image"), min_ready=0, max_size=1)
    made = pools.create_pool(None, SPEC, min_ready=0, max_size=1)
    assert made.name.startswith("pool-")
    with pytest.raises(InvalidState, match="already exists"):
        pools.create_pool(made.name, SPEC, min_ready=0, max_size=1)
    with pytest.raises(NotFound):
        pools.get_pool("nope")


async def test_close_deletes_every_ready_sandbox(engine):
    pools = PoolManager(engine)
    pools.create_pool("a", SPEC, min_ready=2, max_size=2)
    pools.create_pool("b", SPEC, min_ready=1, max_size=1)
    await until(
        lambda: [p.ready for p in pools.list_pools()] == [2, 1], "both pools filled"
    )
    await pools.close()
    assert alive(engine, "a") == alive(engine, "b") == set()
    with pytest.raises(InvalidState, match="closed"):
        pools.create_pool("c", SPEC, min_ready=0, max_size=1)


async def test_deleting_a_filling_pool_lets_its_started_sandboxes_exit_at_once(
        engine, pools, monkeypatch):
    """A pool deleted while its creates are in flight: each create is cancelled after
    its agent started and before it was ready. Its sandbox must end at once, not after
    the release's STOP_WAIT_S (a delete of a filling pool used to wait 5 s): with that
    wait made an hour here, a delete that relied on it would hang; and nothing is left."""
    monkeypatch.setattr("corral.runtime.engine_end.STOP_WAIT_S", 3600.0)
    stuck: list[str] = []
    settle = type(engine)._settle_network

    async def never_ready(self, live):  # holds each create between launch and ready
        stuck.append(live.id)
        await asyncio.Event().wait()
        await settle(self, live)

    monkeypatch.setattr(type(engine), "_settle_network", never_ready)
    pools.create_pool("filling", SPEC, min_ready=2, max_size=2)
    await until(lambda: len(stuck) == 2, "two creates launched")
    lives = [engine._live[sid] for sid in stuck]
    procs = [live.proc for live in lives]
    assert all(p is not None and p.poll() is None for p in procs)

    # bounded only against a hang: the creates it cancels never become ready
    assert await asyncio.wait_for(pools.delete_pool("filling"), 120) is True
    assert None not in [p.poll() for p in procs], "a cancelled create's launcher still runs"
    assert not set(stuck) & {i.id for i in engine.list()}, "a cancelled create left its row"
    assert not set(stuck) & set(engine._live)
    for live in lives:
        assert not live.sandbox_dir.exists()
        assert not live.cgroup.pids()
        assert not any(d.exists() for d in live.cgroup._dirs.values()), "its cgroup is left"


async def test_a_fresh_ready_sandbox_is_checked_by_the_kernel_not_a_round_trip(
        engine, pools, monkeypatch):
    """An agent that answered within TRUSTED_S is not woken at hand-out (its channel is
    checked with the kernel); one that answered longer ago is asked (a round trip)."""
    asked: list[str] = []
    stat = engine.stat

    async def counting_stat(sid, *args, **kwargs):
        asked.append(sid)
        return await stat(sid, *args, **kwargs)

    monkeypatch.setattr(engine, "stat", counting_stat)
    pools.create_pool("trust", SPEC, min_ready=2, max_size=4)
    await until(lambda: pools.get_pool("trust").ready == 2, "two ready")
    got = await pools.acquire("trust", timeout=60)
    assert asked == [] and (await engine.exec(got.id, ["true"])).returncode == 0
    await engine.delete(got.id)
    pools.release(got.id)

    monkeypatch.setattr("corral.runtime.pools.TRUSTED_S", 0.0)
    got = await pools.acquire("trust", timeout=60)
    assert asked == [got.id]
    await engine.delete(got.id)
    pools.release(got.id)


async def test_acquire_now_hands_out_only_what_it_may_trust_without_asking(
        engine, pools, monkeypatch):
    """The synchronous hand-out (an acquire's route takes it with no task) gives a ready
    sandbox only when acquire would trust it without a round trip; otherwise None, and
    the pool is as it was: a dead one, or one whose agent answered too long ago, is left
    for acquire to ask about and discard."""
    pools.create_pool("now", SPEC, min_ready=2, max_size=4)
    await until(lambda: pools.get_pool("now").ready == 2, "two ready")
    got = pools.acquire_now("now")
    assert got is not None and got.state == SandboxState.RUNNING
    stats = pools.get_pool("now")
    assert got.id in stats.acquired_ids and got.id not in stats.ready_ids
    assert stats.acquires == 1 and (await engine.exec(got.id, ["true"])).returncode == 0
    await engine.delete(got.id)
    pools.release(got.id)
    await until(lambda: pools.get_pool("now").ready == 2, "refilled")

    victim = pools.get_pool("now").ready_ids[0]
    engine.cgroup(victim).kill_all()  # the registry still says running; the kernel knows
    before = pools.get_pool("now")
    assert pools.acquire_now("now") is None
    after = pools.get_pool("now")
    assert (after.ready_ids, after.acquired_ids, after.acquires) == (
        before.ready_ids, before.acquired_ids, before.acquires)
    got = await pools.acquire("now", timeout=60)  # the waiting path discards it
    assert got.id != victim
    await engine.delete(got.id)
    pools.release(got.id)

    monkeypatch.setattr("corral.runtime.pools.TRUSTED_S", 0.0)
    assert pools.acquire_now("now") is None  # answered too long ago: acquire asks


async def test_a_ready_sandbox_whose_agent_stops_answering_is_discarded_in_the_background(
        engine, pools, monkeypatch):
    """Connected but not serving (its cgroup frozen behind the engine's back, so it still
    says running): the background check finds it without an acquire, and it is never
    handed out."""
    monkeypatch.setattr("corral.runtime.pools.RECHECK_S", 0.3)
    monkeypatch.setattr("corral.runtime.pools.LIVENESS_TIMEOUT_S", 0.3)
    pools.create_pool("stuck", SPEC, min_ready=1, max_size=2)
    await until(lambda: pools.get_pool("stuck").ready == 1, "one ready")
    victim = pools.get_pool("stuck").ready_ids[0]
    engine.cgroup(victim).freeze()
    assert engine.agent_connected(victim)  # the kernel alone cannot tell
    await until(lambda: pools.get_pool("stuck").discarded >= 1, "the stuck one discarded")
    got = await pools.acquire("stuck", timeout=60)
    assert got.id != victim and (await engine.exec(got.id, ["true"])).returncode == 0
    await until(lambda: victim not in alive(engine, "stuck"), "the stuck one removed")
    await engine.delete(got.id)
    pools.release(got.id)
