"""Red-team: one tenant hammers hibernate / resume (and so checkpoint, live fork) to
starve the host. CRIU's dumps run in the daemon's cgroup, outside any sandbox's CPU
limit, and nothing bounded how many ran at once. Every dump and restore now takes a
place in the engine's :class:`~corral.runtime.criu_gate.CriuGate` (sized from the CPU
count, ``CORRAL_CRIU_CONCURRENCY``), served round-robin across tenants: concurrent
hibernates of one tenant all complete, queued, never more than the bound at once, and
another tenant's one is not put behind them all. A wake storm (commands at once on
each hibernated sandbox) restores each once, within the bound; a sandbox whose timeout
hibernates it waits for its place frozen."""

from __future__ import annotations

import asyncio

import pytest

from corral.errors import InvalidArgument, InvalidState
from corral.runtime import criu
from corral.runtime.criu_gate import CRIU_CONCURRENCY_ENV, CriuGate, criu_concurrency
from corral.runtime.paths import default_cache_dir
from tests.conftest import requires_root


async def test_the_gate_is_bounded_fair_and_survives_cancels():
    gate = CriuGate(2)
    order: list[str] = []
    release = asyncio.Event()

    async def job(tenant: str, name: str) -> None:
        async with gate.place(tenant):
            order.append(name)
            assert gate.running <= gate.limit
            await release.wait()

    hog = [asyncio.ensure_future(job("hog", f"hog{i}")) for i in range(8)]
    await asyncio.sleep(0)
    late = asyncio.ensure_future(job("meek", "meek"))
    await asyncio.sleep(0.05)
    assert gate.running == 2 and order[:1] == ["hog0"]  # the hog holds limit - 1
    hog[5].cancel()  # a waiter that gives up leaves no place taken
    await asyncio.sleep(0)
    release.set()
    await asyncio.gather(*hog, late, return_exceptions=True)
    assert gate.peak == 2 and gate.running == 0 and gate.waiting == 0
    assert gate._mine == {}
    # the other tenant's one ran at once, not behind the hog's seven
    assert order.index("meek") == 1 and len(order) == 8, order


async def test_one_tenant_leaves_a_place_for_another():
    gate = CriuGate(3)
    release = asyncio.Event()
    held: dict[str, int] = {}
    most: dict[str, int] = {}

    async def job(tenant: str) -> None:
        async with gate.place(tenant):
            held[tenant] = held.get(tenant, 0) + 1
            most[tenant] = max(most.get(tenant, 0), held[tenant])
            await release.wait()
            held[tenant] -= 1

    hog = [asyncio.ensure_future(job("hog")) for _ in range(6)]
    await asyncio.sleep(0.05)
    assert gate.running == 2  # the hog holds limit - 1
    meek = asyncio.ensure_future(job("meek"))
    await asyncio.sleep(0.05)
    assert gate.running == 3 and held["meek"] == 1  # at once, not after a hog's dump
    release.set()
    await asyncio.gather(*hog, meek)
    assert most["hog"] == 2 and gate.running == 0 and gate._mine == {}


def test_the_bound_is_configurable(monkeypatch):
    monkeypatch.setenv(CRIU_CONCURRENCY_ENV, "3")
    assert criu_concurrency() == 3
    for bad in ("0", "-1", "many"):
        monkeypatch.setenv(CRIU_CONCURRENCY_ENV, bad)
        with pytest.raises(InvalidArgument, match=CRIU_CONCURRENCY_ENV):
            criu_concurrency()
    monkeypatch.delenv(CRIU_CONCURRENCY_ENV)
    assert criu_concurrency() >= 1


