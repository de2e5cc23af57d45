"""The SDK's lean HTTP/1.1 path on Unix sockets (``client/_wire.py``, ``_async/_lean.py``):
what it writes is what httpx would send (parsed by h11, as a server would), replies
split anywhere are parsed whole (length, chunked, to the end), broken replies are
``DaemonUnavailable``, connections are kept and replaced when the server closed them,
and what it cannot send exactly (streamed or large bodies, odd paths) goes to httpx.
Small real servers; no daemon, no root."""

from __future__ import annotations

import asyncio
import json
import threading

import h11
import httpx
import pytest

import corral
from corral.client._body import CHUNK_BYTES
from corral.client._wire import Encoder, Reply

HEADERS = httpx.Headers({"Authorization": "Bearer crl_x", "User-Agent": "corral-test"})
TIMEOUT = httpx.Timeout(5.0)


def _parse_as_server(data: bytes) -> tuple[h11.Request, bytes]:
    conn = h11.Connection(h11.SERVER)
    conn.receive_data(data)
    request, body = conn.next_event(), b""
    while True:
        event = conn.next_event()
        if isinstance(event, h11.Data):
            body += event.data
        elif isinstance(event, h11.EndOfMessage):
            return request, body
        else:
            raise AssertionError(f"incomplete request: {event!r}")


@pytest.mark.parametrize("method, path, kwargs", [
    ("GET", "/v1/health", {}),
    ("POST", "/v1/sandboxes/sb-1/exec", {"json": {"cmd": ["echo", "é ☃"], "env": None}}),
    ("POST", "/v1/pools/p/acquire", {"json": {"timeout": 30.0}, "timeout": httpx.Timeout(9)}),
    ("GET", "/v1/sandboxes", {"params": {"tag": ["a", "b"], "all": True, "none": None}}),
    ("PUT", "/v1/sandboxes/sb-1/files/etc%2Fx", {"content": b"\x00\xff" * 10}),
    ("PUT", "/v1/x", {"content": "text é", "headers": {"Content-Type": "text/plain"}}),
    ("DELETE", "/v1/sandboxes/sb-1", {}),
    ("POST", "/v1/empty", {}),
])
def test_it_writes_what_httpx_would_send(method, path, kwargs):
    lean = Encoder("http://corral", HEADERS, TIMEOUT).encode(method, path, kwargs)
    assert lean is not None
    got, body = _parse_as_server(lean.data)
    http = httpx.Client(base_url="http://corral", headers=HEADERS)
    want = http.build_request(method, path, **kwargs)
    assert got.method.decode() == want.method
    assert got.target == want.url.raw_path
    assert body == want.read()
    sent = {k.decode().lower(): v.decode() for k, v in got.headers}
    for name in ("host", "authorization", "user-agent", "content-type", "content-length"):
        assert sent.get(name) == want.headers.get(name), name
    if "json" in kwargs:
        assert json.loads(body) == kwargs["json"]
    assert lean.timeout == kwargs.get("timeout", TIMEOUT)


@pytest.mark.parametrize("path, kwargs", [
    ("/v1/x", {"content": iter([b"a", b"b"])}),  # a stream: sent in pieces by httpx
    ("/v1/x", {"content": b"x" * (CHUNK_BYTES + 1)}),  # over one piece (client/_body.py)
    ("/v1/x y", {}),  # percent-encoded by httpx
    ("/v1/é", {}),
    ("/v1/x?a=1", {"params": {"b": 2}}),  # a query to merge
    ("/v1/x", {"files": {"f": b"x"}}),  # multipart
    ("/v1/x", {"headers": {"X-Evil": "a\r\nInjected: 1"}}),  # httpx refuses it, loudly
    ("/v1/x", {"json": {"a": 1}, "content": b"x"}),
])
def test_what_it_cannot_send_exactly_goes_to_httpx(path, kwargs):
    assert Encoder("http://corral", HEADERS, TIMEOUT).encode("POST", path, kwargs) is None


