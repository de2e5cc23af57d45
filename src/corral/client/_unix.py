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
from httpcore._backends.sync import SyncStream
from httpcore._utils import is_socket_readable

_PEERCRED = struct.Struct("iII")  # struct ucred: pid, uid, gid
_TIMEVAL = struct.Struct("ll")  # struct timeval: seconds, microseconds


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


class _BlockingStream(SyncStream):
    """httpcore's blocking stream on a socket that stays in blocking mode, its timeouts
    the kernel's (``SO_RCVTIMEO``/``SO_SNDTIMEO``, set only when they change): a call is
    one ``send`` and one ``recv``. httpcore's own set the socket's mode (``ioctl``) and
    polled before each of them: eight system calls a call instead of four."""

    def __init__(self, sock: socket.socket) -> None:
        super().__init__(sock)
        sock.settimeout(None)
        self._armed: dict[int, float | None] = {socket.SO_RCVTIMEO: None, socket.SO_SNDTIMEO: None}

    def _arm(self, which: int, timeout: float | None) -> None:
        if self._armed[which] != timeout:
            usec = 0 if timeout is None else max(1, round(timeout * 1e6))  # 0: none
            self._sock.setsockopt(socket.SOL_SOCKET, which, _TIMEVAL.pack(*divmod(usec, 1_000_000)))
            self._armed[which] = timeout

    def read(self, max_bytes: int, timeout: float | None = None) -> bytes:
        try:
            self._arm(socket.SO_RCVTIMEO, timeout)
            return self._sock.recv(max_bytes)
        except BlockingIOError as exc:  # EAGAIN: the kernel's timeout passed
            raise httpcore.ReadTimeout("timed out") from exc
        except OSError as exc:
            raise httpcore.ReadError(str(exc)) from exc

    def write(self, buffer: bytes, timeout: float | None = None) -> None:
        view = memoryview(buffer)
        try:
            self._arm(socket.SO_SNDTIMEO, timeout)
            while view:
                view = view[self._sock.send(view):]
        except BlockingIOError as exc:
            raise httpcore.WriteTimeout("timed out") from exc
        except OSError as exc:
            raise httpcore.WriteError(str(exc)) from exc


class UnixBackend(httpcore.SyncBackend):
    """httpcore's blocking backend, with :func:`check_peer` on each Unix socket, and
    :class:`_BlockingStream` for its streams."""

    def connect_unix_socket(self, path: str, timeout: float | None = None,
                            socket_options: Iterable[Any] | None = None) -> httpcore.NetworkStream:
        # connected here, not by httpcore's: that one leaves the socket of a failed
        # connect open (a ResourceWarning each time no daemon answers: an error where
        # warnings are, as under PYTHONWARNINGS=error or pytest -W error)
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        try:
            for option in socket_options or ():
                sock.setsockopt(*option)
            sock.settimeout(timeout)
            sock.connect(path)
            check_peer(sock, path)
        except TimeoutError as exc:
            sock.close()
            raise httpcore.ConnectTimeout(f"connecting to {path} timed out") from exc
        except OSError as exc:
            sock.close()
            raise httpcore.ConnectError(str(exc)) from exc
        except BaseException:
            sock.close()
            raise
        return _BlockingStream(sock)


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


def _expire(fut: asyncio.Future[Any], exc: type[Exception]) -> None:
    if not fut.done():
        fut.set_exception(exc("timed out"))


class _SocketStream(httpcore.AsyncNetworkStream):
    """A connected non-blocking socket: try the syscall, wait for readiness only when
    it would block.

    A read that must wait is finished by the event loop's callback, which receives the
    bytes itself (so the next turn's poll does not report them again), and the socket
    stays registered with the loop between reads: a call back to back costs no
    ``epoll_ctl`` (add and remove were two syscalls and ~20 us of the loop's Python per
    reply). Readiness with no read waiting (the daemon closed an idle connection, or
    bytes beyond a reply) unregisters it, so the loop never spins on it; the pool still
    checks an idle connection before use (``is_readable``)."""

    def __init__(self, sock: socket.socket, loop: asyncio.AbstractEventLoop) -> None:
        self._sock, self._loop, self._fd = sock, loop, sock.fileno()
        self._waiter: asyncio.Future[bytes] | None = None  # the read the callback ends
        self._want = 0
        self._reading = False  # registered with the loop's reader
        self._early: bytes | None = None  # received for a read that was cancelled
        self._asked = False  # a write just went out: its reply is not there yet

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

    def _on_readable(self) -> None:
        fut = self._waiter
        if fut is None or fut.done():  # nobody reads: stop watching until someone does
            self._loop.remove_reader(self._fd)
            self._reading = False
            return
        try:
            data = self._sock.recv(self._want)
        except (BlockingIOError, InterruptedError):
            return
        except OSError as exc:
            self._waiter = None
            fut.set_exception(httpcore.ReadError(str(exc)))
            return
        self._waiter = None
        fut.set_result(data)

    async def read(self, max_bytes: int, timeout: float | None = None) -> bytes:
        if self._early is not None:
            data, self._early = self._early, None
            return data
        if self._asked:  # the reply to what was just sent: ~never there yet, wait for it
            self._asked = False
        else:
            try:
                return self._sock.recv(max_bytes)
            except (BlockingIOError, InterruptedError):
                pass
            except OSError as exc:
                raise httpcore.ReadError(str(exc)) from exc
        loop = self._loop
        fut: asyncio.Future[bytes] = loop.create_future()
        self._waiter, self._want = fut, max_bytes
        if not self._reading:
            loop.add_reader(self._fd, self._on_readable)
            self._reading = True
        timer = None if timeout is None else loop.call_at(loop.time() + timeout, _expire, fut,
                                                          httpcore.ReadTimeout)
        try:
            return await fut
        except BaseException:
            if fut.done() and not fut.cancelled() and fut.exception() is None:
                self._early = fut.result()  # received, then cancelled: not lost
            raise
        finally:
            if self._waiter is fut:
                self._waiter = None
            if timer is not None:
                timer.cancel()

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
        self._asked = True

    async def aclose(self) -> None:
        if self._reading:
            self._reading = False
            self._loop.remove_reader(self._fd)
        self._sock.close()

    async def start_tls(self, ssl_context: Any, server_hostname: str | None = None,
                        timeout: float | None = None) -> httpcore.AsyncNetworkStream:
        raise httpcore.ConnectError("TLS over a Unix socket is not supported")

    def get_extra_info(self, info: str) -> Any:
        if info == "socket":
            return self._sock
        if info == "is_readable":
            return self._early is not None or is_socket_readable(self._sock)
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
