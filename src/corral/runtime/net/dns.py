"""corral's resolver for sandboxes with a policy: it answers allowed names only.

Every DNS packet a policy sandbox sends (UDP or TCP port 53, to any address) is
redirected here by the host's nftables rules (:mod:`.netns`). A query for a name the
policy allows is resolved *on the host* (its resolver, or the daemon's ``hosts``
mapping) and answered with its IPv4 (A) or IPv6 (AAAA) addresses; any other name gets
NXDOMAIN and no packet leaves the host for it, so a sandbox cannot tunnel data out in
query names (beyond names under a ``*.domain`` it was allowed). Other types of an
allowed name get an empty answer.

Only the question section is parsed, with bounds; anything malformed is dropped.
"""

from __future__ import annotations

import asyncio
import ipaddress
import socket
import struct
from dataclasses import dataclass
from typing import Awaitable, Callable

from corral.runtime.net.proxy import peer_ip, reset, serve_both

QTYPE_A = 1
QTYPE_AAAA = 28
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
    """The reply: NXDOMAIN when ``addresses`` is None, else the A (AAAA) records of
    the IPv4 (IPv6) addresses for an A (AAAA) query."""
    flags = 0x8000 | 0x0400 | (0x0100 if q.rd else 0) | 0x0080  # QR, AA, RD, RA
    if addresses is None:
        return struct.pack("!6H", q.id, flags | RCODE_NXDOMAIN, 1, 0, 0, 0) + q.question
    records = b""
    six = q.qtype == QTYPE_AAAA
    ips = [ip for ip in addresses if (":" in ip) == six] if q.qtype in (QTYPE_A, QTYPE_AAAA) else []
    for ip in ips:
        raw = socket.inet_pton(socket.AF_INET6 if six else socket.AF_INET, ip)
        records += struct.pack("!HHHIH", 0xC00C, q.qtype, 1, TTL, len(raw)) + raw
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


def _canon(ip: str) -> str:
    """An address in its canonical text form (as a link's; a scoped one as it is)."""
    try:
        return str(ipaddress.ip_address(ip))
    except ValueError:
        return ip


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
        src = _canon(addr[0])
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
        src = _canon(addr[0])
        reply = formerr(data) if q is None else answer(q, await self.lookup(src, q))
        if reply is not None and self.transport is not None:
            self.transport.sendto(reply, addr)


class Resolver:
    """The UDP and TCP DNS server on ``port`` (0.0.0.0 and [::]; nftables lets only
    sandboxes in)."""

    def __init__(self, lookup: Lookup, admit: Admit | None = None) -> None:
        self.lookup = lookup
        self.admit = admit
        self.port = 0
        self._udp: asyncio.DatagramTransport | None = None
        self._udp6: asyncio.DatagramTransport | None = None
        self._tcp: list[asyncio.Server] = []

    async def start(self, *, ipv6: bool = False) -> None:
        loop = asyncio.get_running_loop()
        for _ in range(20):
            self._tcp, self.port = await serve_both(self._tcp_client, ipv6=ipv6)
            try:
                udp, _ = await loop.create_datagram_endpoint(
                    lambda: _Udp(self.lookup), local_addr=("0.0.0.0", self.port))
                self._udp = udp
                if ipv6:
                    six = socket.socket(socket.AF_INET6, socket.SOCK_DGRAM)
                    six.setsockopt(socket.IPPROTO_IPV6, socket.IPV6_V6ONLY, 1)
                    six.bind(("::", self.port))
                    self._udp6, _ = await loop.create_datagram_endpoint(
                        lambda: _Udp(self.lookup), sock=six)
            except OSError:
                self.close()
                continue
            return
        raise OSError("no port free for the resolver on both 0.0.0.0 and [::]")

    async def _tcp_client(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        peer = peer_ip(writer)
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
        for udp in (self._udp, self._udp6):
            if udp is not None:
                udp.close()
        self._udp = self._udp6 = None
        for server in self._tcp:
            server.close()
