"""What the engine keeps of a command's output: each stream's head and its tail.

A stream (stdout or stderr) of up to ``max_output`` bytes is kept whole. A longer one
keeps its first ``max_output - output_tail`` bytes (the head) and its last
``output_tail`` bytes (the tail, where a verdict or a traceback is printed); the bytes
in between are dropped and counted (``dropped``). ``output_tail=0`` keeps the head only.

How the agent delivers it (``agent/exec.c``: ``drain``, ``send_tail``): it forwards the
head as it is written and holds what comes after it in a ring of ``output_tail``
bytes. When the command has ended, before its EXIT, it sends per stream: if more went
over the head than the ring holds, one TAIL frame (the stream, the bytes dropped), then
the ring as ordinary output frames. A stream that fits sends no TAIL: its output is
simply complete. So a reader of the events sees the head, a gap (``ExecEvent.dropped``),
and the tail, all in order.

The agent runs among the code it supervises, so :class:`StreamCap` checks, per stream:

- before a TAIL: at most ``max_output`` bytes;
- a TAIL: only for a capped stream, at most once, and only when exactly the head has
  arrived (never before the head is full, never after more);
- after it: at most ``output_tail`` bytes, and by the EXIT exactly that many (the ring is
  full whenever bytes were dropped).

Anything else is a :class:`~corral.runtime.protocol.ProtocolViolation` (the sandbox is
ended for it). So the engine never holds more than ``max_output`` bytes of a stream,
and a result's head, tail and truncated flag are what the engine itself received. The
number of bytes dropped is the agent's count: those bytes never reach the daemon (an
honest agent spares it a flood), so like the output itself it is the sandbox's word,
accepted only in a frame that fits the checks above (at least 1, at most
:data:`~corral.runtime.protocol.MAX_DROPPED`).
"""

from __future__ import annotations

from corral.runtime.protocol import ProtocolViolation


class StreamCap:
    """The accounting of one stream of one command (``limit`` None: no cap, no tail)."""

    __slots__ = ("name", "limit", "tail", "received", "tail_received", "dropped", "gap")

    def __init__(self, name: str, limit: int | None, tail: int = 0) -> None:
        self.name = name
        self.limit = limit
        self.tail = 0 if limit is None else min(tail, limit)
        self.received = 0  # bytes before the gap: the head, or all of a stream that fit
        self.tail_received = 0
        self.dropped = 0
        self.gap = False

    @property
    def head(self) -> int | None:
        return None if self.limit is None else self.limit - self.tail

    @property
    def truncated(self) -> bool:
        return self.gap

    @property
    def kept(self) -> int:
        return self.received + self.tail_received

    def feed(self, n: int) -> None:
        """Count ``n`` bytes of output; a violation if they go over what may come."""
        if self.limit is None:
            self.received += n
        elif self.gap:
            if self.tail_received + n > self.tail:
                raise ProtocolViolation(
                    "tail_over_cap",
                    f"{self.tail_received + n} bytes of {self.name} after its TAIL "
                    f"(its tail is {self.tail})",
                )
            self.tail_received += n
        else:
            if self.received + n > self.limit:
                raise ProtocolViolation(
                    "output_over_cap",
                    f"{self.received + n} bytes of {self.name} without a TAIL "
                    f"(at most {self.limit} allowed)",
                )
            self.received += n

    def skip(self, dropped: int) -> None:
        """A TAIL frame: ``dropped`` bytes were left out after the head."""
        if self.limit is None:
            raise ProtocolViolation(
                "unexpected_tail", f"a TAIL for {self.name}, which has no output cap"
            )
        if self.gap:
            raise ProtocolViolation("duplicate_tail", f"a second TAIL for {self.name}")
        if self.received != self.head:
            raise ProtocolViolation(
                "misplaced_tail",
                f"a TAIL for {self.name} after {self.received} bytes (its head is {self.head})",
            )
        self.gap, self.dropped = True, dropped

    def end(self) -> None:
        """The command's EXIT: a stream with a gap must have its whole tail by now."""
        if self.gap and self.tail_received != self.tail:
            raise ProtocolViolation(
                "short_tail",
                f"an EXIT after {self.tail_received} bytes of {self.name}'s tail "
                f"({self.tail} expected after a TAIL)",
            )
