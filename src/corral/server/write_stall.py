"""Clients that stop reading, or read a trickle: one rule for every kind of connection.

A reply the client does not take waits in the daemon, holding its room in the output
budget, its buffers, its connection (and, for an exposed port's WebSocket, a live stream
of the tenant and the sandbox's server). :class:`WriteStall` watches one connection:
from when its transport pauses for writing (its buffer above the high-water mark), the
client must take at least ``--write-min-rate`` bytes a second, and at least one byte,
on average over each ``--write-stall-timeout`` window while the connection stays paused;
else the connection is reset (``SO_LINGER`` 0 on TCP: the kernel drops the bytes it held
too) and every wait on it ends. A window runs on through a resume, so a client cannot
restart it by draining just the buffer's low-water gap; one that ends unpaused ends.

What the client took is counted as all that was written to the transport less what
still waits there and in the kernel's send queue (``SIOCOUTQ``: on loopback the kernel
holds megabytes, and the transport's own buffer moves only when a third of them left).
Used by the HTTP protocol (:class:`corral.server.limits.BoundedHttpProtocol`, its
transport a :class:`corral.server.coalesce.CoalescedWrites`) and the WebSocket one
(:class:`corral.server.ws_flow.FlowControlledWebSocket`, a :class:`CountedWrites`).
"""

from __future__ import annotations

import asyncio
import fcntl
import logging
import socket
import struct
import termios
from contextlib import suppress
from typing import Any

__all__ = ["CountedWrites", "WriteStall"]

logger = logging.getLogger("corral.server")


class CountedWrites:
    """Wraps an ``asyncio.Transport``, counting the bytes written (:attr:`written`)."""

    __slots__ = ("raw", "written")

    def __init__(self, raw: asyncio.Transport) -> None:
        self.raw = raw
        self.written = 0

    def write(self, data: bytes | bytearray | memoryview) -> None:
        self.written += len(data)
        self.raw.write(data)

    def writelines(self, pieces: Any) -> None:
        for piece in pieces:
            self.write(piece)

    def __getattr__(self, name: str) -> Any:  # is_closing, close, pause_reading...
        return getattr(self.raw, name)


def _kernel_queue(transport: Any) -> int:
    """Bytes the kernel still holds to send on ``transport``'s socket (TCP: unsent and
    unacknowledged; Unix: unread); 0 if it cannot say."""
    sock = transport.get_extra_info("socket")
    try:
        return struct.unpack("i", fcntl.ioctl(sock.fileno(), termios.TIOCOUTQ, b"\0" * 4))[0]
    except (AttributeError, OSError, ValueError):
        return 0


class WriteStall:
    """The rule of the module docstring for one connection, whose protocol calls
    :meth:`paused`, :meth:`resumed` and :meth:`stop` (on ``connection_lost``)."""

    __slots__ = ("_loop", "_seconds", "_min_rate", "_what", "_transport", "_timer",
                 "_mark", "_paused")

    def __init__(self, loop: asyncio.AbstractEventLoop, seconds: float, min_rate: float,
                 what: str) -> None:
        self._loop = loop
        self._seconds = seconds
        self._min_rate = min_rate
        self._what = what  # "a connection from 127.0.0.1" (for the log)
        self._transport: Any = None
        self._timer: asyncio.TimerHandle | None = None
        self._mark = 0  # bytes the client had taken when the window began
        self._paused = False

    def paused(self, transport: Any) -> None:
        """``transport`` (counting its writes in ``written``) paused for writing."""
        self._paused, self._transport = True, transport
        if self._timer is None:
            self._watch()

    def resumed(self) -> None:
        self._paused = False  # (the window runs on: its check ends it if still unpaused)

    def stop(self) -> None:
        self._paused = False
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None

    def _taken(self) -> int:
        t = self._transport
        return t.written - t.get_write_buffer_size() - _kernel_queue(t)

    def _watch(self) -> None:
        self._mark = self._taken()
        self._timer = self._loop.call_later(self._seconds, self._check)

    def _check(self) -> None:
        self._timer = None
        if not self._paused:
            return  # the replies caught up: the next pause begins a new window
        taken = self._taken() - self._mark
        if taken > 0 and taken >= self._min_rate * self._seconds:
            self._watch()  # slow, not stalled: a new window
            return
        t = self._transport
        logger.info("closed %s: its client read %d bytes of its reply in %g s "
                    "(--write-stall-timeout), less than %g a second (--write-min-rate) or "
                    "none; %d bytes were waiting", self._what, max(taken, 0), self._seconds,
                    self._min_rate, t.get_write_buffer_size())
        sock = t.get_extra_info("socket")
        if sock is not None and sock.family != socket.AF_UNIX:  # a reset: the kernel
            with suppress(OSError):  # drops what it holds too (a close queues a FIN)
                sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
        t.abort()  # (a close would wait for the buffer to drain: never)
