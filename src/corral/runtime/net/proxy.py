"""The userspace TCP proxy every connection of a policy sandbox goes through.

nftables redirects each TCP connection a policy sandbox opens to :class:`Proxy`
(:mod:`.netns`); the proxy reads where it was going (``SO_ORIGINAL_DST``) and who
opened it (the source address names the sandbox's link). On ports 80 and 443 it
reads the request's ``Host`` or the TLS SNI (:mod:`.sniff`) and, when the name is
allowed, resolves it *on the host* and dials that name's address itself: whatever
the sandbox's ``/etc/hosts`` or resolver said, an allowed name reaches only that
name's server. Other ports are judged by the destination address. A refusal is a
TCP reset at once, recorded with the sandbox's network events. TLS is never
terminated: bytes pass through unchanged. Allowed connections go through the host's
proxy (``HTTPS_PROXY``, ``HTTP_PROXY`` for port 80, ``NO_PROXY``; a plain-HTTP proxy,
by CONNECT) when one is set, asked for the address judged (``CONNECT ip:port``), never
for the name: the proxy would resolve it again, and a name whose answer changes
between the two lookups (DNS rebinding) would reach whatever the second one says, the
proxy's own loopback or the cloud's metadata address included. Only a name the host
cannot resolve at all is handed to that proxy by name: there the proxy's resolution
is the only one, and the proxy must refuse private, loopback and link-local
destinations itself (docs/network.md).
"""

from __future__ import annotations

import asyncio
import ipaddress
import socket
import struct
import urllib.request
from dataclasses import dataclass, field
from typing import Awaitable, Callable
from urllib.parse import urlsplit

from corral.runtime.net.sniff import MAX_PEEK, MORE, requested_name

SO_ORIGINAL_DST = 80
NAME_PORTS = (80, 443)
PEEK_TIMEOUT_S = 10.0
DIAL_TIMEOUT_S = 10.0
CHUNK = 1 << 16


@dataclass(eq=False)
class Conn:
    """A connection being relayed: what it was allowed as, and its two ends."""

    name: str | None
    ip: str
    port: int
    ends: list[asyncio.StreamWriter] = field(default_factory=list)

    def cut(self) -> None:
        for w in self.ends:
            reset(w)


def reset(writer: asyncio.StreamWriter) -> None:
    """Close with a TCP reset (SO_LINGER 0): the other side fails at once."""
    sock = writer.get_extra_info("socket")
    if sock is not None:
        try:
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
        except OSError:
            pass
    writer.transport.abort()


def original_dst(writer: asyncio.StreamWriter) -> tuple[str, int]:
    sock = writer.get_extra_info("socket")
    if sock.family == socket.AF_INET6:  # IP6T_SO_ORIGINAL_DST: a sockaddr_in6
        raw = sock.getsockopt(socket.IPPROTO_IPV6, SO_ORIGINAL_DST, 28)
        return socket.inet_ntop(socket.AF_INET6, raw[8:24]), struct.unpack("!H", raw[2:4])[0]
    raw = sock.getsockopt(socket.IPPROTO_IP, SO_ORIGINAL_DST, 16)
    port = struct.unpack("!H", raw[2:4])[0]
    return socket.inet_ntoa(raw[4:8]), port


def peer_ip(writer: asyncio.StreamWriter) -> str:
    """The connection's source address, in its one canonical text form (a link's)."""
    return str(ipaddress.ip_address(writer.get_extra_info("peername")[0]))


async def serve_both(client: Callable[[asyncio.StreamReader, asyncio.StreamWriter],
                                      Awaitable[None]], *, ipv6: bool,
                     backlog: int = 100) -> tuple[list[asyncio.Server], int]:
    """TCP servers on 0.0.0.0 and (``ipv6``) [::] sharing one port, which nftables
    redirects to for both families."""
    for _ in range(20):
        v4 = await asyncio.start_server(client, "0.0.0.0", 0, backlog=backlog)
        port = v4.sockets[0].getsockname()[1]
        if not ipv6:
            return [v4], port
        try:  # asyncio makes a [::] socket IPv6-only
            v6 = await asyncio.start_server(client, "::", port, backlog=backlog)
        except OSError:
            v4.close()
            continue
        return [v4, v6], port
    raise OSError("no port free on both 0.0.0.0 and [::]")


# Decides a connection: (source ip, name or None, destination ip, port) ->
# the address to dial (None: refused) and the Conn's registry (or None).
Decide = Callable[[str, "str | None", str, int], Awaitable["tuple[str | None, set[Conn] | None]"]]


# Admits a new connection from a source address: a function to call when it ends, or
# None (refused: an unknown source, or one with too many connections open already).
Admit = Callable[[str], "Callable[[], None] | None"]


