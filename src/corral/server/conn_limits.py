"""How many TCP connections the daemon holds, and for how long, before anyone proved who
they are.

A connection costs a file descriptor whether or not its requests ever authenticate, so
the bounds here apply from the moment a connection is accepted (in the protocol, before
any request reaches the app). A connection is *unauthenticated* until one of its
requests passes the guard (:func:`mark_authenticated`); the Unix socket is the trusted
owner and is never counted.

- **Total** (``--max-connections``; default: the daemon's open-file limit less a
  reserve, :func:`default_max_connections`): past it, the oldest idle unauthenticated
  connection is closed to make room; else, if authenticated connections hold more than
  half the limit, the oldest idle one of them (closing an idle keep-alive connection is
  harmless in HTTP); else the new connection is refused (a 503, closed at once: its
  descriptor is freed). So ``accept()`` never runs out of descriptors because of
  connections, strangers never push out a connection that authenticated, and a client
  with a token gets in while the others only hold idle sockets.
- **Per client address** (``--max-client-connections``): unauthenticated connections of
  one address beyond it make room the same way, among that address's own.
- **Idle time**: an unauthenticated connection is kept alive :data:`UNAUTH_KEEP_ALIVE_S`
  after its last reply (an authenticated one ``KEEP_ALIVE_S`` of the daemon); one that
  sends nothing is cut after the header timeout of :mod:`corral.server.limits`.

Refusals and evictions are counted, and logged at most once per :data:`LOG_EVERY_S`
(with the counts since), never once per connection.
"""

from __future__ import annotations

import ipaddress
import logging
import resource
import socket
import time
from collections import OrderedDict
from dataclasses import dataclass, field
from typing import Any

from starlette.types import Scope

from corral.errors import DaemonUnavailable
from corral.server.limits import BoundedHttpProtocol, raw_error

logger = logging.getLogger("corral.server")

CONN_KEY = "corral.connection"  # the connection's Connection, in every request's scope
UNAUTH_KEEP_ALIVE_S = 5.0
FD_RESERVE_MIN = 128  # descriptors kept for everything but connections (sandboxes, files)
FD_RESERVE_SHARE = 4  # ... or a quarter of the limit, whichever is more
DEFAULT_MAX_CONNECTIONS = 16384
LOG_EVERY_S = 10.0


