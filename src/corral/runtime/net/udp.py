"""The UDP relay of policy sandboxes: allowed UDP (not DNS) leaves through it.

nftables hands the relay (by TPROXY, :mod:`.netns`) only datagrams to destinations in
the link's allow set; every other UDP datagram is refused by the kernel (ICMP port
unreachable) and recorded there. The relay reads each datagram's original destination
(``IP_ORIGDSTADDR``), asks :data:`Decide` again (the allow set is a prefilter; the
policy decides, and the host's own addresses and other sandboxes are never reached),
and relays a *flow* (sandbox address and port, destination address and port):

- ``down``: a transparent socket bound to the destination's address and port and
  connected to the sandbox's, so replies reach the sandbox from where it sent to (its
  later datagrams of the flow arrive here too: TPROXY finds connected sockets first);
- ``up``: an ordinary socket of the host connected to the destination.

A flow counts against the sandbox's open connections (:data:`Admit`) and ends after
:data:`IDLE_S` without a datagram, or when cut (a new policy refuses it).

An ICMP error of the far end (port, host or network unreachable: what ``up`` reports as
ECONNREFUSED, EHOSTUNREACH or ENETUNREACH) is passed back: the relay sends the sandbox
the same ICMP error about its own datagram (a raw socket; the embedded header is the
sandbox's datagram as it sent it), so its connected socket fails at once as it would
on a routed network, and the flow ends. The raw sockets only send: they receive
nothing (ICMP filters block every type).
"""

from __future__ import annotations

import asyncio
import contextlib
import errno
import ipaddress
import socket
import struct
import time
from collections.abc import Callable
from dataclasses import dataclass, field

IP_TRANSPARENT = 19
IP_RECVORIGDSTADDR = 20  # = IP_ORIGDSTADDR, the ancillary message's type
IPV6_TRANSPARENT = 75
IPV6_RECVORIGDSTADDR = 74
IDLE_S = 60.0
MAX_DATAGRAM = 65535
ICMP_FILTER = 1  # SOL_RAW (255) option: types not delivered to a raw ICMP socket
ICMP6_FILTER = 1  # SOL_ICMPV6 (58) option, the same for ICMPv6
# errno of the relay's socket -> (ICMP type, code), (ICMPv6 type, code)
UNREACHABLE = {errno.ECONNREFUSED: ((3, 3), (1, 4)),  # port
               errno.EHOSTUNREACH: ((3, 1), (1, 3)),  # host / address
               errno.ENETUNREACH: ((3, 0), (1, 0))}  # network / no route

# (sandbox address, destination address, port) -> the flow registry to join, or None
# (refused: recorded by the decider)
Decide = Callable[[str, str, int], "set[Flow] | None"]
# a new flow from a sandbox address: a function to call when it ends, or None
Admit = Callable[[str], "Callable[[], None] | None"]


@dataclass(eq=False)
class Flow:
    """One relayed UDP flow (``name`` is always None: UDP is judged by address)."""

    src: tuple[str, int]
    ip: str
    port: int
    down: socket.socket
    up: socket.socket
    done: Callable[[], None]
    registry: set[Flow]
    last: float = field(default_factory=time.monotonic)
    name: str | None = None
    closed: bool = False

    def cut(self) -> None:
        if self.closed:
            return
        self.closed = True
        loop = asyncio.get_running_loop()
        for s in (self.down, self.up):
            loop.remove_reader(s.fileno())
            s.close()
        self.registry.discard(self)
        self.done()


def _orig_dst(ancdata: list[tuple[int, int, bytes]]) -> tuple[str, int] | None:
    for level, kind, data in ancdata:
        if level == socket.IPPROTO_IP and kind == IP_RECVORIGDSTADDR and len(data) >= 8:
            return socket.inet_ntoa(data[4:8]), struct.unpack("!H", data[2:4])[0]
        if level == socket.IPPROTO_IPV6 and kind == IPV6_RECVORIGDSTADDR and len(data) >= 24:
            ip = socket.inet_ntop(socket.AF_INET6, data[8:24])
            return ip, struct.unpack("!H", data[2:4])[0]
    return None


