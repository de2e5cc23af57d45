"""A running command's output in the daemon, counted by the bytes it really holds.

Each of a command's output frames passes :meth:`OutputRoom.admit` on its way into the
command's event queue (:class:`~corral.runtime.channel.ExecStream`). A stream may hold
its floor (:attr:`~corral.runtime.output_budget.OutputHold.floor`, taken before the
command started) and grows its room from the output budget as its bytes come
(:mod:`corral.runtime.output_budget`). When the budget has no more, the stream's cap is
lowered there, to the room it holds:

- ``keep`` (a command run to completion, whose output waits for its result): the
  stream keeps the head it has and, from then on, its last bytes in a ring of at most
  half its floor (no more than its ``output_tail``), set aside within its room from the
  start; they are handed on, after the head, just before the command's exit. What falls
  out of the ring is dropped and counted;
- streamed (a reader takes the events as they come, and gives their room back as it
  does): a frame there is no room for is dropped and counted, and the reader sees the
  gap as a TAIL would show it (``ExecEvent.dropped``), before the next bytes it gets.

:meth:`OutputRoom.finish` writes what was dropped into the command's result
(``*_truncated``, ``*_dropped``, ``output_limited_to``). The agent's own cap
(``max_output``, :mod:`corral.runtime.outputcap`) is checked on the frames as received,
before any of this.
"""

from __future__ import annotations

from corral.runtime.output_budget import OutputHold
from corral.runtime.protocol import HEADER, Fields, Msg, Reply, Tag, encode
from corral.schema import ExecResult

__all__ = ["FRAME_COST", "OutputRoom"]

FRAME_COST = 320
"""What a streamed command's queued frame holds beyond its bytes (its reply, fields and
bytes objects: ~280 bytes in CPython), counted with them: a command printing a byte per
write, its reader reading none, made the daemon hold ~280 times the bytes it counted."""


class _Stream:
    __slots__ = ("msg", "room", "held", "ring", "ring_size", "limited", "dropped", "gap")

    def __init__(self, msg: int, floor: int, ring_size: int) -> None:
        self.msg = msg
        self.room = floor  # the bytes this stream may hold now
        self.held = 0  # the bytes it holds (head; queued, when streamed)
        self.ring: bytearray | None = None  # its last bytes, once limited (kept mode)
        self.ring_size = ring_size
        self.limited = False
        self.dropped = 0  # bytes the daemon dropped (past the agent's own count)
        self.gap = 0  # dropped and not yet shown to the reader (streamed)


def _gap(stream: _Stream) -> Reply:
    """A TAIL frame of the daemon's own: ``stream.gap`` bytes left out here."""
    which = 1 if stream.msg == Msg.STDOUT else 2
    frame = encode(Msg.TAIL, 0, [(Tag.STREAM, which), (Tag.DROPPED, stream.gap)])
    stream.gap = 0
    return Reply(Msg.TAIL, Fields(frame[HEADER.size:]))


class OutputRoom:
    """The room of one command's two streams in ``hold`` (see the module docstring);
    ``tail``: the ``output_tail`` asked (bounds the ring when ``keep``)."""

    def __init__(self, hold: OutputHold, tail: int, *, keep: bool) -> None:
        self.hold = hold
        self.keep = keep
        ring = min(tail, hold.floor // 2) if keep else 0
        self._streams: dict[int, _Stream] = {
            m: _Stream(m, hold.floor, ring) for m in (Msg.STDOUT, Msg.STDERR)}

    def admit(self, reply: Reply) -> list[Reply]:
        """What of ``reply`` goes into the queue now (with what it brings out: a gap, a
        ring before the exit)."""
        if reply.msg in self._streams:
            return self._data(self._streams[reply.msg], reply)
        if reply.msg == Msg.TAIL:
            s = self._streams[Msg.STDOUT if reply.fields.u64(Tag.STREAM) == 1 else Msg.STDERR]
            if s.limited and self.keep:
                return []  # the ring goes on: the agent's tail arrives into it
            if s.gap:  # shown as one gap: the daemon's and the agent's
                s.gap += reply.fields.u64(Tag.DROPPED)
                return [_gap(s)]
        elif reply.msg == Msg.EXIT:
            out = []
            for s in self._streams.values():
                if s.gap:
                    out.append(_gap(s))
                if s.ring:
                    out.append(Reply(s.msg, Fields(), bytes(s.ring)))
                    s.ring = None
            return [*out, reply]
        return [reply]

    def handed(self, reply: Reply) -> None:
        """``reply`` left the queue for a reader: a streamed command's room shrinks back
        to its floor as its bytes are taken."""
        s = self._streams.get(reply.msg)
        if s is None or self.keep or not reply.data:
            return
        s.held -= len(reply.data) + FRAME_COST
        spare = s.room - max(self.hold.floor, s.held)
        if spare > 0:
            s.room -= spare
            self.hold.shrink(self.hold.nbytes - spare)

    def finish(self, result: ExecResult) -> None:
        """Write what the daemon dropped into ``result``."""
        out, err = self._streams[Msg.STDOUT], self._streams[Msg.STDERR]
        for s, name in ((out, "stdout"), (err, "stderr")):
            if s.dropped:
                setattr(result, f"{name}_truncated", True)
                setattr(result, f"{name}_dropped", getattr(result, f"{name}_dropped") + s.dropped)
        if self.hold.limited:
            result.output_limited_to = self.hold.max_output
            if self.keep:
                result.output_tail = min(result.output_tail, out.ring_size)

    def _limit(self, s: _Stream) -> None:
        s.limited = True
        if not self.hold.limited or s.room > self.hold.max_output:
            self.hold.max_output = s.room  # the cap per stream, as lowered
        self.hold.limited = True

    def _data(self, s: _Stream, reply: Reply) -> list[Reply]:
        data, n = reply.data, len(reply.data)
        if s.ring is not None:  # limited, kept: the last bytes only
            s.ring += data
            if (over := len(s.ring) - s.ring_size) > 0:
                s.dropped += over
                del s.ring[:over]
            return []
        reserve = s.ring_size if self.keep else 0  # set aside for the ring, within the room
        if not self.keep:  # queued as a frame of its own until read
            n += FRAME_COST
        need = s.held + n + reserve - s.room
        if need > 0 and (got := self.hold.grow(need)) < need:
            s.room += got
            self._limit(s)
            if not self.keep:
                s.gap += len(data)
                s.dropped += len(data)
                return []
            fit = max(0, s.room - reserve - s.held)
            s.held += fit
            s.ring = bytearray()
            self._data(s, Reply(reply.msg, reply.fields, data[fit:]))
            return [Reply(reply.msg, reply.fields, data[:fit])] if fit else []
        if need > 0:
            s.room += need
        s.held += n
        return [_gap(s), reply] if s.gap else [reply]
