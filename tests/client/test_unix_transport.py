"""The asyncio SDK's Unix-socket streams (``client/_unix.py``) against small real servers:
replies, keep-alive, large bodies that must wait for the socket, a silent server (a
timeout), a server that hangs up (``DaemonUnavailable``). No daemon, no root."""

from __future__ import annotations

import asyncio

import httpx
import pytest

import corral
from corral.client._unix import AsyncDaemonTransport, _SocketStream

LIMITS = httpx.Limits(max_connections=None, max_keepalive_connections=8)


async def _serve(path, handle) -> asyncio.AbstractServer:
    return await asyncio.start_unix_server(handle, path=str(path))


async def _http_echo(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
    """Answer each request with the length of its body; keep the connection."""
    while True:
        head = await reader.readuntil(b"\r\n\r\n")
        length = 0
        for line in head.split(b"\r\n"):
            if line.lower().startswith(b"content-length:"):
                length = int(line.split(b":")[1])
        await asyncio.sleep(0.05)  # the client's write must wait for the socket
        body = await reader.readexactly(length)
        reply = b'{"status": "ok", "got": %d}' % len(body)
        writer.write(b"HTTP/1.1 200 OK\r\ncontent-type: application/json\r\n"
                     b"content-length: %d\r\n\r\n%s" % (len(reply), reply))
        await writer.drain()


def test_replies_bodies_and_connection_reuse(tmp_path):
    sock = tmp_path / "s.sock"

    async def main() -> None:
        server = await _serve(sock, _http_echo)
        async with httpx.AsyncClient(base_url="http://corral",
                                     transport=AsyncDaemonTransport(uds=str(sock), limits=LIMITS)) as http:
            big = b"x" * (8 << 20)  # far more than a socket buffer: the write waits
            r = await http.post("/up", content=big)
            assert r.json() == {"status": "ok", "got": len(big)}
            first = r.extensions["network_stream"]
            assert isinstance(first, _SocketStream)
            r = await http.get("/again")
            assert r.json()["got"] == 0
            assert r.extensions["network_stream"] is first  # one connection, kept
        server.close()

    asyncio.run(main())


def test_the_async_client_uses_it_and_times_out_on_a_silent_server(tmp_path):
    sock = tmp_path / "s.sock"

    async def silent(reader, writer) -> None:
        await reader.read(1 << 16)
        await asyncio.sleep(30)

    async def main() -> None:
        server = await _serve(sock, silent)
        async with corral.AsyncClient(f"unix://{sock}", timeout=0.3) as client:
            assert isinstance(client._http._transport, AsyncDaemonTransport)
            with pytest.raises(corral.CorralError) as info:
                await asyncio.wait_for(client.health(), 20)
        assert "time" in str(info.value).lower()
        server.close()

    asyncio.run(main())


def test_a_server_that_hangs_up_is_daemon_unavailable(tmp_path):
    sock = tmp_path / "s.sock"

    async def rude(reader, writer) -> None:
        await reader.read(1 << 16)
        writer.close()

    async def main() -> None:
        server = await _serve(sock, rude)
        async with corral.AsyncClient(f"unix://{sock}", timeout=5) as client:
            client.reconnect_wait = 0
            with pytest.raises(corral.DaemonUnavailable):
                await asyncio.wait_for(client.health(), 20)
        server.close()
        async with corral.AsyncClient(f"unix://{tmp_path / 'none.sock'}", timeout=5) as client:
            client.reconnect_wait = 0
            with pytest.raises(corral.DaemonUnavailable):
                await asyncio.wait_for(client.health(), 20)

    asyncio.run(main())