class Proxy:
    """Listens on 0.0.0.0:``port`` and [::]:``port`` (nftables admits only the engine's
    links)."""

    def __init__(self, decide: Decide, admit: Admit) -> None:
        self.decide = decide
        self.admit = admit
        # the host's HTTP(S)_PROXY / NO_PROXY, read when the filter is made
        self.proxies = urllib.request.getproxies_environment()
        self.port = 0
        self._servers: list[asyncio.Server] = []

    async def start(self, *, ipv6: bool = False) -> None:
        self._servers, self.port = await serve_both(self._client, ipv6=ipv6, backlog=1024)

    def close(self) -> None:
        for server in self._servers:
            server.close()

    async def _client(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        # counted from the accept, not from the verdict: connections that never send a
        # name (held open on port 80) count against the sandbox's cap too
        done = self.admit(peer_ip(writer))
        if done is None:
            reset(writer)
            return
        try:
            await self._relay(reader, writer)
        except (OSError, asyncio.IncompleteReadError, TimeoutError):
            reset(writer)
        finally:
            done()

    async def _relay(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        src = peer_ip(writer)
        ip, port = original_dst(writer)
        head, name = b"", None
        if port in NAME_PORTS:
            async with asyncio.timeout(PEEK_TIMEOUT_S):
                found: object = MORE
                while found is MORE and len(head) < MAX_PEEK:
                    chunk = await reader.read(MAX_PEEK - len(head))
                    if not chunk:
                        break
                    head += chunk
                    found = requested_name(head)
            name = found if isinstance(found, str) else None
            if name is not None and _is_ip(name):
                name = None  # Host: 1.2.3.4 is an address, judged as one
        target, conns = await self.decide(src, name, ip, port)
        if target is None or conns is None:
            reset(writer)
            return
        async with asyncio.timeout(DIAL_TIMEOUT_S):
            up_reader, up_writer = await self._dial(target, port, name)
        conn = Conn(name, target, port, [writer, up_writer])
        conns.add(conn)
        try:
            if head:
                up_writer.write(head)
            await asyncio.gather(_pipe(reader, up_writer), _pipe(up_reader, writer))
        finally:
            conns.discard(conn)
            up_writer.close()
            writer.close()


    async def _dial(self, target: str, port: int, name: str | None = None
                    ) -> tuple[asyncio.StreamReader, asyncio.StreamWriter]:
        """Open ``target``:``port`` (the address judged, or a name only when the host's
        proxy alone resolves it), through the host's HTTP(S) proxy when one applies to
        ``name`` (or ``target``) by ``NO_PROXY`` (CONNECT ``target``)."""
        upstream = upstream_proxy(self.proxies, name or target, port)
        if upstream is None:
            return await asyncio.open_connection(target, port)
        reader, writer = await asyncio.open_connection(*upstream)
        where = f"[{target}]:{port}" if ":" in target else f"{target}:{port}"  # IPv6: bracketed
        writer.write(f"CONNECT {where} HTTP/1.1\r\nHost: {where}\r\n\r\n".encode())
        try:
            head = await reader.readuntil(b"\r\n\r\n")
        except (asyncio.IncompleteReadError, asyncio.LimitOverrunError):
            head = b""
        if head.split(b" ", 2)[1:2] != [b"200"]:
            writer.close()
            raise ConnectionRefusedError(f"the host's proxy refused CONNECT {target}:{port}")
        return reader, writer


def upstream_proxy(proxies: dict[str, str], host: str, port: int) -> tuple[str, int] | None:
    """The host's proxy (``HTTPS_PROXY``, or ``HTTP_PROXY`` for port 80) for ``host``,
    unless ``NO_PROXY`` names it; None: dial directly."""
    url = proxies.get("http" if port == 80 else "https") or proxies.get("https")
    if not url or urllib.request.proxy_bypass_environment(host, proxies):  # type: ignore[attr-defined]
        return None
    parts = urlsplit(url if "://" in url else "http://" + url)
    if parts.scheme != "http" or not parts.hostname:
        return None  # only plain-HTTP proxies speak CONNECT here
    return parts.hostname, parts.port or 3128


def _is_ip(text: str) -> bool:
    try:
        ipaddress.ip_address(text)
    except ValueError:
        return False
    return True


async def _pipe(src: asyncio.StreamReader, dst: asyncio.StreamWriter) -> None:
    try:
        while data := await src.read(CHUNK):
            dst.write(data)
            await dst.drain()
        if dst.can_write_eof():
            dst.write_eof()
    except (OSError, RuntimeError):
        dst.transport.abort()
