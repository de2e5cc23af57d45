"""What a command leaves in its sandbox's log: its argv, times, how it ended, its tails.

:class:`CommandTap` watches a command's events as they pass (a few appends per chunk,
nothing on the hot path waits for a disk) and announces :class:`CommandEnded` once,
however the command ended. Its sizes are bounded here, before anything is queued: a
sandbox's output cannot make an entry bigger than :data:`TAIL_BYTES` per stream.
"""

from __future__ import annotations

import time
from collections.abc import Sequence

from corral.runtime.events import CommandEnded, Events
from corral.schema import ExecEvent

TAIL_BYTES = 4096  # of each stream, kept in the log
MAX_ARGV_BYTES = 2048  # of the command line, kept in the log
MAX_ARGS = 64


def bounded_argv(argv: Sequence[str]) -> tuple[str, ...]:
    """At most :data:`MAX_ARGS` arguments and :data:`MAX_ARGV_BYTES` in all (cut ones end
    in ``…``)."""
    out: list[str] = []
    left = MAX_ARGV_BYTES
    for arg in argv[:MAX_ARGS]:
        if left <= 0:
            break
        if len(arg) > left:
            arg = arg[:left] + "…"
        out.append(arg)
        left -= len(arg)
    if len(argv) > len(out):
        out.append(f"… ({len(argv) - len(out)} more)")
    return tuple(out)


class CommandTap:
    """Sees one command's events; :meth:`end` announces it (once)."""

    __slots__ = ("_events", "_sid", "_argv", "_started", "_out", "_err", "_result", "_done")

    def __init__(self, events: Events, sandbox_id: str, argv: Sequence[str]) -> None:
        self._events = events
        self._sid = sandbox_id
        self._argv = argv
        self._started = time.time()
        self._out = bytearray()
        self._err = bytearray()
        self._result: ExecEvent | None = None
        self._done = False

    def see(self, ev: ExecEvent) -> None:
        if ev.kind == "exit":
            self._result = ev
            return
        buf = self._out if ev.kind == "stdout" else self._err
        buf += ev.data[-TAIL_BYTES:]
        if len(buf) > 2 * TAIL_BYTES:
            del buf[:-TAIL_BYTES]

    def end(self) -> None:
        if self._done:
            return
        self._done = True
        result = self._result.result if self._result is not None else None
        if result is None:
            outcome, code = "killed", None
        elif result.timed_out:
            outcome, code = "timeout", None
        elif result.oom_killed:
            outcome, code = "oom", None
        else:
            outcome, code = "exit", result.returncode
        self._events.emit(CommandEnded(
            self._sid, bounded_argv(self._argv), self._started, time.time(), outcome, code,
            bytes(self._out[-TAIL_BYTES:]), bytes(self._err[-TAIL_BYTES:]), result,
        ))
