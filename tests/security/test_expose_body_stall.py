"""An exposed port's relay and a request body that stops arriving (server/expose.py).

Whoever holds an exposed port's URL (no token) is the tenant's guest, and each relay
counts as one of the tenant's live streams (``--max-tenant-streams``) for as long as
it lasts. The relay sends the client's body to the sandbox's server as it comes; a
client that declared a length, sent a byte and then nothing held its relay, its
connection into the sandbox and the tenant's stream slot for good (every other body
the daemon reads is cut after ``BODY_IDLE_TIMEOUT_S`` without a piece: 408): a few
hundred such requests from anyone with the link took every stream the tenant has
(its own exec streams refused). The client is a fake ASGI one, as in
tests/server/test_read_body.py, the sandbox's server a real socket that reads all.
"""

from __future__ import annotations

import asyncio

import h11
import pytest
from starlette.requests import Request

from corral.errors import RequestTimeout
from corral.server import expose, wire


def _stalling(first: bytes, declared: int) -> Request:
    sent = []

    async def receive():
        if sent:
            await asyncio.sleep(3600)  # the client sends nothing more
        sent.append(1)
        return {"type": "http.request", "body": first, "more_body": True}

    return Request({"type": "http", "method": "POST", "path": "/", "query_string": b"",
                    "headers": [(b"content-length", str(declared).encode())]}, receive)


async def _relay_body(request: Request) -> bytes:
    got = bytearray()

    async def server(reader, writer):
        while chunk := await reader.read(1 << 16):
            got.extend(chunk)

    srv = await asyncio.start_server(server, "127.0.0.1", 0)
    port = srv.sockets[0].getsockname()[1]
    _, writer = await asyncio.open_connection("127.0.0.1", port)
    conn = h11.Connection(h11.CLIENT)
    writer.write(conn.send(h11.Request(method=b"POST", target=b"/", headers=[
        (b"host", b"localhost"), (b"content-length", b"1000")])))
    try:
        # (the bound only turns a hang, the attack succeeding, into a failure)
        await asyncio.wait_for(expose._send_body(request, conn, writer, 1 << 20), 5)
    finally:
        writer.close()
        srv.close()
    return bytes(got)


def test_a_relayed_body_that_stops_arriving_is_cut(monkeypatch):
    monkeypatch.setattr(wire, "BODY_IDLE_TIMEOUT_S", 0.2)
    with pytest.raises(RequestTimeout):
        asyncio.run(_relay_body(_stalling(b"x", 1000)))