def _checksum(data: bytes) -> int:
    if len(data) % 2:
        data += b"\0"
    total: int = sum(struct.unpack(f"!{len(data) // 2}H", data))
    while total >> 16:
        total = (total & 0xFFFF) + (total >> 16)
    return ~total & 0xFFFF


def icmp_error(src: tuple[str, int], dst: tuple[str, int], kind: tuple[int, int],
               six: bool) -> bytes:
    """An ICMP (``six``: ICMPv6, whose checksum the kernel fills) error of ``kind``
    about a UDP datagram from ``src`` to ``dst``: its IP and UDP headers embedded."""
    udp = struct.pack("!HHHH", src[1], dst[1], 8, 0)
    if six:
        inner = struct.pack("!IHBB16s16s", 6 << 28, 8, socket.IPPROTO_UDP, 64,
                            socket.inet_pton(socket.AF_INET6, src[0]),
                            socket.inet_pton(socket.AF_INET6, dst[0]))
        return struct.pack("!BBHI", *kind, 0, 0) + inner + udp
    ip = struct.pack("!BBHHHBBH4s4s", 0x45, 0, 28, 0, 0x4000, 64, socket.IPPROTO_UDP, 0,
                     socket.inet_aton(src[0]), socket.inet_aton(dst[0]))
    ip = ip[:10] + struct.pack("!H", _checksum(ip)) + ip[12:]
    body = struct.pack("!BBHI", *kind, 0, 0) + ip + udp
    return body[:2] + struct.pack("!H", _checksum(body)) + body[4:]


def _raw_icmp(six: bool) -> socket.socket:
    """A raw socket that sends ICMP (or ICMPv6) and receives none."""
    if six:
        s = socket.socket(socket.AF_INET6, socket.SOCK_RAW, socket.IPPROTO_ICMPV6)
        s.setsockopt(socket.IPPROTO_ICMPV6, ICMP6_FILTER, b"\xff" * 32)  # block all
    else:
        s = socket.socket(socket.AF_INET, socket.SOCK_RAW, socket.IPPROTO_ICMP)
        s.setsockopt(255, ICMP_FILTER, struct.pack("I", 0xFFFFFFFF))
    s.setblocking(False)
    return s


def _transparent(family: int) -> socket.socket:
    s = socket.socket(family, socket.SOCK_DGRAM)
    s.setblocking(False)
    if family == socket.AF_INET6:
        s.setsockopt(socket.IPPROTO_IPV6, IPV6_TRANSPARENT, 1)
        s.setsockopt(socket.IPPROTO_IPV6, socket.IPV6_V6ONLY, 1)
    else:
        s.setsockopt(socket.IPPROTO_IP, IP_TRANSPARENT, 1)
    s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    return s


