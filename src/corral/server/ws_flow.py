"""WebSockets (an exposed port's, a port socket) that stop reading a client that does
not read.

uvicorn's WebSocket protocol answers a ping at once, into the connection's write
buffer, whether or not the client reads: a client that sends pings (or anything the
daemon answers) and reads nothing grew the daemon's memory without bound (300 MB of
pings: +290 MB, ``tests/security/test_port_socket.py``). Here, while the write buffer
is over its high-water mark, the connection is not read either: the client's own TCP
window stops it, as a plain socket would.
"""

from __future__ import annotations

from uvicorn.protocols.websockets.websockets_sansio_impl import WebSocketsSansIOProtocol

__all__ = ["FlowControlledWebSocket"]


class FlowControlledWebSocket(WebSocketsSansIOProtocol):
    """uvicorn's sans-I/O WebSocket protocol, not read while its replies wait."""

    _held = False  # the write buffer is over its high-water mark: reading stopped

    def pause_writing(self) -> None:
        super().pause_writing()
        self._held = True
        self.transport.pause_reading()

    def resume_writing(self) -> None:
        super().resume_writing()
        self._held = False
        if not self.read_paused:  # (uvicorn's own pause: messages the app has not taken)
            self.transport.resume_reading()

    def data_received(self, data: bytes) -> None:
        super().data_received(data)
        if self._held:  # reading was resumed meanwhile (the app took its messages)
            self.transport.pause_reading()
