"""A response's writes leave in one send (corral.server.coalesce): the writes of one
turn of the loop are joined, big or streamed output is never held back, close sends
what is held and abort drops it. The transport below records what reaches the socket."""

from __future__ import annotations

import asyncio

from corral.server.coalesce import FLUSH_BYTES, CoalescedWrites


class Recording(asyncio.Transport):
    def __init__(self) -> None:
        super().__init__()
        self.sent: list[bytes] = []
        self.closed = self.aborted = self.eof = False

    def write(self, data) -> None:
        assert not self.closed, "a write after close"
        self.sent.append(bytes(data))

    def is_closing(self) -> bool:
        return self.closed

    def close(self) -> None:
        self.closed = True

    def abort(self) -> None:
        self.aborted = self.closed = True

    def write_eof(self) -> None:
        self.eof = True

    def get_write_buffer_size(self) -> int:
        return 0

    def get_extra_info(self, name, default=None):
        return {"peername": "here"}.get(name, default)


def _run(body) -> Recording:
    async def main() -> Recording:
        raw = Recording()
        await body(CoalescedWrites(raw, asyncio.get_running_loop()), raw)
        return raw
    return asyncio.run(main())


def test_headers_and_body_of_one_turn_are_one_send():
    async def body(t: CoalescedWrites, raw: Recording) -> None:
        head = b"HTTP/1.1 200 OK\r\ncontent-length: 2\r\n\r\n"
        t.write(head)
        t.write(b"{}")
        assert raw.sent == [] and t.get_write_buffer_size() == len(head) + 2
        await asyncio.sleep(0)
        assert raw.sent == [head + b"{}"]
        t.write(b"next")  # a later turn: its own send
        await asyncio.sleep(0)
        assert raw.sent[1:] == [b"next"]
    _run(body)


def test_big_and_streamed_writes_are_never_held_back():
    async def body(t: CoalescedWrites, raw: Recording) -> None:
        t.write(b"x" * FLUSH_BYTES)  # big: at once
        assert raw.sent == [b"x" * FLUSH_BYTES]
        for _ in range(40):  # 40 x 16 KiB in one turn: at most FLUSH_BYTES held
            t.write(bytearray(16 * 1024))
            assert t.get_write_buffer_size() < FLUSH_BYTES
        await asyncio.sleep(0)
        assert sum(map(len, raw.sent)) == FLUSH_BYTES + 40 * 16 * 1024
    _run(body)


def test_close_and_eof_send_what_is_held_and_abort_drops_it():
    async def body(t: CoalescedWrites, raw: Recording) -> None:
        t.write(b"bye")
        t.write_eof()
        assert raw.sent == [b"bye"] and raw.eof
        t.write(b"last")
        t.close()
        assert raw.sent == [b"bye", b"last"] and raw.closed
        await asyncio.sleep(0)  # the scheduled flush finds nothing to send
        assert raw.sent == [b"bye", b"last"]
        t.write(b"late")  # after close: dropped, never written to a closed transport
        await asyncio.sleep(0)
        assert raw.sent == [b"bye", b"last"]
    _run(body)

    async def aborting(t: CoalescedWrites, raw: Recording) -> None:
        t.write(b"never")
        t.abort()
        await asyncio.sleep(0)
        assert raw.sent == [] and raw.aborted
        assert t.get_extra_info("peername") == "here"  # the rest is the transport's
    _run(aborting)
