"""Warm pools through the SDK: blocking and asyncio, on the real test daemon."""

from __future__ import annotations

import asyncio
import time

import pytest

import corral
from tests.conftest import requires_root

pytestmark = requires_root

POLLS = 600  # x 0.05 s: the bound of every wait for the pool to fill


def settled(pool: corral.Pool) -> corral.PoolInfo:
    """The pool's stats once it has ``min_ready`` ready and starts no more."""
    for _ in range(POLLS):
        stats = pool.wait_ready(timeout=60)
        if stats.starting == 0:
            return stats
        time.sleep(0.05)
    raise AssertionError(f"pool {pool.name} never settled")


def pool_names(client) -> list[str]:
    return [p["name"] for p in client.info()["pools"]]


def test_pool_hands_out_fresh_sandboxes_and_deletes_them_after_use(client):
    with corral.Pool(memory_mb=64, min_ready=2, max_size=4, tags=["sdk-pool"], client=client) as pool:
        assert pool.info is not None and pool.info.min_ready == 2  # made at once
        assert pool.name in pool_names(client)
        assert settled(pool).ready == 2
        used = []
        for _ in range(3):
            with pool.acquire(timeout=30) as sb:
                assert isinstance(sb, corral.Sandbox) and sb.state is corral.SandboxState.RUNNING
                assert set(sb.tags) == {"sdk-pool", f"pool={pool.name}"}
                r = sb.exec(["sh", "-c", "test ! -e /tmp/used && touch /tmp/used && echo ok"])
                assert r.stdout == "ok\n", "the sandbox had been used before"
                used.append(sb.id)
            with pytest.raises(corral.SandboxNotFound):
                sb.refresh()  # deleted on leaving the block
        assert len(set(used)) == 3
        stats = settled(pool)
        assert stats.ready == 2 and stats.acquires == 3 and stats.acquired == 0 and stats.created >= 4
        assert stats.acquire_wait_ms_p50 is not None
    assert pool.closed and pool.name not in pool_names(client)
    assert corral.Sandbox.list(tags=[f"pool={pool.name}"], client=client) == []
    with pytest.raises(corral.InvalidState, match="closed"):
        pool.acquire()
    pool.close()  # twice is fine


def test_acquire_beyond_max_size_raises_capacity_exceeded(client):
    with corral.Pool(memory_mb=64, min_ready=0, max_size=1, client=client) as pool:
        with pool.acquire(timeout=30) as held:
            with pytest.raises(corral.CapacityExceeded) as caught:
                pool.acquire(timeout=0.3)
            assert caught.value.details["pool"] == pool.name
            assert held.exec("true").returncode == 0
        with pool.acquire(timeout=30) as again:  # the place held is free again
            assert again.id != held.id


def test_attach_by_name_and_recreate_after_the_daemon_forgot(client):
    name = f"sdk-{time.monotonic_ns() % 10**8}"
    owner = corral.Pool(memory_mb=64, min_ready=0, max_size=2, name=name, client=client)
    try:
        other = corral.Pool(memory_mb=999, name=name, client=client)  # attaches
        assert other.info is not None and other.info.spec.memory_mb == 64
        other.close()  # it did not make the pool: the pool stays
        assert name in pool_names(client)
        other.delete()  # as after a daemon restart: the daemon no longer knows it
        assert name not in pool_names(client)
        with owner.acquire(timeout=30) as sb:  # its maker makes it again
            assert sb.info.spec.memory_mb == 64
        assert name in pool_names(client)
    finally:
        owner.close()
    assert name not in pool_names(client)


def test_bad_pool_arguments_fail_before_any_request(client):
    before = pool_names(client)
    with pytest.raises(corral.InvalidArgument, match="min_ready"):
        corral.Pool(min_ready=5, max_size=2, client=client)
    with pytest.raises(corral.InvalidArgument, match="memory_mb"):
        corral.Pool(memory_mb=1, client=client)
    with pytest.raises(corral.InvalidArgument, match="colour"):
        corral.Pool(colour="red", client=client)
    # More memory than the daemon may ever promise: every create is refused at once.
    with corral.Pool(memory_mb=1 << 20, min_ready=1, max_size=1, client=client) as never:
        with pytest.raises(corral.SandboxTimeout, match="0 of 1 sandboxes ready") as caught:
            never.wait_ready(timeout=0.5)
        assert "max_memory_mb" in caught.value.message
    with pytest.raises(corral.ImageNotFound):
        corral.Pool(image="no-such-image", min_ready=0, client=client)
    assert pool_names(client) == before


async def test_async_pool(aclient):
    pool = corral.AsyncPool(memory_mb=64, min_ready=1, max_size=3, client=aclient)
    assert pool.info is None  # asyncio: made on entering the block
    async with pool:
        assert pool.info is not None
        names = [p["name"] for p in (await aclient.info())["pools"]]
        assert pool.name in names
        sandboxes = await asyncio.gather(*(pool.acquire(timeout=30) for _ in range(3)))
        assert len({sb.id for sb in sandboxes}) == 3
        results = await asyncio.gather(*(sb.exec(["echo", sb.id]) for sb in sandboxes))
        assert [r.stdout.strip() for r in results] == [sb.id for sb in sandboxes]
        with pytest.raises(corral.CapacityExceeded):
            await pool.acquire(timeout=0.2)
        for sb in sandboxes:
            async with sb:
                pass  # deleted here
        async with await pool.acquire(timeout=30) as sb:
            assert (await sb.exec("true")).returncode == 0
        assert (await pool.stats()).acquires == 4
    names = [p["name"] for p in (await aclient.info())["pools"]]
    assert pool.name not in names
    assert await corral.AsyncSandbox.list(tags=[f"pool={pool.name}"], client=aclient) == []


def test_pool_twins_have_the_same_methods():
    public = {n for n in dir(corral.AsyncPool) if not n.startswith("_")}
    assert public <= set(dir(corral.Pool))
    assert {"acquire", "stats", "close", "delete", "name", "info"} <= public
    assert asyncio.iscoroutinefunction(corral.AsyncPool.acquire)
    assert not asyncio.iscoroutinefunction(corral.Pool.acquire)
