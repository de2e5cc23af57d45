"""Attack on the output budget (runtime/output_budget.py) through a process's reader:
the room a process's unread output takes goes back when it is read or dropped, and a
sandbox's end drops it (``processes.release``) — except while a reader is attached,
which "drains it, then lets it go". A reader that stops reading (a client that took
the output stream and then sits on it, or hangs up) while the sandbox is deleted
never drained anything: the process was forgotten with its output still counted, and
the room never came back. Repeated, a tenant's budget (and with two tenants the
daemon's) stays spent until the daemon restarts: every command refused with 429.

Engine level, so the books are read directly: after the reader lets go, nothing of
the budget may stay held."""

from __future__ import annotations

import asyncio

from corral.runtime.processes import CHUNK_COST
from tests.conftest import requires_root

pytestmark = requires_root

PRINT = 1 << 20
CMD = ["sh", "-c", f"head -c {PRINT} /dev/zero; sleep 60"]


async def _held_output(engine):
    info = await engine.create()
    proc = await engine.spawn(info.id, CMD)
    for _ in range(600):  # a bound, not a measure: until its output is all in
        if proc.unread_bytes >= PRINT:
            break
        await asyncio.sleep(0.05)
    held = PRINT + len(proc._events) * CHUNK_COST  # each chunk's objects counted too
    assert proc.unread_bytes == PRINT and engine.output_budget.used == held
    return info, proc


async def test_a_reader_sitting_on_its_output_as_the_sandbox_ends_leaks_no_budget(engine):
    info, proc = await _held_output(engine)
    gen = proc.output()
    first = await gen.__anext__()  # attached, one chunk read, the rest unread
    assert first.kind == "stdout" and 0 < engine.output_budget.used < PRINT
    await engine.delete(info.id)  # the reader is still attached: it drains, they said
    await gen.aclose()  # ... but its client hangs up instead
    assert engine.output_budget.used == 0, engine.output_budget.by_tenant