def _feed_bytewise(method: str, raw: bytes) -> Reply:
    reply = Reply(method)
    for i in range(len(raw)):
        if reply.feed(raw[i:i + 1]):
            assert i == len(raw) - 1, "whole before its last byte"
            return reply
    reply.feed(b"")  # the end of the stream
    return reply


@pytest.mark.parametrize("raw, body, keep", [
    (b"HTTP/1.1 200 OK\r\ncontent-length: 5\r\n\r\nhello", b"hello", True),
    (b"HTTP/1.1 404 Not Found\r\ntransfer-encoding: chunked\r\n\r\n"
     b"5;ext=1\r\nhello\r\n6\r\n world\r\n0\r\nx-trailer: 1\r\n\r\n", b"hello world", True),
    (b"HTTP/1.1 200 OK\r\ncontent-length: 2\r\nconnection: close\r\n\r\nok", b"ok", False),
    (b"HTTP/1.1 200 OK\r\n\r\nto the end", b"to the end", False),
    (b"HTTP/1.1 204 No Content\r\n\r\n", b"", True),
])
def test_replies_split_anywhere_are_read_whole(raw, body, keep):
    reply = _feed_bytewise("GET", raw)
    lean = Encoder("http://corral", HEADERS, TIMEOUT).encode("GET", "/v1/x", {})
    response = reply.response(lean)
    assert response.content == body
    assert reply.keep_alive is keep
    assert response.request.url == "http://corral/v1/x"


@pytest.mark.parametrize("raw", [
    b"SSH-2.0-OpenSSH\r\n\r\n",
    b"HTTP/1.1 abc OK\r\n\r\n",
    b"HTTP/1.1 200 OK\r\nno colon here\r\n\r\n",
    b"HTTP/1.1 200 OK\r\ntransfer-encoding: chunked\r\n\r\nzz\r\n",
])
def test_a_reply_that_is_no_http_is_refused(raw):
    with pytest.raises(httpx.RemoteProtocolError):
        _feed_bytewise("GET", raw)


def test_a_reply_cut_short_is_refused():
    reply = Reply("GET")
    assert not reply.feed(b"HTTP/1.1 200 OK\r\ncontent-length: 10\r\n\r\nabc")
    with pytest.raises(httpx.RemoteProtocolError):
        reply.feed(b"")


class _Server:
    """A Unix-socket HTTP server in a thread: answers each request with its number and
    the number of its connection; ``close_after`` requests, it hangs up."""

    def __init__(self, path, *, close_after: int = 0, reply_close: bool = False) -> None:
        self.path, self.close_after, self.reply_close = str(path), close_after, reply_close
        self.connections = 0
        self.closed = threading.Semaphore(0)  # released as each connection ends
        self.requests: list[bytes] = []
        self._loop = asyncio.new_event_loop()
        ready = threading.Event()
        self._thread = threading.Thread(target=self._run, args=(ready,), daemon=True)
        self._thread.start()
        ready.wait(10)

    def _run(self, ready: threading.Event) -> None:
        asyncio.set_event_loop(self._loop)
        self._server = self._loop.run_until_complete(
            asyncio.start_unix_server(self._handle, path=self.path))
        ready.set()
        self._loop.run_forever()

    async def _handle(self, reader, writer) -> None:
        self.connections += 1
        conn, served = self.connections, 0
        while True:
            try:
                head = await reader.readuntil(b"\r\n\r\n")
            except (asyncio.IncompleteReadError, ConnectionError):
                break
            length = 0
            for line in head.split(b"\r\n"):
                if line.lower().startswith(b"content-length:"):
                    length = int(line.split(b":")[1])
            self.requests.append(head + await reader.readexactly(length))
            served += 1
            body = json.dumps({"n": len(self.requests), "conn": conn}).encode()
            close = b"connection: close\r\n" if self.reply_close else b""
            writer.write(b"HTTP/1.1 200 OK\r\ncontent-type: application/json\r\n%s"
                         b"content-length: %d\r\n\r\n%s" % (close, len(body), body))
            await writer.drain()
            if self.reply_close or (self.close_after and served >= self.close_after):
                break
        writer.close()
        await writer.wait_closed()
        self.closed.release()

    def stop(self) -> None:
        self._loop.call_soon_threadsafe(self._server.close)
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(10)


