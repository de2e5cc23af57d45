"""WebSockets (an exposed port's, a port socket): what a client can make the daemon hold.

- Replies it does not read: uvicorn's WebSocket protocol answers a ping at once, into
  the connection's write buffer, whether or not the client reads: a client that sent
  pings (or anything the daemon answers) and read nothing grew the daemon's memory
  without bound (300 MB of pings: +290 MB, ``tests/security/test_port_socket.py``).
  Here, while the write buffer is over its high-water mark, the connection is not read
  either: the client's own TCP window stops it, as a plain socket would.
- Messages the app has not asked for: uvicorn read the client again as soon as the app
  took a message, so while an app relayed one (to a sandbox's server that may read
  none) the next, up to ``ws_max_size`` (16 MiB), was read and queued too, and a third
  begun. Here the client is read only while the app waits for a message
  (:meth:`FlowControlledWebSocket.receive`): one message in flight a connection. Its
  pongs then wait unread too: uvicorn's keepalive would cut a client whose message
  a slow server has not taken in 40 s; here it pings again instead.
- Many at once: uvicorn fed the parser all that one read brought (256 KiB): up to
  43,690 empty messages, each a queued dict. Here the parser is fed :data:`PIECE` bytes
  at a time; the rest of the read waits, raw, until the app asks for the next message.
- Fragments: uvicorn kept a fragmented message as a list of its fragments, a byte of
  payload ~50 of memory, and empty continuation frames (which add nothing to the
  message's size, so ``ws_max_size`` never stops them) grew it without end. Here a
  fragmented message grows one buffer.
- Replies it reads too slowly, or not at all, while the app waits to send more (an
  exposed port's relay, holding a message in the tenant's output budget, a live stream
  of the tenant and the sandbox's server): the HTTP protocol's rule
  (:mod:`corral.server.write_stall`) holds here too. uvicorn's keepalive did not end
  them: its close waits for the write buffer to drain, and it never does, so the
  connection, and the app's wait to send, stayed for as long as the client kept it.
- A budget: an app may charge what a connection holds of its client's messages (the
  bytes being parsed, and the last message it took, until it asks for the next; up to
  :data:`PIECE` is kept between messages, so small ones cost no budget call) to a
  hold of the tenant's output budget (:class:`Inbound`, found in the scope's
  ``extensions`` under :data:`INBOUND`). When the budget has no room left, the
  connection is closed with 1013 (try again later) and :attr:`Inbound.refusal`.
  :class:`Relayed` is that charge as a relay to a sandbox's server makes it (an
  exposed port's WebSocket, a port socket): the same hold and refusal for both.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable
from typing import Any

from uvicorn.protocols.websockets.websockets_sansio_impl import WebSocketsSansIOProtocol
from websockets.frames import Frame

from corral.runtime.output_budget import OutputHold
from corral.server.write_stall import CountedWrites, WriteStall

__all__ = ["INBOUND", "PIECE", "SPENT", "TRY_LATER", "UP_REFUSAL", "FlowControlledWebSocket",
           "Inbound", "Relayed", "ws_protocol_for"]

PIECE = 4096  # bytes fed to the parser at a time (at most ~680 empty messages)
INBOUND = "corral.inbound"  # the scope's extensions: the connection's Inbound
TRY_LATER = 1013
SPENT = "output budget spent"  # the close reason (1013) of a message to the client
UP_REFUSAL = "output budget spent: the sandbox's server is slow to read; message not relayed"


class Inbound:
    """What a connection holds of its client's messages, charged to :attr:`hold` once
    an app binds one (None: not charged); the app unbinds it before releasing it.
    :attr:`gone` is set once the connection is lost: an app busy with a message (not
    reading) learns it there."""

    __slots__ = ("gone", "hold", "refusal")

    def __init__(self) -> None:
        self.hold: OutputHold | None = None
        self.refusal = "output budget spent"  # the close reason (1013) when it is
        self.gone = asyncio.Event()


class Relayed:
    """What a relay holds of its client's messages to a sandbox's server, in ``hold``
    (the tenant's output budget), until that server has taken each: bound to the
    connection's :class:`Inbound` (the bytes being parsed, then the message), or, on a
    protocol without one, grown here by each message (:meth:`took`). Closed with 1013
    and :data:`UP_REFUSAL` when the budget has no room; :meth:`release` once done."""

    __slots__ = ("hold", "inbound")

    def __init__(self, scope: Any, hold: OutputHold) -> None:
        self.hold = hold
        self.inbound: Inbound | None = (scope.get("extensions") or {}).get(INBOUND)
        if self.inbound is not None:
            self.inbound.hold, self.inbound.refusal = hold, UP_REFUSAL

    def took(self, nbytes: int) -> bool:
        """Whether a message of ``nbytes`` the relay took is held (False: refuse it)."""
        return self.inbound is not None or self.hold.grow(nbytes) >= nbytes

    def sent(self) -> None:
        """The sandbox's server has taken the message."""
        if self.inbound is None:
            self.hold.shrink(0)

    def gone(self) -> Awaitable[Any] | None:
        """Done once the client has left (a relay waiting on a deaf server learns it
        here); None where the protocol does not say."""
        return None if self.inbound is None else self.inbound.gone.wait()

    def release(self) -> None:
        if self.inbound is not None:
            self.inbound.hold = None
        self.hold.release()


class FlowControlledWebSocket(WebSocketsSansIOProtocol):
    """uvicorn's sans-I/O WebSocket protocol, read only while the app waits for a
    message and its replies do not wait (see the module docstring)."""

    _held = False  # the write buffer is over its high-water mark: reading stopped
    _rest = b""  # read from the client, not parsed yet (the app has not asked)
    _inbound: Inbound | None = None
    _joined: bytearray | None = None  # a fragmented message so far (not a list of them)
    write_stall: float | None = None  # seconds (the daemon's: ws_protocol_for)
    write_min_rate = 0.0
    _stall: WriteStall | None = None

    def connection_made(self, transport: Any) -> None:  # type: ignore[override]
        super().connection_made(CountedWrites(transport))  # (for WriteStall)
        if self.write_stall:
            who = f"a WebSocket from {self.client[0]}" if self.client else "a WebSocket"
            self._stall = WriteStall(self.loop, self.write_stall, self.write_min_rate, who)

    def handle_connect(self, event: Any) -> None:
        super().handle_connect(event)
        scope = getattr(self, "scope", None)  # (none: the handshake was refused)
        if scope is not None:
            self._inbound = scope["extensions"][INBOUND] = Inbound()

    def connection_lost(self, exc: Exception | None) -> None:
        if self._stall is not None:
            self._stall.stop()
        super().connection_lost(exc)
        if self._inbound is not None:
            self._inbound.gone.set()

    def keepalive_timeout(self) -> None:
        # no pong: while the app holds a message (a sandbox's server not taking it) the
        # client is not read, and its pong waits unread behind its data: no sign that
        # it has gone. Ping again instead (a write to a client that has gone fails:
        # connection_lost). A client that reads nothing of ours is cut as uvicorn does.
        if self.read_paused and not self._held and not self.transport.is_closing():
            self.pong_timer = None
            self.send_keepalive_ping()
            return
        super().keepalive_timeout()

    def pause_writing(self) -> None:
        super().pause_writing()
        self._held = True
        self.transport.pause_reading()
        if self._stall is not None:
            self._stall.paused(self.transport)

    def resume_writing(self) -> None:
        if self._stall is not None:
            self._stall.resumed()
        super().resume_writing()
        self._held = False
        if not self.read_paused:  # (uvicorn's own pause: messages the app has not taken)
            self._read_on()

    def data_received(self, data: bytes) -> None:
        self._rest = self._rest + data if self._rest else data
        self._feed()
        if self._held:  # reading was resumed meanwhile (the app took its messages)
            self.transport.pause_reading()

    def _feed(self) -> None:
        """Parse what the client sent, a piece at a time, while nothing stops reading;
        what is left waits in :attr:`_rest`."""
        rest, at = self._rest, 0
        while at < len(rest) and not (self.read_paused or self._held
                                      or self.transport.is_closing()):
            piece = rest[at:at + PIECE] if at or len(rest) > PIECE else rest
            at += len(piece)
            super().data_received(piece)
            self._charge()
        self._rest = b"" if at >= len(rest) or self.transport.is_closing() else rest[at:]

    def _read_on(self) -> None:
        self._feed()  # what was read already first: it may hold a whole message
        if not (self.read_paused or self._held or self.transport.is_closing()):
            self.transport.resume_reading()

    async def receive(self) -> Any:
        # (uvicorn resumed reading once the app took a message: the next was read and
        # queued while the app still held this one)
        if self.read_paused and self.queue.empty():
            self.read_paused = False
            hold = self._inbound.hold if self._inbound is not None else None
            if hold is not None and hold.nbytes > PIECE:  # done with the last message
                hold.shrink(self._parsing())  # (a small one's room is kept: no budget
                # call a message, as a port socket's gym steps would make)
            self._read_on()
        return await self.queue.get()

    async def send(self, message: Any) -> None:
        await super().send(message)
        if self._rest and not self.read_paused:  # a close resumed reading: its echo
            self._read_on()

    def handle_cont(self, event: Frame) -> None:
        joined = self._joined
        if joined is None:
            joined = self._joined = bytearray(self.frames[0])
            self.frames = []
        joined += event.data
        if event.fin:
            self._joined = None
            self.frames = [bytes(joined)]
            del joined
            self.send_receive_event_to_app()

    def _parsing(self) -> int:
        """Bytes of the client's messages the parser holds (a frame's, a fragmented
        message's)."""
        frames, joined = self.frames, self._joined
        return (len(self.conn.reader.buffer) + (sum(map(len, frames)) if frames else 0)
                + (0 if joined is None else len(joined)))

    def _charge(self) -> None:
        """Grow the bound hold to what the parser holds (it keeps the message the app
        takes until the app asks for the next); close with 1013 where it cannot."""
        inbound = self._inbound
        if inbound is None or inbound.hold is None or self.close_sent:
            return
        hold, need = inbound.hold, self._parsing()
        if need > hold.nbytes:
            hold.grow(need - hold.nbytes)  # (what the budgets have: less when spent)
            if hold.nbytes < need:
                self._refuse(inbound.refusal)

    def _refuse(self, reason: str) -> None:
        self.conn.fail(TRY_LATER, reason)
        self.queue.put_nowait({"type": "websocket.disconnect", "code": TRY_LATER,
                               "reason": reason})
        self.transport.write(b"".join(self.conn.data_to_send()))
        self.close_sent = True
        self.frames, self._joined = [], None
        self.transport.close()


def ws_protocol_for(write_stall: float | None,
                    write_min_rate: float = 0.0) -> type[FlowControlledWebSocket]:
    """uvicorn's ``ws`` protocol class for one daemon: its connections are reset after
    ``write_stall`` seconds of replies their client reads none of, or less than
    ``write_min_rate`` bytes a second of (None: never)."""
    return type("FlowControlledWebSocket", (FlowControlledWebSocket,),
                {"write_stall": write_stall, "write_min_rate": write_min_rate})
