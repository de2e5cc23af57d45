"""The cwsandbox port's relay (:class:`~corral.server.compat.cwsandbox_edge.GrpcEdge`)
passes every byte both ways on asyncio's loop and on uvloop's.

On uvloop a new connection is read before the coroutine that joins its two sides
resumes, so what the backend says first (gRPC's SETTINGS frame: the server speaks
first) reached a relay side with nowhere to send it and was dropped; every gRPC client
then failed with ``UNAVAILABLE: Socket closed``. The backend here greets on accept the
same way, then echoes a megabyte (so reading pauses and resumes on both sides).
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Coroutine
from typing import Any

import pytest

from corral.server.compat.cwsandbox_edge import GrpcEdge
from corral.server.conn_limits import ConnectionBook

GREETING = b"server speaks first"
BIG = bytes(range(256)) * 4096  # 1 MiB


def _runner(loop: str) -> Callable[[Coroutine[Any, Any, None]], None]:
    if loop == "uvloop":
        return pytest.importorskip("uvloop").run  # type: ignore[no-any-return]
    return asyncio.run


class _Greeter(asyncio.Protocol):
    def connection_made(self, transport: Any) -> None:
        self.transport = transport
        transport.write(GREETING)

    def data_received(self, data: bytes) -> None:
        self.transport.write(data)


async def _relay_round_trips(connections: int) -> None:
    edge = GrpcEdge(ConnectionBook(1000, 100))
    backend = await asyncio.get_running_loop().create_unix_server(_Greeter, edge.backend)
    try:
        port = await edge.listen("127.0.0.1", 0)
        for i in range(connections):
            reader, writer = await asyncio.open_connection("127.0.0.1", port)
            try:
                assert await asyncio.wait_for(reader.readexactly(len(GREETING)), 10) == GREETING, i
                payload = BIG if i == 0 else b"ping %d" % i
                writer.write(payload)
                assert await asyncio.wait_for(reader.readexactly(len(payload)), 10) == payload
            finally:
                writer.close()
    finally:
        backend.close()
        await edge.close()


@pytest.mark.parametrize("loop", ["asyncio", "uvloop"])
def test_the_relay_passes_what_the_backend_says_first(loop):
    _runner(loop)(_relay_round_trips(10))
