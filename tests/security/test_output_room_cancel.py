"""Attack (held): commands killed mid-growth leak no room of the output budget.

A leak would leave the tenant's budget spent for good (every later command 429, a
denial of service on itself, and with the daemon's total on the others). Commands
flooding both streams at once, interleaved, cancelled while their room grows (run to
completion, and streamed with a reader that stopped reading), and a sandbox deleted
under a streamed one: the budget is back to zero each time.
"""

from __future__ import annotations

import asyncio

import pytest

from corral.errors import CorralError
from tests.conftest import requires_root

pytestmark = [requires_root, pytest.mark.root]

FLOOD = ["sh", "-c", "yes out & yes err >&2 & wait"]
PATIENCE_S = 60  # a bound on the polls below, never a measure


async def _growing(engine, floor: int) -> None:
    loop = asyncio.get_running_loop()
    end = loop.time() + PATIENCE_S
    while engine.output_budget.used <= floor and loop.time() < end:
        await asyncio.sleep(0.02)
    assert engine.output_budget.used > floor, "the output never grew"


async def test_commands_cancelled_mid_growth_give_all_their_room_back(engine):
    sb = await engine.create(network="none")
    try:
        floor = 2 * (64 << 10)
        kept = [asyncio.create_task(engine.exec(sb.id, FLOOD, max_output=1 << 30,
                                                timeout=PATIENCE_S)) for _ in range(3)]
        streamed = engine.exec_stream(sb.id, FLOOD, max_output=1 << 30, timeout=PATIENCE_S)
        await streamed.__anext__()  # then not read
        await _growing(engine, 4 * floor)
        for task in kept:
            task.cancel()
        await asyncio.gather(*kept, return_exceptions=True)
        await streamed.aclose()
        assert engine.output_budget.used == 0, engine.output_budget.by_tenant
        # a streamed one left unread as its sandbox is deleted under it
        streamed = engine.exec_stream(sb.id, FLOOD, max_output=1 << 30, timeout=PATIENCE_S)
        await streamed.__anext__()
        await _growing(engine, floor)
    finally:
        await engine.delete(sb.id)
    with pytest.raises(CorralError):  # its sandbox is gone
        async for _ in streamed:
            pass
    assert engine.output_budget.used == 0, engine.output_budget.by_tenant
