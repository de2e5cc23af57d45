"""corral's resolver for sandboxes with a policy: it answers allowed names only.

Every DNS packet a policy sandbox sends (UDP or TCP port 53, to any address) is
redirected here by the host's nftables rules (:mod:`.netns`). A query for a name the
policy allows is resolved *on the host* (its resolver, or the daemon's ``hosts``
mapping) and answered with its IPv4 addresses; any other name gets NXDOMAIN and no
packet leaves the host for it, so a sandbox cannot tunnel data out in query names
(beyond names under a ``*.domain`` it was allowed). AAAA and other types of an
allowed name get an empty answer (a policy sandbox has no IPv6 route).

Only the question section is parsed, with bounds; anything malformed is dropped.
"""

from __future__ import annotations

import asyncio
import socket
import struct
from dataclasses import dataclass
from typing import Awaitable, Callable

from corral.runtime.net.proxy import reset

QTYPE_A = 1
RCODE_NXDOMAIN = 3
RCODE_FORMERR = 1
MAX_QUERY = 512
TTL = 30
MAX_IN_FLIGHT = 64  # queries being answered at once, per source address (a sandbox)
MAX_TASKS = 4096  # and in all


@dataclass(frozen=True)
class Query:
    id: int
    name: str
    qtype: int
    question: bytes  # the raw question section (echoed in the answer)
    rd: bool


def parse_query(data: bytes) -> Query | None:
    """The one question of a standard query, or None (malformed or not a query)."""
    if len(data) < 12 or len(data) > MAX_QUERY:
        return None
    qid, flags, qd, an, ns, _ar = struct.unpack("!6H", data[:12])
    if flags & 0x8000 or (flags >> 11) & 0xF != 0 or qd != 1 or an or ns:
        return None
    labels, i = [], 12
    while True:
        if i >= len(data):
            return None
        n = data[i]
        i += 1
        if n == 0:
            break
        if n > 63 or i + n > len(data):  # compression pointers are not valid here
            return None
        labels.append(data[i:i + n])
        i += n
    if i + 4 > len(data):
        return None
    qtype, _qclass = struct.unpack("!2H", data[i:i + 4])
    try:
        name = b".".join(labels).decode("ascii").lower()
    except UnicodeDecodeError:
        return None
    if len(name) > 253:
        return None
    return Query(qid, name, qtype, data[12:i + 4], bool(flags & 0x0100))


def answer(q: Query, addresses: list[str] | None) -> bytes:
    """The reply: NXDOMAIN when ``addresses`` is None, else A records (for an A query)."""
    flags = 0x8000 | 0x0400 | (0x0100 if q.rd else 0) | 0x0080  # QR, AA, RD, RA
    if addresses is None:
        return struct.pack("!6H", q.id, flags | RCODE_NXDOMAIN, 1, 0, 0, 0) + q.question
    records = b""
    ips = addresses if q.qtype == QTYPE_A else []
    for ip in ips:
        records += struct.pack("!HHHIH", 0xC00C, QTYPE_A, 1, TTL, 4) + socket.inet_aton(ip)
    return struct.pack("!6H", q.id, flags, 1, len(ips), 0, 0) + q.question + records


def formerr(data: bytes) -> bytes | None:
    if len(data) < 12:
        return None
    return data[:2] + struct.pack("!5H", 0x8000 | RCODE_FORMERR, 0, 0, 0, 0)


# (source address, query) -> addresses to answer, or None for NXDOMAIN
Lookup = Callable[[str, Query], Awaitable[list[str] | None]]
# a TCP connection from a source address: a function to call when it ends, or None
# (refused: an unknown source, or one with too many connections open already)
Admit = Callable[[str], "Callable[[], None] | None"]


class _Udp(asyncio.DatagramProtocol):
    def __init__(self, lookup: Lookup) -> None:
        self.lookup = lookup
        self.transport: asyncio.DatagramTransport | None = None
        self.tasks: set[asyncio.Task[None]] = set()
        self.per_src: dict[str, int] = {}

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport  # type: ignore[assignment]

    def datagram_received(self, data: bytes, addr: tuple[str, int]) -> None:
        # a flood is dropped (the sandbox retries), per source: one sandbox's flood
        # leaves the others' queries answered
        src = addr[0]
        if self.per_src.get(src, 0) >= MAX_IN_FLIGHT or len(self.tasks) >= MAX_TASKS:
            return
        self.per_src[src] = self.per_src.get(src, 0) + 1
        task = asyncio.get_running_loop().create_task(self._reply(data, addr))
        self.tasks.add(task)

        def done(t: asyncio.Task[None]) -> None:
            self.tasks.discard(t)
            left = self.per_src.pop(src, 1) - 1
            if left:
                self.per_src[src] = left
        task.add_done_callback(done)

    async def _reply(self, data: bytes, addr: tuple[str, int]) -> None:
        q = parse_query(data)
        reply = formerr(data) if q is None else answer(q, await self.lookup(addr[0], q))
        if reply is not None and self.transport is not None:
            self.transport.sendto(reply, addr)


class Resolver:
    """The UDP and TCP DNS server on ``port`` (0.0.0.0; nftables lets only sandboxes in)."""

    def __init__(self, lookup: Lookup, admit: Admit | None = None) -> None:
        self.lookup = lookup
        self.admit = admit
        self.port = 0
        self._udp: asyncio.DatagramTransport | None = None
        self._tcp: asyncio.Server | None = None

    async def start(self) -> None:
        loop = asyncio.get_running_loop()
        tcp = await asyncio.start_server(self._tcp_client, "0.0.0.0", 0)
        self.port = tcp.sockets[0].getsockname()[1]
        self._tcp = tcp
        udp, _ = await loop.create_datagram_endpoint(
            lambda: _Udp(self.lookup), local_addr=("0.0.0.0", self.port))
        self._udp = udp

    async def _tcp_client(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        peer = writer.get_extra_info("peername")[0]
        # each connection holds a descriptor for up to 10 s: counted against the
        # sandbox's open connections, as the proxy's are
        done = self.admit(peer) if self.admit is not None else (lambda: None)
        if done is None:
            reset(writer)
            return
        try:
            async with asyncio.timeout(10):
                n = struct.unpack("!H", await reader.readexactly(2))[0]
                data = await reader.readexactly(min(n, MAX_QUERY + 1))
            q = parse_query(data)
            reply = formerr(data) if q is None else answer(q, await self.lookup(peer, q))
            if reply:
                writer.write(struct.pack("!H", len(reply)) + reply)
                await writer.drain()
        except (OSError, asyncio.IncompleteReadError, TimeoutError):
            pass
        finally:
            done()
            writer.close()

    def close(self) -> None:
        if self._udp is not None:
            self._udp.close()
        if self._tcp is not None:
            self._tcp.close()
