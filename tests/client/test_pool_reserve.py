"""A pool's client-side reserve (``corral.Pool(reserve=N)``): sandboxes acquired from
the daemon in one call, handed out locally, each once, all gone when the pool closes."""

from __future__ import annotations

import asyncio
import time

import pytest

import corral
from tests.client.test_pool import settled
from tests.conftest import requires_root

pytestmark = requires_root


def test_a_reserve_hands_out_fresh_sandboxes_taken_in_one_call(client):
    with corral.Pool(memory_mb=64, min_ready=3, max_size=8, reserve=3, client=client) as pool:
        settled(pool)
        first = pool.acquire(timeout=30)
        # the daemon handed out three at once: the reserve took them in one call
        assert pool.stats().acquires == 3
        used = [first.id]
        with first:
            assert first.exec(["sh", "-c", "test ! -e /tmp/used && touch /tmp/used"]).returncode == 0
        for _ in range(2):
            with pool.acquire(timeout=30) as sb:
                r = sb.exec(["sh", "-c", "test ! -e /tmp/used && touch /tmp/used && echo ok"])
                assert r.stdout == "ok\n", "the sandbox had been used before"
                used.append(sb.id)
        assert len(set(used)) == 3
        assert pool.stats().acquires == 3  # no call to the daemon for the last two
        held = pool.acquire(timeout=30)  # the reserve is empty: the next batch
        assert held.id not in used
        settled(pool)  # (a refill cut short by the pool's delete is another matter)
    # closing released the reserve's lease: the one still held and the unused ones are gone
    assert corral.Sandbox.list(tags=[f"pool={pool.name}"], client=client) == []
    with pytest.raises(corral.SandboxNotFound):
        held.refresh()


def test_concurrent_acquires_from_a_reserve_never_share_a_sandbox(daemon):
    async def main() -> list[str]:
        async with corral.AsyncClient(daemon.url) as client:
            async with corral.AsyncPool(memory_mb=64, min_ready=4, max_size=16, reserve=4,
                                        client=client) as pool:
                await pool.wait_ready(timeout=120)
                got = await asyncio.gather(*(pool.acquire(timeout=60) for _ in range(8)))
                ids = [sb.id for sb in got]
                await asyncio.gather(*(sb.delete() for sb in got))
            assert await corral.AsyncSandbox.list(tags=[f"pool={pool.name}"], client=client) == []
            return ids

    ids = asyncio.run(main())
    assert len(ids) == 8 and len(set(ids)) == 8


def test_bad_reserve_arguments_are_refused_before_any_call(client):
    for bad in (-1, 65, 1.5, True):
        with pytest.raises(corral.InvalidArgument, match="reserve"):
            corral.Pool(memory_mb=64, reserve=bad, client=client)
    with pytest.raises(corral.InvalidArgument, match="reserve_ttl"):
        corral.Pool(memory_mb=64, reserve=2, reserve_ttl=0.5, client=client)


def test_a_reserve_whose_lease_expired_takes_a_new_one(client):
    # 15 s: renewed every 5 s while the test uses the reserve (a 1 s lease lapsed on a
    # loaded host between the acquire and the exec: its sandbox was deleted under it)
    with corral.Pool(memory_mb=64, min_ready=2, max_size=8, reserve=2, reserve_ttl=15,
                     client=client) as pool:
        settled(pool)
        with pool.acquire(timeout=30) as first:
            first.exec("true")
        left = [info.id for _, info in pool._reserve]
        pool._heartbeat.stop()  # this process "stood still": no renewal
        deadline = time.monotonic() + 120  # its 15 s, then the daemon's sweep and deletes
        while any(s.id in left for s in corral.Sandbox.list(tags=[f"pool={pool.name}"],
                                                             client=client)):
            assert time.monotonic() < deadline, "the expired lease's sandboxes stayed"
            time.sleep(0.2)
        settled(pool)
        with pool.acquire(timeout=30) as sb:  # not the dead one: a new lease, a new batch
            assert sb.id not in left
            assert sb.exec("echo ok").stdout == "ok\n"


def test_an_acquire_that_found_none_ready_is_held_by_the_reserves_lease_too(client):
    with corral.Pool(memory_mb=64, min_ready=0, max_size=2, reserve=2, client=client) as pool:
        held = pool.acquire(timeout=60)  # none ready: waited for, as a plain acquire
        assert held.exec("true").returncode == 0
    # closing released the lease: the sandbox it held is gone with the rest
    with pytest.raises(corral.SandboxNotFound):
        held.refresh()