@pytest.mark.parametrize("close_after, reply_close, connections", [
    (0, False, 1),  # kept: one connection for every call
    (1, False, 3),  # the server closed it while idle: a new one, nothing lost
    (0, True, 3),  # "connection: close" replies: never reused
])
def test_connections_are_kept_and_replaced(tmp_path, close_after, reply_close, connections):
    server = _Server(tmp_path / "s.sock", close_after=close_after, reply_close=reply_close)
    try:
        with corral.Client(f"unix://{server.path}", token="crl_t") as client:
            client.reconnect_wait = 0
            seen = []
            for _ in range(3):
                seen.append(client.call("acquire_from_pool", {"name": "p"},
                                        json={"timeout": 1}).json())
                if close_after or reply_close:  # closed by the server before the next
                    assert server.closed.acquire(timeout=10)
        assert [s["n"] for s in seen] == [1, 2, 3]
        assert server.connections == connections
        assert all(b"authorization: Bearer crl_t" in r for r in server.requests)
        assert all(r.endswith(b'{"timeout":1}') for r in server.requests)

        async def main() -> list[dict[str, int]]:
            async with corral.AsyncClient(f"unix://{server.path}") as ac:
                out = []
                for _ in range(3):
                    out.append((await ac.call("acquire_from_pool", {"name": "p"}, json={})).json())
                    if close_after or reply_close:
                        assert server.closed.acquire(timeout=10)
                return out

        assert [s["n"] for s in asyncio.run(main())] == [4, 5, 6]
        assert server.connections == 2 * connections
    finally:
        server.stop()


def test_an_error_reply_names_its_request(tmp_path):
    async def refuse(reader, writer) -> None:
        await reader.readuntil(b"\r\n\r\n")
        writer.write(b"HTTP/1.1 502 Bad Gateway\r\ncontent-length: 4\r\n\r\noops")
        await writer.drain()
        writer.close()

    async def main() -> None:
        server = await asyncio.start_unix_server(refuse, path=str(tmp_path / "s.sock"))
        async with corral.AsyncClient(f"unix://{tmp_path / 's.sock'}") as client:
            with pytest.raises(corral.CorralError) as info:
                await client.call("health")
        server.close()
        assert "GET /v1/health: HTTP 502: oops" in str(info.value)

    asyncio.run(main())


def test_a_refusal_sent_before_the_body_was_read_is_what_the_caller_sees(tmp_path):
    """The daemon refuses a body it will not read (413) and hangs up: the write fails
    part-way, and the reply already sent is still read (as httpcore does)."""
    async def refuse(reader, writer) -> None:
        await reader.readuntil(b"\r\n\r\n")
        body = b'{"error": {"code": "file_too_large", "message": "too big", "details": {}}}'
        writer.write(b"HTTP/1.1 413 Content Too Large\r\nconnection: close\r\n"
                     b"content-type: application/json\r\ncontent-length: %d\r\n\r\n%s"
                     % (len(body), body))
        await writer.drain()
        writer.transport.abort()  # gone, the body unread

    async def main() -> None:
        server = await asyncio.start_unix_server(refuse, path=str(tmp_path / "s.sock"))
        async with corral.AsyncClient(f"unix://{tmp_path / 's.sock'}") as client:
            client.reconnect_wait = 0
            with pytest.raises(corral.CorralError) as info:
                await client.call("exec_command", {"sandbox_id": "sb-1"},
                                  content=b"x" * CHUNK_BYTES)
        server.close()
        assert isinstance(info.value, corral.FileTooLarge) or "too big" in str(info.value), info.value

    asyncio.run(main())
