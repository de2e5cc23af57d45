"""Admission control in a real daemon, and many creates at once."""

from __future__ import annotations

import asyncio
import time

import httpx
import pytest

from tests.conftest import requires_root
from tests.server.conftest import TEST_TAG, assert_error, async_uds_client

pytestmark = [requires_root, pytest.mark.root]


async def wait_for(predicate, limit: float = 60.0) -> None:
    deadline = time.monotonic() + limit
    while not await predicate():
        assert time.monotonic() < deadline, "condition not reached in time"
        await asyncio.sleep(0.02)


async def test_queued_creates_wait_for_room_and_overflow_is_refused(make_daemon):
    # A queue timeout no loaded host reaches: queued creates wait for room, however
    # slowly sandboxes start; the one that must time out says so with ?wait=.
    d = make_daemon(
        "--max-starting", "2", "--max-sandboxes", "5", "--queue-size", "3", "--queue-timeout", "300"
    )
    async with async_uds_client(d.socket) as c:

        async def create(**params):
            return await c.post("/v1/sandboxes", json={"memory_mb": 64}, params=params,
                                timeout=300)

        async def info():
            return (await c.get("/v1/info")).json()

        first = await asyncio.gather(*(create() for _ in range(5)))
        assert [r.status_code for r in first] == [201] * 5
        ids = [r.json()["id"] for r in first]
        assert (await info())["committed_memory_mb"] == 5 * 64

        queued = [asyncio.create_task(create()) for _ in range(3)]

        async def three_queued():
            return (await info())["queued"] == 3

        await wait_for(three_queued)
        overflow = await create()
        error = assert_error(overflow, 503, "capacity_exceeded")
        assert error["details"]["limit"] == "queue_size"
        assert "queue" in error["message"]

        for sid in ids[:3]:  # room for the three that wait
            assert (await c.delete(f"/v1/sandboxes/{sid}")).status_code == 204
        done = await asyncio.gather(*queued)
        assert [r.status_code for r in done] == [201] * 3, [r.text for r in done]
        ids = ids[3:] + [r.json()["id"] for r in done]

        started = time.monotonic()
        late = await create(wait=1)  # nothing is deleted now: it times out
        assert time.monotonic() - started >= 0.9  # it waited (a lower bound: load only adds)
        error = assert_error(late, 503, "capacity_exceeded")
        assert error["details"]["limit"] == "max_sandboxes"
        assert error["details"]["value"] == 5

        stopped = await c.post(f"/v1/sandboxes/{ids[0]}/stop", json={"grace": 0})
        assert stopped.status_code == 200  # a stopped sandbox frees its place
        assert (await create()).status_code == 201
        state = await info()
        assert state["counts"]["running"] == 5 and state["committed_memory_mb"] == 5 * 64
        assert state["queued"] == 0 and state["starting"] == 0


async def test_a_client_that_gives_up_leaves_the_queue(make_daemon):
    d = make_daemon("--max-sandboxes", "1")
    async with async_uds_client(d.socket) as c:
        first = (await c.post("/v1/sandboxes", json={"memory_mb": 64})).json()["id"]
        with pytest.raises(httpx.ReadTimeout):
            await c.post("/v1/sandboxes", json={"memory_mb": 64}, timeout=0.5)

        async def queue_empty():
            return (await c.get("/v1/info")).json()["queued"] == 0

        await wait_for(queue_empty)
        assert (await c.delete(f"/v1/sandboxes/{first}")).status_code == 204
        await asyncio.sleep(0.3)
        assert (await c.get("/v1/sandboxes")).json()["sandboxes"] == []


async def test_a_sandbox_the_engine_ends_frees_its_room_for_a_waiting_create(make_daemon):
    """Nobody deletes or stops the first sandbox: its lifetime runs out, the engine
    announces the end, and the queued create is admitted (no release call, no poll)."""
    d = make_daemon("--max-sandboxes", "1", "--queue-timeout", "30")
    async with async_uds_client(d.socket) as c:
        first = await c.post("/v1/sandboxes", json={"memory_mb": 64, "timeout": 1})
        assert first.status_code == 201
        waiting = await c.post("/v1/sandboxes", json={"memory_mb": 64}, timeout=30)
        assert waiting.status_code == 201, waiting.text
        ended = (await c.get(f"/v1/sandboxes/{first.json()['id']}")).json()
        assert ended["state"] == "stopped" and "timeout" in ended["reason"]
        info = (await c.get("/v1/info")).json()
        assert info["counts"]["running"] == 1 and info["committed_memory_mb"] == 64


async def test_memory_cap_is_named(make_daemon):
    d = make_daemon("--max-memory-mb", "200", "--queue-timeout", "0.3")
    async with async_uds_client(d.socket) as c:
        too_big = await c.post("/v1/sandboxes", json={"memory_mb": 256})  # never fits: a 4xx
        assert assert_error(too_big, 400, "invalid_argument")["details"]["limit"] == "max_memory_mb"
        ok = await c.post("/v1/sandboxes", json={"memory_mb": 128})
        assert ok.status_code == 201
        waited = await c.post("/v1/sandboxes", json={"memory_mb": 128})
        assert assert_error(waited, 503, "capacity_exceeded")["details"]["limit"] == "max_memory_mb"
        assert len((await c.get("/v1/sandboxes")).json()["sandboxes"]) == 1


@pytest.mark.slow
async def test_a_fork_that_could_never_fit_is_a_400_at_once(make_daemon):
    """All or nothing: more copies than max_sandboxes, or more memory than max_memory_mb,
    could never be alive at once: refused at once, not after waiting for room (503)."""
    d = make_daemon("--max-sandboxes", "10", "--max-memory-mb", "1000", "--queue-timeout", "600")
    async with async_uds_client(d.socket) as c:
        made = await c.post("/v1/sandboxes", json={"memory_mb": 200})
        assert made.status_code == 201, made.text
        sid = made.json()["id"]
        try:
            for n, cap in ((11, "max_sandboxes"), (6, "max_memory_mb")):
                reply = await c.post(f"/v1/sandboxes/{sid}/fork", json={"n": n})
                assert assert_error(reply, 400, "invalid_argument")["details"]["limit"] == cap
            assert len((await c.get("/v1/sandboxes")).json()["sandboxes"]) == 1
        finally:
            await c.delete(f"/v1/sandboxes/{sid}")


async def test_500_concurrent_creates(daemon):
    n = 500
    limits = httpx.Limits(max_connections=n, max_keepalive_connections=n)
    async with async_uds_client(daemon.socket, limits=limits) as c:
        started = time.monotonic()
        replies = await asyncio.gather(
            *(
                c.post("/v1/sandboxes", json={"memory_mb": 64, "tags": [TEST_TAG, "load"]})
                for _ in range(n)
            )
        )
        created = time.monotonic() - started
        ids = [r.json()["id"] for r in replies if r.status_code == 201]
        try:
            assert len(ids) == n, {r.text for r in replies if r.status_code != 201}
            assert len(set(ids)) == n
            listed = (await c.get("/v1/sandboxes", params={"tag": "load"})).json()["sandboxes"]
            assert len(listed) == n and all(s["state"] == "running" for s in listed)
        finally:
            started = time.monotonic()
            deleted = await asyncio.gather(*(c.delete(f"/v1/sandboxes/{sid}") for sid in ids))
            removed = time.monotonic() - started
        assert all(r.status_code == 204 for r in deleted)
        assert (await c.get("/v1/sandboxes", params={"tag": "load"})).json()["sandboxes"] == []
        print(f"\n{n} creates: {created:.1f} s ({n / created:.0f}/s); deletes: {removed:.1f} s")
