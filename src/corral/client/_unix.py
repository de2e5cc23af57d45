"""The asyncio SDK's transport: httpx's, with Unix-socket streams driven by the event loop.

httpx's async transport reaches sockets through anyio, and each read or write pays for a
cancel scope, a deadline and a backend look-up (``sniffio``): the async SDK spent ~60% more
CPU per ``exec`` than the blocking one (``benchmarks/bench_cpu.py``). On a Unix socket —
the local daemon, the common case — :class:`AsyncDaemonTransport` reads and writes the
non-blocking socket directly and waits for it with ``loop.add_reader``/``add_writer``,
one timer per wait. TCP (and TLS) keep anyio's streams, as does any event loop that is
not asyncio's. :data:`DaemonTransport` is the blocking twin (``scripts/gen_sync.py``).
"""

from __future__ import annotations

import asyncio
import os
import socket
import struct
from collections.abc import Callable, Iterable
from typing import Any

import httpcore
import httpx
from httpcore._backends.anyio import AnyIOBackend
from httpcore._utils import is_socket_readable

_PEERCRED = struct.Struct("iII")  # struct ucred: pid, uid, gid


def check_peer(sock: socket.socket, path: str) -> None:
    """Refuse a Unix socket served by anyone but root or this process's own user, before
    a byte is sent: with no TLS, the socket is all that says who answers, and another
    user who put one at the path would be sent every request and trusted for every
    answer (tests/security/test_unix_socket_owner.py). The kernel names the process
    that listens (``SO_PEERCRED``); where it cannot (not Linux), nothing is checked."""
    try:
        raw = sock.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, _PEERCRED.size)
    except (AttributeError, OSError):
        return
    uid = _PEERCRED.unpack(raw)[1]
    if uid not in (0, os.geteuid()):
        raise httpcore.ConnectError(
            f"the Unix socket {path} is served by uid {uid}, neither root nor this user: "
            "another user may have put it there, so nothing was sent to it; use a socket "
            "in a directory only root or you can write (the default /run/corral/corral.sock)")


def _pool_options(uds: str, limits: httpx.Limits,
                  socket_options: Iterable[Any] | None) -> dict[str, Any]:
    """A Unix socket's connection pool: plain HTTP (no TLS context: loading the CA bundle
    took tens of ms per client, twice), httpx's limits."""
    return {"ssl_context": None, "max_connections": limits.max_connections,
            "max_keepalive_connections": limits.max_keepalive_connections,
            "keepalive_expiry": limits.keepalive_expiry, "uds": uds,
            "socket_options": socket_options}


class UnixBackend(httpcore.SyncBackend):
    """httpcore's blocking backend, with :func:`check_peer` on each Unix socket."""

    def connect_unix_socket(self, path: str, timeout: float | None = None,
                            socket_options: Iterable[Any] | None = None) -> httpcore.NetworkStream:
        stream = super().connect_unix_socket(path, timeout, socket_options)
        try:
            check_peer(stream.get_extra_info("socket"), path)
        except BaseException:
            stream.close()
            raise
        return stream


class DaemonTransport(httpx.HTTPTransport):
    """The blocking SDK's transport: httpx's own (its sync streams are already direct),
    without a TLS context on a Unix socket, and only to a daemon of root or this user
    there (:func:`check_peer`)."""

    def __init__(self, *, uds: str | None = None, limits: httpx.Limits,
                 socket_options: Iterable[Any] | None = None) -> None:
        super().__init__(uds=uds, limits=limits, socket_options=socket_options,
                         verify=uds is None)
        if uds is not None:
            self._pool = httpcore.ConnectionPool(network_backend=UnixBackend(),
                                                 **_pool_options(uds, limits, socket_options))


_Adder = Callable[..., Any]


def _wake(fut: asyncio.Future[None]) -> None:
    if not fut.done():
        fut.set_result(None)


def _expire(fut: asyncio.Future[None], exc: type[Exception]) -> None:
    if not fut.done():
        fut.set_exception(exc("timed out"))


