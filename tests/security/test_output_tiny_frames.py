"""Attack: a command printing one byte per write, its streamed reader reading none.

The output budget counted a streamed command's queued output by its bytes; but each
write reaches the daemon as a frame of its own (the agent forwards what each read
gets), and a queued frame is a reply, its fields and two bytes objects: ~230 bytes
beyond a 1-byte payload. So the daemon held tens of times what the gauge showed (a
tenant's share of bytes, as frames, is far more than its share of memory). Now each
queued frame counts its objects too (``output_room.FRAME_COST``), so the gauge covers
what the queue really holds; measured here by the objects' own sizes
(``sys.getsizeof``), the gauge read while the command still runs.
"""

from __future__ import annotations

import asyncio
import sys

import pytest

from tests.conftest import requires_root

pytestmark = [requires_root, pytest.mark.root]

WRITES = 5_000  # paced: each its own frame
PRINTER = (f"import os, time\nfor _ in range({WRITES}):\n    os.write(1, b'x')\n"
           "    time.sleep(0.0001)\ntime.sleep(60)\n")
PATIENCE_S = 60  # a bound on the poll below, never a measure


def _frame_size(reply) -> int:
    """The objects of one queued frame (each once), and its slot in the queue."""
    fields = reply.fields
    objects = {id(o): o for o in (reply, fields, fields._items, reply.data,
                                  *fields._items, *(v for _, v in fields._items))}
    return 8 + sum(sys.getsizeof(o) for o in objects.values())


async def test_tiny_frames_of_an_unread_stream_count_what_they_hold(engine):
    sb = await engine.create(network="none")
    live = engine._get_live(sb.id)
    events = engine.exec_stream(sb.id, ["python3", "-c", PRINTER], max_output=1 << 30,
                                timeout=PATIENCE_S)
    try:
        first = await events.__anext__()  # then never read again
        assert first.kind == "stdout"
        (stream,) = live.channel.streams.values()
        loop = asyncio.get_running_loop()
        end = loop.time() + PATIENCE_S
        while stream.queued_bytes < WRITES - len(first.data) and loop.time() < end:
            await asyncio.sleep(0.05)
        queued = list(stream.queue._queue)  # what the daemon holds for the reader
        real = sum(_frame_size(r) for r in queued)
        assert len(queued) > 1000, "the writes came in few frames: nothing shown"
        assert engine.output_budget.used >= real, (
            f"{len(queued)} frames queued hold {real} bytes, the budget counts "
            f"{engine.output_budget.used}")
    finally:
        await events.aclose()
        await engine.delete(sb.id)
    assert engine.output_budget.used == 0
