"""The cwsandbox port's edge: its TCP connections counted and bounded like the HTTP API's.

gRPC's C core accepts its own connections and offers no hook per connection (no cap in
total, none per address, one idle timeout for everyone), so the daemon does not let it
listen on the network. :class:`GrpcEdge` listens on the public ``--grpc`` address
instead and relays each connection, byte for byte, to the gRPC server on a Unix socket
in a private directory (mode 0700). Every connection is counted from accept in the
daemon's one :class:`~corral.server.conn_limits.ConnectionBook` (shared with the HTTP
listener, since both spend the same descriptors), so the same rules hold:

- past ``--max-connections`` the oldest idle unauthenticated connection is closed to
  make room (else an idle authenticated one, else the new one is refused); a relayed
  connection counts three (it holds three descriptors: the client's, the relay's to
  the Unix socket, and gRPC's end of it), since the total bounds descriptors;
- past ``--max-client-connections`` unauthenticated connections of one address (an
  IPv6 one by its /64), that address's oldest idle one is closed;
- a connection none of whose calls passed the door within :data:`UNAUTH_LIFETIME_S`
  of its accept is closed.

Each relayed connection reaches the gRPC server from an abstract Unix address of its
own, so the guard (:mod:`corral.server.compat.cwsandbox_guard`) maps a call's peer back
to its :class:`~corral.server.conn_limits.Connection`: the client's real address (for
the per-address call cap and the failed-auth throttle) and the book entry its first
authenticated call promotes. A call whose peer is not a relayed connection (someone
who reached the private socket some other way) is refused.
"""

from __future__ import annotations

import asyncio
import logging
import os
import secrets
import shutil
import socket
import tempfile
from typing import Any

from corral.server.conn_limits import Connection, ConnectionBook, client_key

__all__ = ["GrpcEdge", "UNAUTH_LIFETIME_S", "cut_if_unread"]

logger = logging.getLogger("corral.server")

UNAUTH_LIFETIME_S = 10.0  # a connection with no authenticated call is closed after this
COST = 3  # descriptors a relayed connection holds: the client's, the relay's, gRPC's
PEER_PREFIX = "unix-abstract:"  # how gRPC names a peer bound to an abstract address


class _Pipe(asyncio.Protocol):
    """One side of a relayed connection: what it reads is written to the other side,
    and a side whose writes back up stops the other from reading."""

    def __init__(self, edge: GrpcEdge | None = None) -> None:
        self.edge = edge  # set on the client's side only
        self.transport: asyncio.Transport | None = None
        self.other: _Pipe | None = None
        self.conn: Connection | None = None
        self.name = ""
        self._early: list[bytes] = []  # what the client sent before the backend answered
        self._eof = False

    def connection_made(self, transport: Any) -> None:
        self.transport = transport
        if self.edge is not None:
            self.edge._accepted(self)

    def data_received(self, data: bytes) -> None:
        if self.conn is not None and self.edge is not None:
            self.edge.book.touch(self.conn)
        other = self.other
        if other is None or other.transport is None:
            # Not joined yet. Either side can get here: uvloop reads a new connection
            # (the client's despite pause_reading in connection_made, the backend's
            # SETTINGS frame) before the coroutine that joins them resumes. Keep it for
            # joined() and read no more until then.
            self._early.append(data)
            if self.transport is not None:
                self.transport.pause_reading()
        else:
            other.transport.write(data)

    def eof_received(self) -> bool:
        other = self.other
        if other is None or other.transport is None:
            self._eof = True
        elif other.transport.can_write_eof():
            other.transport.write_eof()
        return True  # keep our half open: the other side may still answer

    def joined(self, other: _Pipe) -> None:
        """``other`` (the backend's side) is connected: pass on what waited, both ways,
        and let both sides read."""
        self.other, other.other = other, self
        for src, dst in ((self, other), (other, self)):
            assert dst.transport is not None
            for data in src._early:
                dst.transport.write(data)
            src._early.clear()
            if src._eof and dst.transport.can_write_eof():
                dst.transport.write_eof()
        for side in (self, other):
            assert side.transport is not None
            if not side.transport.is_closing():
                side.transport.resume_reading()

    def connection_lost(self, exc: Exception | None) -> None:
        if self.edge is not None:
            self.edge._lost(self)
        other = self.other
        if other is not None and other.transport is not None:
            other.transport.close()

    def close(self) -> None:
        if self.transport is not None:
            self.transport.abort()

    def pause_writing(self) -> None:
        if self.other is not None and self.other.transport is not None:
            self.other.transport.pause_reading()

    def resume_writing(self) -> None:
        if self.other is not None and self.other.transport is not None:
            self.other.transport.resume_reading()


