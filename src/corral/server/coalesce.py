"""One send per response: a transport that joins the writes of one turn of the loop.

uvicorn writes a response's status line and headers, then its body, in two
``transport.write`` calls; each is a ``send`` that wakes the client, which reads the
headers, sleeps, and wakes again for the body. :class:`CoalescedWrites` holds the
writes made during one turn of the event loop and sends them together at its end
(``loop.call_soon``), so a small response costs the daemon one syscall and the client
one wake-up. A response's last write is sent at once instead (:data:`FLUSH_KEY`: the
daemon's outermost middleware flushes after it), so the reply does not wait for the
rest of the handler's step nor for the next turn. Writes past :data:`FLUSH_BYTES` go out at once, so a streamed response
never piles up here and the real transport's flow control (``pause_writing``) still
sees every byte. ``close``/``write_eof`` send what is held first; ``abort`` drops it.
"""

from __future__ import annotations

import asyncio
from typing import Any

FLUSH_BYTES = 64 * 1024  # held bytes past this are sent at once
FLUSH_KEY = "corral.flush"
"""Where a request's scope holds its connection's :meth:`CoalescedWrites.flush`."""


class CoalescedWrites:
    """Wraps an ``asyncio.Transport``; everything but the writes is the transport's own."""

    __slots__ = ("raw", "written", "_loop", "_held", "_size", "_due")

    def __init__(self, raw: asyncio.Transport, loop: asyncio.AbstractEventLoop) -> None:
        self.raw = raw
        self._loop = loop
        self._held: list[bytes] = []
        self._size = 0
        self._due: asyncio.Handle | None = None  # the flush at the turn's end
        self.written = 0  # bytes written in all (less the buffer's: those sent on)

    def write(self, data: bytes | bytearray | memoryview) -> None:
        self.written += len(data)
        if not self._held:
            if len(data) >= FLUSH_BYTES:
                self.raw.write(data)
                return
            self._due = self._loop.call_soon(self.flush)
        self._held.append(bytes(data))
        self._size += len(data)
        if self._size >= FLUSH_BYTES:
            self.flush()

    def writelines(self, pieces: Any) -> None:
        for piece in pieces:
            self.write(piece)

    def flush(self) -> None:
        """Send what is held now (a no-op when nothing is)."""
        if self._due is not None:
            self._due.cancel()
            self._due = None
        if self._held:
            held, self._held, self._size = self._held, [], 0
            if not self.raw.is_closing():
                self.raw.write(held[0] if len(held) == 1 else b"".join(held))

    def get_write_buffer_size(self) -> int:
        return self.raw.get_write_buffer_size() + self._size

    def write_eof(self) -> None:
        self.flush()
        self.raw.write_eof()

    def close(self) -> None:
        self.flush()
        self.raw.close()

    def abort(self) -> None:
        self.written -= self._size
        self._held, self._size = [], 0
        self.raw.abort()

    def __getattr__(self, name: str) -> Any:  # is_closing, pause_reading, get_extra_info...
        return getattr(self.raw, name)
