"""A client that never reads cannot make the daemon hold its responses in memory
through :class:`~corral.server.coalesce.CoalescedWrites` (one send per response).

The wrapper holds at most :data:`~corral.server.coalesce.FLUSH_BYTES` per connection and
only until the end of the loop's turn; everything past that reaches the real transport,
whose flow control (``pause_writing``, what uvicorn waits on before writing more) sees
every byte; a closed or aborted connection holds nothing. Real sockets, no mock."""

from __future__ import annotations

import asyncio
import socket

from corral.server.coalesce import FLUSH_BYTES, CoalescedWrites


class _Watch(asyncio.Protocol):
    def __init__(self) -> None:
        self.paused = 0

    def pause_writing(self) -> None:
        self.paused += 1

    def resume_writing(self) -> None:
        pass


async def test_a_client_that_never_reads_meets_flow_control_not_a_heap():
    loop = asyncio.get_running_loop()
    ours, theirs = socket.socketpair()  # ``theirs`` never reads: a stalled client
    ours.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, 4096)
    transport, proto = await loop.create_connection(_Watch, sock=ours)
    transport.set_write_buffer_limits(high=FLUSH_BYTES)
    w = CoalescedWrites(transport, loop)
    try:
        piece = b"x" * 1000
        most_held = 0
        for _ in range(5000):  # 5 MB of small writes in one turn of the loop
            w.write(piece)
            most_held = max(most_held, w._size)
        assert most_held < FLUSH_BYTES + len(piece)  # held: bounded, not 5 MB
        assert proto.paused >= 1  # the real transport saw the bytes: uvicorn would wait
        assert w.get_write_buffer_size() >= transport.get_write_buffer_size()
        w.write(b"tail")
        held = w.get_write_buffer_size() - transport.get_write_buffer_size()
        assert 4 <= held < FLUSH_BYTES  # counted while held
        await asyncio.sleep(0)  # the turn ends: nothing is held any more
        await asyncio.sleep(0)
        assert w._size == 0 and w._held == []
        w.write(b"after")
        w.abort()  # a connection reset: what is held is dropped at once
        assert w._size == 0 and w._held == []
        await asyncio.sleep(0)
        w.write(b"late")  # after close: held a turn, then dropped unsent
        await asyncio.sleep(0)
        await asyncio.sleep(0)
        assert w._held == []
    finally:
        transport.abort()
        theirs.close()