class GrpcEdge:
    """The public listener of the cwsandbox port (see the module docstring)."""

    def __init__(self, book: ConnectionBook, lifetime: float = UNAUTH_LIFETIME_S) -> None:
        self.book = book
        self.lifetime = lifetime
        self._dir: str | None = None  # made when the server is bound (backend_address)
        self._by_name: dict[str, Connection] = {}
        self._server: asyncio.AbstractServer | None = None

    @property
    def backend(self) -> str:
        """Where the gRPC server listens: a Unix socket in a private directory."""
        if self._dir is None:
            self._dir = tempfile.mkdtemp(prefix="corral-grpc-")  # 0700: the daemon's only
        return os.path.join(self._dir, "grpc.sock")

    @property
    def backend_address(self) -> str:
        return "unix:" + self.backend

    async def listen(self, host: str, port: int) -> int:
        """Accept connections on ``host:port``; the port (useful when it was 0)."""
        loop = asyncio.get_running_loop()
        family = socket.AF_INET6 if ":" in host else socket.AF_INET
        self._server = await loop.create_server(
            lambda: _Pipe(self), host, port, family=family, reuse_port=False)
        return int(self._server.sockets[0].getsockname()[1])

    def connection_of(self, peer: str) -> Connection | None:
        """The relayed connection a gRPC call's ``context.peer()`` is; None if it is not one."""
        if not peer.startswith(PEER_PREFIX):
            return None
        return self._by_name.get(peer[len(PEER_PREFIX):])

    def stop_accepting(self) -> None:
        """No new connections (those relayed go on until the gRPC server ends them)."""
        if self._server is not None:
            self._server.close()

    async def close(self) -> None:
        """Close every relayed connection left, and the private directory."""
        if self._server is not None:
            self._server.close()
            for conn in list(self._by_name.values()):
                conn.close()
            await self._server.wait_closed()
            self._server = None
        if self._dir is not None:
            shutil.rmtree(self._dir, ignore_errors=True)

    # ------------------------------------------------------------------ relay

    def _accepted(self, front: _Pipe) -> None:
        assert front.transport is not None
        peer = front.transport.get_extra_info("peername")
        conn = Connection(client_key(str(peer[0])) if peer else "?", front.close, COST)
        if not self.book.admit(conn):
            front.transport.abort()  # at once: the descriptor is what is short
            return
        front.conn = conn
        # random, not a counter: abstract names are listed in /proc/net/unix, and a
        # local user who could tell the next one would bind it first (no connection)
        front.name = f"corral-grpc-{secrets.token_hex(12)}"
        self._by_name[front.name] = conn
        front.transport.pause_reading()  # until the backend is there to take it
        loop = asyncio.get_running_loop()
        loop.call_later(self.lifetime, self._expire, front)
        loop.create_task(self._join(front))

    async def _join(self, front: _Pipe) -> None:
        loop = asyncio.get_running_loop()
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        try:
            sock.bind(b"\0" + front.name.encode())  # the call's peer, as gRPC reports it
            sock.setblocking(False)
            await loop.sock_connect(sock, self.backend)
            _, back = await loop.create_unix_connection(_Pipe, sock=sock)
        except OSError:
            sock.close()
            front.close()
            return
        if front.transport is None or front.transport.is_closing():
            assert back.transport is not None
            back.transport.close()
            return
        front.joined(back)

    def _expire(self, front: _Pipe) -> None:
        conn = front.conn
        if conn is not None and not conn.authenticated and front.name in self._by_name:
            front.close()

    def _lost(self, front: _Pipe) -> None:
        if front.conn is not None:
            self.book.remove(front.conn)
            self._by_name.pop(front.name, None)


def cut_if_unread(conn: Connection | None, context: Any, nbytes: int, seconds: float,
                  min_rate: float) -> None:
    """A unary reply of ``nbytes`` just handed to gRPC, whose call holds what it costs
    (its room in the output budget) until it ends: if the call has not ended within
    ``seconds + nbytes / min_rate`` (``--write-stall-timeout``, ``--write-min-rate``),
    its relayed connection ``conn`` is closed, so the call ends and what it held goes
    back. gRPC tells nothing of what a client read, and HTTP/2 lets a client read its
    TCP connection and still take none of a reply (a stream window of 0): so the bound
    is the time a client at the minimum rate would take (``min_rate`` 0: none)."""
    if conn is None or min_rate <= 0:
        return
    timer = asyncio.get_running_loop().call_later(
        seconds + nbytes / min_rate, _cut_unread, conn, nbytes, seconds + nbytes / min_rate)
    context.add_done_callback(lambda _: timer.cancel())


def _cut_unread(conn: Connection, nbytes: int, waited: float) -> None:
    logger.info("closed a gRPC connection from %s: a reply of %d bytes was not taken in "
                "%.0f s (--write-stall-timeout, --write-min-rate)", conn.client, nbytes, waited)
    conn.close()
