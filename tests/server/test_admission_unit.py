"""Admission control on its own: caps, FIFO order, queue bounds, timeouts."""

from __future__ import annotations

import asyncio
import contextlib

import pytest

from corral.errors import CapacityExceeded, DaemonUnavailable, InvalidArgument
from corral.server.admission import Admission, Limits


def make(**caps) -> Admission:
    limits = dict(
        max_starting=2, max_sandboxes=4, max_memory_mb=1000, queue_size=3, queue_timeout=5.0
    )
    limits.update(caps)
    return Admission(Limits(**limits))


async def create(
    adm: Admission,
    sid: str,
    memory_mb: int = 100,
    hold: asyncio.Event | None = None,
) -> str:
    """What the create route does: admit, 'start' (until `hold` is set), commit."""
    async with adm.admit(memory_mb) as slot:
        if hold is not None:
            await hold.wait()
        slot.commit(sid)
    return sid


async def settle() -> None:
    for _ in range(5):
        await asyncio.sleep(0)


async def test_max_starting_holds_back_the_third_start():
    adm, hold = make(), asyncio.Event()
    tasks = [asyncio.create_task(create(adm, f"sb-{i}", hold=hold)) for i in range(3)]
    await settle()
    assert (adm.starting, adm.queued) == (2, 1)
    hold.set()
    assert await asyncio.gather(*tasks) == ["sb-0", "sb-1", "sb-2"]
    assert (adm.starting, adm.queued, adm.alive) == (0, 0, 3)


async def test_max_sandboxes_waits_for_a_release_in_fifo_order():
    adm = make()
    for i in range(4):
        await create(adm, f"sb-{i}")
    waiting = [asyncio.create_task(create(adm, f"late-{i}")) for i in range(2)]
    await settle()
    assert adm.queued == 2
    adm.release("sb-0")
    done, _ = await asyncio.wait(waiting, timeout=30, return_when=asyncio.FIRST_COMPLETED)
    assert [t.result() for t in done] == ["late-0"]  # first come, first served
    adm.release("sb-1")
    assert await asyncio.wait_for(waiting[1], 30) == "late-1"


async def test_memory_cap_and_a_request_that_can_never_fit():
    adm = make(max_memory_mb=250)
    await create(adm, "a", memory_mb=200)
    with pytest.raises(InvalidArgument) as exc:  # never fits: no wait, a 4xx
        await create(adm, "huge", memory_mb=251)
    assert exc.value.details["limit"] == "max_memory_mb"
    assert adm.queued == 0
    adm2 = make(max_memory_mb=250, queue_timeout=0.05)
    await create(adm2, "a", memory_mb=200)
    with pytest.raises(CapacityExceeded) as exc:
        await create(adm2, "b", memory_mb=100)
    assert exc.value.details["limit"] == "max_memory_mb"
    assert adm2.committed_memory_mb == 200


async def test_full_queue_and_timeout_name_their_limits():
    adm = make(max_sandboxes=1, queue_size=2, queue_timeout=0.2)
    await create(adm, "only")
    waiting = [asyncio.create_task(create(adm, f"w{i}")) for i in range(2)]
    await settle()
    with pytest.raises(CapacityExceeded) as exc:
        await create(adm, "overflow")
    assert exc.value.details["limit"] == "queue_size"
    for task in waiting:
        with pytest.raises(CapacityExceeded) as exc:
            await task
        assert exc.value.details["limit"] == "max_sandboxes"
        assert "delete sandboxes" in exc.value.message
    assert (adm.queued, adm.starting, adm.alive) == (0, 0, 1)


async def test_a_cancelled_waiter_leaves_the_queue_and_frees_nothing_twice():
    adm, hold = make(max_starting=1), asyncio.Event()
    first = asyncio.create_task(create(adm, "a", hold=hold))
    second = asyncio.create_task(create(adm, "b"))
    await settle()
    assert adm.queued == 1
    second.cancel()
    with contextlib.suppress(asyncio.CancelledError):
        await second
    assert (adm.queued, adm.starting) == (0, 1)
    hold.set()
    await first
    assert (adm.queued, adm.starting, adm.alive) == (0, 0, 1)


async def test_a_failed_create_gives_its_place_back():
    adm = make(max_starting=1)
    with pytest.raises(RuntimeError):
        async with adm.admit(100):
            raise RuntimeError("start failed")
    assert (adm.starting, adm.alive, adm.committed_memory_mb) == (0, 0, 0)


async def test_close_fails_queued_creates_and_refuses_new_ones():
    adm = make(max_sandboxes=1)
    await create(adm, "a")
    waiter = asyncio.create_task(create(adm, "b"))
    await settle()
    adm.close()
    with pytest.raises(DaemonUnavailable):
        await waiter
    with pytest.raises(DaemonUnavailable):
        await create(adm, "c")