class _SocketStream(httpcore.AsyncNetworkStream):
    """A connected non-blocking socket: try the syscall, wait for readiness only when
    it would block."""

    def __init__(self, sock: socket.socket, loop: asyncio.AbstractEventLoop) -> None:
        self._sock, self._loop, self._fd = sock, loop, sock.fileno()

    async def _ready(self, add: _Adder, remove: Callable[[int], object],
                     deadline: float | None, exc: type[Exception]) -> None:
        loop = self._loop
        fut: asyncio.Future[None] = loop.create_future()
        add(self._fd, _wake, fut)
        timer = None if deadline is None else loop.call_at(deadline, _expire, fut, exc)
        try:
            await fut
        finally:
            remove(self._fd)
            if timer is not None:
                timer.cancel()

    def _deadline(self, timeout: float | None) -> float | None:
        return None if timeout is None else self._loop.time() + timeout

    async def read(self, max_bytes: int, timeout: float | None = None) -> bytes:
        deadline = self._deadline(timeout)
        while True:
            try:
                return self._sock.recv(max_bytes)
            except (BlockingIOError, InterruptedError):
                pass
            except OSError as exc:
                raise httpcore.ReadError(str(exc)) from exc
            await self._ready(self._loop.add_reader, self._loop.remove_reader, deadline,
                              httpcore.ReadTimeout)

    async def write(self, buffer: bytes, timeout: float | None = None) -> None:
        view, deadline = memoryview(buffer), self._deadline(timeout)
        while view:
            try:
                view = view[self._sock.send(view):]
            except (BlockingIOError, InterruptedError):
                pass
            except OSError as exc:
                raise httpcore.WriteError(str(exc)) from exc
            if view:
                await self._ready(self._loop.add_writer, self._loop.remove_writer, deadline,
                                  httpcore.WriteTimeout)

    async def aclose(self) -> None:
        self._sock.close()

    async def start_tls(self, ssl_context: Any, server_hostname: str | None = None,
                        timeout: float | None = None) -> httpcore.AsyncNetworkStream:
        raise httpcore.ConnectError("TLS over a Unix socket is not supported")

    def get_extra_info(self, info: str) -> Any:
        if info == "socket":
            return self._sock
        if info == "is_readable":
            return is_socket_readable(self._sock)
        if info == "server_addr":
            return self._sock.getpeername()
        if info == "client_addr":
            return self._sock.getsockname()
        return None


class AsyncUnixBackend(AnyIOBackend):
    """anyio's backend, but Unix sockets under asyncio get a :class:`_SocketStream`."""

    async def connect_unix_socket(
        self, path: str, timeout: float | None = None,
        socket_options: Iterable[Any] | None = None,
    ) -> httpcore.AsyncNetworkStream:
        try:
            loop = asyncio.get_running_loop()
        except RuntimeError:  # another event loop (trio): anyio's streams
            stream = await super().connect_unix_socket(path, timeout, socket_options)
            try:
                check_peer(stream.get_extra_info("socket"), path)
            except BaseException:
                await stream.aclose()
                raise
            return stream
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        try:
            sock.setblocking(False)
            for option in socket_options or ():
                sock.setsockopt(*option)
            await asyncio.wait_for(loop.sock_connect(sock, path), timeout)
            check_peer(sock, path)
        except asyncio.TimeoutError as exc:
            sock.close()
            raise httpcore.ConnectTimeout(f"connecting to {path} timed out") from exc
        except OSError as exc:
            sock.close()
            raise httpcore.ConnectError(str(exc)) from exc
        except BaseException:
            sock.close()
            raise
        return _SocketStream(sock, loop)

    async def sleep(self, seconds: float) -> None:
        try:
            asyncio.get_running_loop()
        except RuntimeError:
            await super().sleep(seconds)
            return
        await asyncio.sleep(seconds)


class AsyncDaemonTransport(httpx.AsyncHTTPTransport):
    """:class:`httpx.AsyncHTTPTransport` whose Unix-socket connections skip anyio."""

    def __init__(self, *, uds: str | None = None, limits: httpx.Limits,
                 socket_options: Iterable[Any] | None = None) -> None:
        # a Unix socket speaks plain HTTP: no TLS context (loading the CA bundle took
        # tens of ms per client, twice)
        super().__init__(uds=uds, limits=limits, socket_options=socket_options,
                         verify=uds is None)
        if uds is not None:
            self._pool = httpcore.AsyncConnectionPool(network_backend=AsyncUnixBackend(),
                                                 **_pool_options(uds, limits, socket_options))
