"""Attack: an interactive process nobody reads, writing a byte at a time to stdout and
stderr in turn.

Its unread output counted against the output budget by its bytes, kept in chunks that
small writes join (so a byte per write costs no object per byte); but a chunk joins
only the last one of its own stream: alternating streams, each byte became a chunk of
its own (a dataclass, a bytes object and a slot of the deque: ~90 bytes), so the
daemon held ~90 times what the gauge showed, up to 2 x 16 MiB of bytes per process.
Each chunk now counts its objects too (``processes.CHUNK_COST``), given back as it
goes; measured here by the objects' own sizes (``sys.getsizeof``).
"""

from __future__ import annotations

import asyncio
import sys

import pytest

from tests.conftest import requires_root

pytestmark = [requires_root, pytest.mark.root]

WRITES = 5_000  # to each stream, paced: each its own frame
PRINTER = (f"import os, time\nfor _ in range({WRITES}):\n    os.write(1, b'o')\n"
           "    os.write(2, b'e')\n    time.sleep(0.0001)\ntime.sleep(60)\n")
PATIENCE_S = 60  # a bound on the poll below, never a measure


def _held(proc) -> int:
    """The objects of the process's unread output, each once."""
    objects = {id(proc._events): proc._events}
    for chunk in proc._events:
        objects[id(chunk)], objects[id(chunk.data)] = chunk, chunk.data
    return sum(sys.getsizeof(o) for o in objects.values())


async def test_interleaved_writes_nobody_reads_count_what_they_hold(engine):
    sb = await engine.create(network="none")
    try:
        proc = await engine.spawn(sb.id, ["python3", "-c", PRINTER], timeout=PATIENCE_S)
        loop = asyncio.get_running_loop()
        end = loop.time() + PATIENCE_S
        while proc.unread_bytes < 2 * WRITES and loop.time() < end:
            await asyncio.sleep(0.05)
        assert len(proc._events) > 1000, "the writes came in few frames: nothing shown"
        real = _held(proc)
        assert engine.output_budget.used >= real, (
            f"{len(proc._events)} chunks hold {real} bytes, the budget counts "
            f"{engine.output_budget.used}")
        await proc.kill()
        await proc.wait()
        assert engine.output_budget.used == 0  # all given back once taken
    finally:
        await engine.delete(sb.id)
    assert engine.output_budget.used == 0