class UdpRelay:
    """Listens on ``port`` (0.0.0.0 and, with IPv6, [::]) for TPROXY'd datagrams."""

    def __init__(self, decide: Decide, admit: Admit) -> None:
        self.decide = decide
        self.admit = admit
        self.port = 0
        self._socks: list[socket.socket] = []
        self._flows: dict[tuple[tuple[str, int], str, int], Flow] = {}
        self._sweeper: asyncio.Task[None] | None = None
        self._icmp: dict[bool, socket.socket] = {}  # by "IPv6?"

    async def start(self, *, ipv6: bool) -> None:
        loop = asyncio.get_running_loop()
        v4 = _transparent(socket.AF_INET)
        v4.setsockopt(socket.IPPROTO_IP, IP_RECVORIGDSTADDR, 1)
        v4.bind(("0.0.0.0", 0))
        self.port = v4.getsockname()[1]
        self._socks.append(v4)
        if ipv6:
            v6 = _transparent(socket.AF_INET6)
            v6.setsockopt(socket.IPPROTO_IPV6, IPV6_RECVORIGDSTADDR, 1)
            v6.bind(("::", self.port))
            self._socks.append(v6)
        for s in self._socks:
            loop.add_reader(s.fileno(), self._first, s)
        for six in (False, True) if ipv6 else (False,):
            self._icmp[six] = _raw_icmp(six)
        self._sweeper = loop.create_task(self._sweep())

    def close(self) -> None:
        if self._sweeper is not None:
            self._sweeper.cancel()
        for flow in list(self._flows.values()):
            flow.cut()
        loop = asyncio.get_running_loop()
        for s in self._socks:
            loop.remove_reader(s.fileno())
            s.close()
        self._socks.clear()
        for s in self._icmp.values():
            s.close()
        self._icmp.clear()

    def _first(self, listener: socket.socket) -> None:
        """A datagram of a flow the relay does not know yet."""
        try:
            data, anc, _flags, src = listener.recvmsg(MAX_DATAGRAM, socket.CMSG_SPACE(32))
        except (BlockingIOError, InterruptedError):
            return
        except OSError:
            return
        dst = _orig_dst(anc)
        if dst is None:
            return
        src_ip = str(ipaddress.ip_address(src[0]))
        key = ((src_ip, src[1]), dst[0], dst[1])
        flow = self._flows.get(key)
        if flow is None:
            flow = self._open(listener.family, key)
        if flow is not None:
            self._send(flow.up, data, flow)

    def _open(self, family: int, key: tuple[tuple[str, int], str, int]) -> Flow | None:
        src, ip, port = key
        registry = self.decide(src[0], ip, port)
        if registry is None:
            return None
        done = self.admit(src[0])
        if done is None:
            return None
        down = up = None
        try:
            down = _transparent(family)
            down.bind((ip, port))
            down.connect(src)
            up = socket.socket(family, socket.SOCK_DGRAM)
            up.setblocking(False)
            up.connect((ip, port))
        except OSError:
            for s in (down, up):
                if s is not None:
                    s.close()
            done()
            return None
        def finished() -> None:
            self._flows.pop(key, None)
            done()
        flow = Flow(src, ip, port, down, up, finished, registry)
        self._flows[key] = flow
        registry.add(flow)
        loop = asyncio.get_running_loop()
        loop.add_reader(down.fileno(), self._relay, flow, down, up)
        loop.add_reader(up.fileno(), self._relay, flow, up, down)
        return flow

    def _relay(self, flow: Flow, src: socket.socket, dst: socket.socket) -> None:
        try:
            data = src.recv(MAX_DATAGRAM)
        except (BlockingIOError, InterruptedError):
            return
        except OSError as exc:  # e.g. ICMP unreachable from the destination: the flow ends
            self._unreachable(flow, src is flow.up, exc)
            return
        self._send(dst, data, flow)

    def _send(self, sock: socket.socket, data: bytes, flow: Flow) -> None:
        flow.last = time.monotonic()
        try:
            sock.send(data)
        except (BlockingIOError, InterruptedError):
            pass  # a full buffer drops the datagram, as a network would
        except OSError as exc:
            self._unreachable(flow, sock is flow.up, exc)

    def _unreachable(self, flow: Flow, far: bool, exc: OSError) -> None:
        """End the flow; an ICMP error of the far end goes back to the sandbox."""
        kinds = UNREACHABLE.get(exc.errno or 0) if far else None
        six = ":" in flow.ip
        raw = self._icmp.get(six)
        if kinds is not None and raw is not None and not flow.closed:
            packet = icmp_error(flow.src, (flow.ip, flow.port), kinds[six], six)
            with contextlib.suppress(OSError):
                raw.sendto(packet, (flow.src[0], 0))
        flow.cut()

    async def _sweep(self) -> None:
        while True:
            await asyncio.sleep(IDLE_S / 4)
            now = time.monotonic()
            for flow in list(self._flows.values()):
                if now - flow.last > IDLE_S:
                    flow.cut()