@requires_root
@pytest.mark.root
@pytest.mark.timeout(240)
async def test_concurrent_hibernates_of_one_tenant_queue_within_the_bound(engine):
    if criu.find(default_cache_dir()) is None:
        pytest.skip(f"no cached CRIU: {criu.BUILD}")
    engine.criu_gate = gate = CriuGate(2)
    alice = {"owner": "alice"}
    made = [await engine.create(network="none", checkpointable=True, tenant="alice",
                                memory_mb=64) for _ in range(4)]
    try:
        slept = await asyncio.gather(*(engine.hibernate(sb.id, **alice) for sb in made))
        assert all(s.state.value == "paused" for s in slept)
        assert 1 <= gate.peak <= 2 and gate.running == 0 and gate.waiting == 0
        gate.peak = 0
        # a wake storm: three commands at once on each (the service wakes each first)
        await asyncio.gather(*(engine.wake(sb.id, **alice) for sb in made for _ in range(3)))
        assert 1 <= gate.peak <= 2 and gate.running == 0
        for sb in made:
            assert (await engine.exec(sb.id, ["echo", "up"], **alice)).stdout.strip() == b"up"
    finally:
        for sb in made:
            await engine.delete(sb.id)


@requires_root
@pytest.mark.root
@pytest.mark.timeout(240)
async def test_a_timed_out_sandbox_waiting_for_its_hibernation_runs_no_more(engine):
    """Another tenant's dumps hold CRIU's places: a sandbox whose timeout hibernates it
    waits its turn frozen, not running past its lifetime; then it hibernates and wakes
    with its processes."""
    if criu.find(default_cache_dir()) is None:
        pytest.skip(f"no cached CRIU: {criu.BUILD}")
    engine.criu_gate = gate = CriuGate(1)
    sb = await engine.create(network="none", checkpointable=True, timeout=600,
                             on_timeout="hibernate", tenant="alice")
    try:
        await engine.exec(sb.id, ["sh", "-c", "sleep 1000 >/dev/null 2>&1 &"], owner="alice")
        live = engine._get_live(sb.id)
        async with gate.place("bob"):  # bob's dump, as long as the test likes
            # its lifetime ends now, while bob holds the place (a 1.5 s lifetime from the
            # create could end before bob took it, loaded: it hibernated at once)
            await engine.set_timeout(sb.id, 0.5, owner="alice")
            for _ in range(600):
                if gate.waiting:
                    break
                await asyncio.sleep(0.05)
            assert gate.waiting == 1 and live.hibernating
            assert live.cgroup.frozen()  # its lifetime is over: it waits frozen
        for _ in range(1200):
            if engine.get(sb.id).reason == "hibernated":
                break
            await asyncio.sleep(0.05)
        assert engine.get(sb.id).reason == "hibernated"
        await engine.wake(sb.id, owner="alice")
        r = await engine.exec(sb.id, ["sh", "-c", "cat /proc/[0-9]*/comm | grep -x sleep"], owner="alice")
        assert r.stdout.strip(), r
    finally:
        await engine.delete(sb.id)


@requires_root
@pytest.mark.root
@pytest.mark.timeout(240)
async def test_a_checkpoint_and_a_resume_of_one_sandbox_do_not_deadlock_the_gate(engine):
    """A checkpoint took its place before the sandbox's lock, a resume its lock before
    its restore's place: a checkpoint of a hibernated sandbox queued first, then its
    resume, held the one place and the lock each waited on — every dump and restore of
    the daemon stuck for good. Now both take the lock first."""
    if criu.find(default_cache_dir()) is None:
        pytest.skip(f"no cached CRIU: {criu.BUILD}")
    engine.criu_gate = gate = CriuGate(1)
    alice = {"owner": "alice"}
    sb = await engine.create(network="none", checkpointable=True, tenant="alice")
    try:
        await engine.hibernate(sb.id, **alice)
        async with gate.place("bob"):
            checkpoint = asyncio.ensure_future(engine.checkpoint(sb.id, **alice))
            live = engine._get_live(sb.id)
            for _ in range(1200):  # the checkpoint reached the sandbox first (a fixed wait
                # could let the resume go first, loaded: the checkpoint then succeeded)
                if live.lock.locked() or gate.waiting or checkpoint.done():
                    break
                await asyncio.sleep(0.01)
            resume = asyncio.ensure_future(engine.resume(sb.id, **alice))
            await asyncio.sleep(0.2)
        done, _ = await asyncio.wait({checkpoint, resume}, timeout=120)
        assert done == {checkpoint, resume}, "deadlocked"
        assert isinstance(checkpoint.exception(), InvalidState)
        assert resume.result().state.value == "running"
        assert gate.running == 0 and gate.waiting == 0
    finally:
        await engine.delete(sb.id)
