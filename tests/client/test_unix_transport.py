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


def test_a_connection_the_server_closes_while_idle_is_dropped_without_spinning(tmp_path):
    """The stream stays registered with the loop between replies; when the server closes
    an idle one, the loop stops watching it (no busy loop on a readable socket) and the
    next call goes out on a new connection."""
    sock = tmp_path / "s.sock"

    async def once(reader, writer) -> None:  # one reply, then hang up
        await reader.readuntil(b"\r\n\r\n")
        writer.write(b"HTTP/1.1 200 OK\r\ncontent-length: 15\r\n\r\n{\"status\":\"ok\"}")
        await writer.drain()
        writer.close()

    async def main() -> None:
        server = await _serve(sock, once)
        loop = asyncio.get_running_loop()
        async with corral.AsyncClient(f"unix://{sock}", timeout=5) as client:
            assert await client.health() == {"status": "ok"}
            stream = client._lean._idle[-1][1]
            assert isinstance(stream, _SocketStream) and stream._reading
            turns = 0
            run_once = loop._run_once

            def counted() -> None:
                nonlocal turns
                turns += 1
                run_once()

            loop._run_once = counted
            try:
                await asyncio.sleep(0.2)  # the server's close arrives while it is idle
            finally:
                del loop._run_once
            assert not stream._reading
            assert turns < 20  # a readable socket left registered: thousands
            assert await client.health() == {"status": "ok"}
            assert client._lean._idle[-1][1] is not stream
        server.close()

    asyncio.run(main())


def test_bytes_received_for_a_cancelled_read_are_read_next():
    import socket

    async def main() -> None:
        a, b = socket.socketpair()
        a.setblocking(False)
        stream = _SocketStream(a, asyncio.get_running_loop())
        try:
            task = asyncio.ensure_future(stream.read(100, 5))
            await asyncio.sleep(0)  # it waits for the socket
            assert stream._waiter is not None
            b.send(b"hi")
            stream._on_readable()  # the loop's callback: receives them for the read
            task.cancel()  # ... which is cancelled before it runs again
            with pytest.raises(asyncio.CancelledError):
                await task
            assert stream.get_extra_info("is_readable")
            assert await stream.read(100, 5) == b"hi"
            b.send(b"more")
            assert await stream.read(100, 5) == b"more"
        finally:
            await stream.aclose()
            b.close()

    asyncio.run(main())


@pytest.mark.parametrize("asynchronous", [False, True])
def test_no_daemon_leaves_no_socket_open(tmp_path, asynchronous):
    """A connect that fails closes its socket: httpcore's blocking backend left it open,
    a ResourceWarning for each call while no daemon answers, which a caller's
    ``PYTHONWARNINGS=error`` (or ``pytest -W error``) made an error."""
    import subprocess
    import sys

    sock = tmp_path / "none.sock"
    call = ("asyncio.run(corral.AsyncClient(URL).health())" if asynchronous
            else "corral.Client(URL).health()")
    code = f"""
import asyncio, gc, os, corral
os.environ["CORRAL_NO_EMBED"] = "1"
URL = "unix://{sock}"
for _ in range(3):
    try:
        {call}
    except corral.DaemonUnavailable:
        pass
gc.collect()
print("done")
"""
    r = subprocess.run([sys.executable, "-X", "dev", "-W", "error", "-c", code],
                       capture_output=True, text=True, timeout=120, check=False)
    assert r.returncode == 0 and r.stdout == "done\n", r.stderr[-2000:]
    assert "ResourceWarning" not in r.stderr, r.stderr[-2000:]