def raise_open_file_limit() -> int:
    """Raise this process's soft RLIMIT_NOFILE to its hard limit; the soft limit now."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if hard == resource.RLIM_INFINITY or soft < hard:
        target = hard if hard != resource.RLIM_INFINITY else max(soft, 1 << 20)
        try:
            resource.setrlimit(resource.RLIMIT_NOFILE, (target, hard))
            soft = target
        except (ValueError, OSError):
            pass
    return soft


def _reserve(open_files: int) -> int:
    return max(FD_RESERVE_MIN, open_files // FD_RESERVE_SHARE)


def default_max_connections(open_files: int) -> int:
    """Connections the daemon may hold: its open-file limit less a reserve, at most
    :data:`DEFAULT_MAX_CONNECTIONS`."""
    if open_files == resource.RLIM_INFINITY:
        return DEFAULT_MAX_CONNECTIONS
    return max(16, min(DEFAULT_MAX_CONNECTIONS, open_files - _reserve(open_files)))


def accept_backlog(open_files: int, most: int) -> int:
    """The listen backlog, at most ``most``: asyncio accepts up to this many connections
    at once before any of them is counted, so it stays within half the reserve of
    descriptors (a burst of connections then never makes ``accept()`` fail)."""
    if open_files == resource.RLIM_INFINITY:
        return most
    return max(32, min(most, _reserve(open_files) // 2))


def client_key(address: str) -> str:
    """Who a TCP peer is to the per-address bounds (this book's, the auth throttle's):
    an IPv6 address by its /64 (whoever holds one picks from 2^64 source addresses),
    an IPv4-mapped one by its IPv4 address, anything else as it is."""
    try:
        ip = ipaddress.ip_address(address.split("%", 1)[0])
    except ValueError:
        return address
    if isinstance(ip, ipaddress.IPv6Address):
        if ip.ipv4_mapped is not None:
            return str(ip.ipv4_mapped)
        return str(ipaddress.IPv6Network((ip, 64), strict=False))
    return str(ip)


@dataclass(eq=False)
class Connection:
    """One TCP connection as the book sees it."""

    client: str
    close: Any  # closes the connection now
    cost: int = 1  # descriptors it holds (a relayed gRPC connection: 3)
    authenticated: bool = False
    busy: int = 0  # requests of it being served
    last: float = field(default_factory=time.monotonic)


def mark_authenticated(scope: Scope) -> None:
    """The guard let a request of this connection in: it is authenticated from now on
    (no-op on the Unix socket and in apps run without the book)."""
    conn = scope.get(CONN_KEY)
    if isinstance(conn, Connection) and not conn.authenticated:
        conn.authenticated = True
        book = scope.get(BOOK_KEY)
        if isinstance(book, ConnectionBook):
            book.promote(conn)


BOOK_KEY = "corral.connections"


class ConnectionBook:
    """Every TCP connection of one daemon (see the module docstring)."""

    def __init__(self, max_connections: int, max_client_connections: int) -> None:
        self.max_connections = max_connections
        self.max_client_connections = max_client_connections
        self._unauth: OrderedDict[Connection, None] = OrderedDict()  # oldest activity first
        self._auth: OrderedDict[Connection, None] = OrderedDict()
        self._per_client: dict[str, int] = {}  # unauthenticated ones, by address
        self._cost = {False: 0, True: 0}  # descriptors held, by authenticated or not
        self.refused = 0
        self.evicted = 0
        self._logged = (0, 0)
        self._logged_at = -LOG_EVERY_S

    def __len__(self) -> int:
        return len(self._unauth) + len(self._auth)

    def unauthenticated(self, client: str | None = None) -> int:
        return len(self._unauth) if client is None else self._per_client.get(client, 0)

    def admit(self, conn: Connection) -> bool:
        """Count ``conn`` in, closing idle ones to make room; False: refuse it. The
        total bounds descriptors: each connection counts its ``cost``."""
        if self._per_client.get(conn.client, 0) >= self.max_client_connections and not (
            self._evict(self._unauth, conn.client)
        ):
            return self._refuse()
        while sum(self._cost.values()) + conn.cost > self.max_connections:
            if not (self._evict(self._unauth) or (
                    self._cost[True] > self.max_connections // 2 and self._evict(self._auth))):
                return self._refuse()
        self._unauth[conn] = None
        self._cost[False] += conn.cost
        self._per_client[conn.client] = self._per_client.get(conn.client, 0) + 1
        return True

    def remove(self, conn: Connection) -> None:
        if self._auth.pop(conn, False) is None:
            self._cost[True] -= conn.cost
            return
        if self._unauth.pop(conn, False) is None:
            self._cost[False] -= conn.cost
            self._uncount(conn.client)

    def promote(self, conn: Connection) -> None:
        if self._unauth.pop(conn, False) is None:
            self._uncount(conn.client)
            self._cost[False] -= conn.cost
            self._cost[True] += conn.cost
            self._auth[conn] = None

    def touch(self, conn: Connection) -> None:
        """``conn`` was just active: the last to be evicted."""
        conn.last = time.monotonic()
        for table in (self._auth, self._unauth):
            if conn in table:
                table.move_to_end(conn)

    def _uncount(self, client: str) -> None:
        left = self._per_client.get(client, 0) - 1
        if left > 0:
            self._per_client[client] = left
        else:
            self._per_client.pop(client, None)

    def _evict(self, table: OrderedDict[Connection, None], client: str | None = None) -> bool:
        for victim in table:
            if not victim.busy and (client is None or victim.client == client):
                self.remove(victim)
                victim.close()
                self.evicted += 1
                self._log()
                return True
        return False

    def _refuse(self) -> bool:
        self.refused += 1
        self._log()
        return False

    def _log(self) -> None:
        now = time.monotonic()
        if now - self._logged_at < LOG_EVERY_S:
            return
        refused, evicted = self.refused - self._logged[0], self.evicted - self._logged[1]
        logger.warning(
            "connection limits: %d connections refused and %d idle ones closed in the last "
            "%g s (%d held, %d unauthenticated; --max-connections %d, "
            "--max-client-connections %d)", refused, evicted, LOG_EVERY_S, len(self),
            len(self._unauth), self.max_connections, self.max_client_connections)
        self._logged, self._logged_at = (self.refused, self.evicted), now


_FULL = raw_error(DaemonUnavailable(
    "the daemon holds as many connections as it may (--max-connections): retry shortly"
))


class GuardedHttpProtocol(BoundedHttpProtocol):
    """:class:`~corral.server.limits.BoundedHttpProtocol` counted in a
    :class:`ConnectionBook` (the class :func:`protocol_for` makes carries the book)."""

    book: ConnectionBook
    authenticated_keep_alive: float = 300.0
    _conn: Connection | None = None

    def connection_made(self, transport: Any) -> None:  # type: ignore[override]
        sock = transport.get_extra_info("socket")
        if sock is None or sock.family not in (socket.AF_INET, socket.AF_INET6):
            super().connection_made(transport)
            return  # the Unix socket: its owner, uncounted
        peer = transport.get_extra_info("peername")
        conn = Connection(client_key(str(peer[0])) if peer else "?", transport.close)
        if not self.book.admit(conn):
            transport.write(_FULL)
            transport.close()  # at once: the descriptor is what is short
            return
        self._conn = conn
        super().connection_made(transport)

    def connection_lost(self, exc: Exception | None) -> None:
        if self._conn is not None:
            self.book.remove(self._conn)
        if getattr(self, "transport", None) is not None:
            super().connection_lost(exc)

    def data_received(self, data: bytes) -> None:
        if self._conn is not None:
            self.book.touch(self._conn)
        super().data_received(data)

    def handle_websocket_upgrade(self) -> None:
        # The WebSocket protocol takes the transport (and its connection_lost) from here:
        # the book lets go of it now (only an exposed port's survives the guard).
        if self._conn is not None:
            self.book.remove(self._conn)
            self._conn = None
        super().handle_websocket_upgrade()

    def on_message_begin(self) -> None:
        super().on_message_begin()
        if self._conn is not None:
            self.scope[CONN_KEY] = self._conn  # type: ignore[typeddict-unknown-key]
            self.scope[BOOK_KEY] = self.book  # type: ignore[typeddict-unknown-key]

    def on_headers_complete(self) -> None:
        if self._conn is not None:
            self._conn.busy += 1
        super().on_headers_complete()

    def on_response_complete(self) -> None:
        conn = self._conn
        if conn is not None:
            conn.busy = max(0, conn.busy - 1)
            self.book.touch(conn)
            self.timeout_keep_alive = (self.authenticated_keep_alive if conn.authenticated
                                       else UNAUTH_KEEP_ALIVE_S)
        super().on_response_complete()


def protocol_for(book: ConnectionBook, keep_alive: float,
                 write_stall: float | None = None,
                 write_min_rate: float = 0.0) -> type[GuardedHttpProtocol]:
    """uvicorn's ``http`` protocol class for one daemon, counting into ``book``;
    authenticated connections are kept alive ``keep_alive`` seconds when idle, and
    closed after ``write_stall`` seconds of a reply their client reads none of, or less
    than ``write_min_rate`` bytes a second of (None: never)."""
    return type("GuardedHttpProtocol", (GuardedHttpProtocol,),
                {"book": book, "authenticated_keep_alive": keep_alive,
                 "write_stall": write_stall, "write_min_rate": write_min_rate})
