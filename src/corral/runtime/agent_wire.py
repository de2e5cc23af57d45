"""The agent's socket as an asyncio protocol: frames cut and handed on where they arrive.

The loop calls :meth:`AgentWire.data_received` with what one read returned; every
whole frame in it is handed to its ``on_frame`` there and then. A reader task over an
``asyncio.StreamReader`` would take a turn of the loop for each frame (the read wakes
the task, the task hands the frame on, which wakes its waiter): here the waiter is woken
in the turn the bytes came. What is checked is unchanged: a frame's header is checked
(:func:`~corral.runtime.protocol.check_header`: its type, its size against its type's
cap) as soon as the header is here, before any byte of its payload is waited for, and
the wire holds at most one partial frame plus what one read returned (asyncio reads at
most 256 KiB at once). A frame longer than a control frame is also put to ``admit``
then: whether any open request may be answered with that many bytes (the channel's
:meth:`~corral.runtime.channel.AgentChannel.admit`), so that an agent cannot make the
daemon hold a reply nobody asked for, up to 16 MiB a sandbox, until its last byte.

The write side is the transport's, with ``drain``'s flow control (the kernel's buffer
full: wait until the agent reads).
"""

from __future__ import annotations

import asyncio
from typing import Any, Callable

from corral.runtime.protocol import HEADER, MAX_CONTROL_FRAME, Fields, check_header

_HEAD = HEADER.size


class AgentWire(asyncio.Protocol):
    """Calls ``on_frame(msg, rid, fields)`` for each frame, ``on_fault(exc)`` once if one
    fails its checks or its handling (then nothing more is read), and ``on_lost()``
    once when the connection is gone (EOF, an error, or our own close); ``admit(msg,
    rid, length)``, where given, at the header of each frame longer than a control
    frame (it raises to refuse it)."""

    def __init__(
        self,
        on_frame: Callable[[int, int, Fields], None],
        on_fault: Callable[[BaseException], None],
        on_lost: Callable[[], None],
        admit: Callable[[int, int, int], None] | None = None,
    ) -> None:
        self._on_frame, self._on_fault, self._on_lost = on_frame, on_fault, on_lost
        self._admit = admit
        self.transport: asyncio.Transport | None = None
        self._buf = bytearray()
        self._stopped = False  # a fault: what still comes is dropped unread
        self._paused = False  # the kernel's send buffer is full
        self._drainers: list[asyncio.Future[None]] = []
        self._lost = False
        self.received = 0  # bytes of the frames handed on
        self.peak_buffered = 0  # the most bytes held at once (a partial frame and a read)

    def buffered(self) -> int:
        """Bytes read but not yet handed on (a partial frame)."""
        return len(self._buf)

    # ------------------------------------------------------------------ reading

    def connection_made(self, transport: Any) -> None:
        self.transport = transport

    def data_received(self, data: bytes) -> None:
        if self._stopped:
            return
        if self._buf:
            self._buf += data
            view: bytes | bytearray = self._buf
        else:
            view = data  # whole frames need no copy into the buffer
        self.peak_buffered = max(self.peak_buffered, len(view))
        pos, end = 0, len(view)
        try:
            while end - pos >= _HEAD:
                length, msg, rid = HEADER.unpack_from(view, pos)
                check_header(length, msg)  # before a byte of the payload is waited for
                if length > MAX_CONTROL_FRAME and self._admit is not None:
                    self._admit(msg, rid, length)  # (and one nobody may be sent)
                if end - pos - _HEAD < length:
                    break
                start = pos + _HEAD
                pos = start + length
                self.received += _HEAD + length
                self._on_frame(msg, rid, Fields(bytes(view[start:pos])) if length else Fields())
                if self._stopped:
                    return
        except Exception as exc:  # noqa: BLE001 - a violation, or a frame our checks missed
            self.stop()
            self._on_fault(exc)
            return
        if view is self._buf:
            del self._buf[:pos]
        elif pos < end:
            self._buf += memoryview(data)[pos:]

    def stop(self) -> None:
        """Read nothing more (the channel ended)."""
        self._stopped = True
        self._buf = bytearray()

    def eof_received(self) -> bool:
        return False  # the agent's end is shut: the transport closes, connection_lost says so

    def connection_lost(self, exc: Exception | None) -> None:
        if self._lost:
            return
        self._lost = True
        self._wake_drainers(ConnectionResetError("the agent's connection is closed"))
        self._on_lost()

    # ------------------------------------------------------------------ writing

    def pause_writing(self) -> None:
        self._paused = True

    def resume_writing(self) -> None:
        self._paused = False
        self._wake_drainers(None)

    def _wake_drainers(self, exc: BaseException | None) -> None:
        drainers, self._drainers = self._drainers, []
        for fut in drainers:
            if not fut.done():
                if exc is None:
                    fut.set_result(None)
                else:
                    fut.set_exception(exc)

    async def drain(self) -> None:
        """Wait until the kernel takes more (what was written is on its way);
        ``ConnectionResetError`` if the connection is gone."""
        if self._lost:
            raise ConnectionResetError("the agent's connection is closed")
        if not self._paused:
            return
        fut = asyncio.get_running_loop().create_future()
        self._drainers.append(fut)
        await fut
