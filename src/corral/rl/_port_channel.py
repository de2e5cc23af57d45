"""A line channel to a server inside a sandbox over the daemon's port socket
(``/v1/sandboxes/{id}/ports/{port}/socket``, :mod:`corral.server.port_socket`): what
:class:`corral.rl.SandboxEnv` steps over once its server listens (about half of a
process's stdin/stdout round trip, ``benchmarks/bench_gym.py``).

On a daemon reached as ``unix://`` the daemon hands the connection itself over instead
(``POST .../handoff``, :func:`corral.server.port_socket.handoff`): lines then go straight
to the server (:class:`HandedChannel`), two wake-ups a round trip instead of four; an
older daemon, or one that cannot now, gets the WebSocket.

The WebSocket is spoken here on a blocking socket, in this thread: a library client
reads on a thread of its own, and handing each reply over costs two more wake-ups a
step. Only what this needs: one handshake, binary frames out (masked), data, ping and
close frames in. A daemon reached as ``unix://`` or ``http://`` only (``https://`` and
clusters keep the process's stdin and stdout: :func:`open_channel` returns None, as it
does when the daemon has no such route). What the sandbox sends is untrusted: a line
is read up to ``max_line`` bytes only.
"""

from __future__ import annotations

import base64
import hashlib
import os
import socket
import struct
from typing import Any
from urllib.parse import urlsplit

import httpcore

import corral
from corral.api.operations import PORT_SOCKET
from corral.client._unix import check_peer
from corral.errors import PortClosed

DEFAULT_MAX_LINE = 64 << 20  # a reply line (an observation) past this ends the channel
OPEN_TIMEOUT_S = 10.0
_GUID = b"258EAFA5-E914-47DA-95CA-C5AB0DC85B11"  # RFC 6455's
_MAX_HEAD = 16 << 10


class _Lines:
    """Lines out of the chunks :meth:`_chunk` brings (``None`` once the other side closed),
    at most ``max_line`` bytes each."""

    max_line: int
    _lines: bytearray

    def _chunk(self) -> bytes | None:
        raise NotImplementedError

    def close(self) -> None:
        raise NotImplementedError

    def readline(self) -> bytes:
        """The next line with its ``\\n``; ``b""`` once the sandbox's side closed."""
        lines = self._lines
        start = 0
        while (end := lines.find(b"\n", start)) < 0:
            if len(lines) > self.max_line:
                self.close()
                raise PortClosed(f"a line from the sandbox is over {self.max_line} bytes")
            start = len(lines)
            chunk = self._chunk()
            if chunk is None:
                return b""
            lines += chunk
        line = bytes(lines[:end + 1])
        del lines[:end + 1]
        return line


class HandedChannel(_Lines):
    """Lines to and from a sandbox's loopback port on the connection the daemon handed
    over (``sock``); ``lease``: the request that keeps the daemon's side of it (its end
    ends the connection on the daemon's side too)."""

    def __init__(self, sock: socket.socket, lease: socket.socket,
                 max_line: int = DEFAULT_MAX_LINE) -> None:
        self._sock, self._lease = sock, lease
        self._lines = bytearray()
        self.max_line = max_line

    def write(self, data: bytes) -> None:
        try:
            self._sock.sendall(data)
        except OSError as exc:
            raise PortClosed(f"the port channel closed: {exc}") from exc

    def _chunk(self) -> bytes | None:
        try:
            return self._sock.recv(1 << 16) or None
        except OSError:
            return None

    def close(self) -> None:
        self._sock.close()
        self._lease.close()


class PortChannel(_Lines):
    """One WebSocket carrying lines to and from a sandbox's loopback port."""

    def __init__(self, sock: socket.socket, buffered: bytes = b"",
                 max_line: int = DEFAULT_MAX_LINE) -> None:
        self._sock = sock
        self._raw = bytearray(buffered)  # bytes read, frames not yet parsed
        self._lines = bytearray()  # payload bytes, not yet a whole line
        self._closed = False
        self.max_line = max_line

    # ------------------------------------------------------------------ out

    def write(self, data: bytes) -> None:
        self._send(0x2, data)

    def _send(self, opcode: int, data: bytes) -> None:
        n = len(data)
        head = bytes([0x80 | opcode])
        if n < 126:
            head += bytes([0x80 | n])
        elif n < 1 << 16:
            head += bytes([0x80 | 126]) + struct.pack("!H", n)
        else:
            head += bytes([0x80 | 127]) + struct.pack("!Q", n)
        mask = os.urandom(4)
        key = int.from_bytes((mask * (n // 4 + 1))[:n], "big")
        masked = (int.from_bytes(data, "big") ^ key).to_bytes(n, "big")
        try:
            self._sock.sendall(head + mask + masked)
        except OSError as exc:
            self._closed = True
            raise PortClosed(f"the port channel closed: {exc}") from exc

    # ------------------------------------------------------------------- in

    def _fill(self, need: int) -> bool:
        while len(self._raw) < need:
            try:
                chunk = self._sock.recv(1 << 16)
            except OSError:
                chunk = b""
            if not chunk:
                return False
            self._raw += chunk
        return True

    def _frame(self) -> bytes | None:
        """The next data frame's payload; None once closed."""
        while not self._closed:
            if not self._fill(2):
                break
            first, second = self._raw[0], self._raw[1]
            n, at = second & 0x7F, 2
            if n == 126:
                if not self._fill(4):
                    break
                n, at = struct.unpack_from("!H", self._raw, 2)[0], 4
            elif n == 127:
                if not self._fill(10):
                    break
                n, at = struct.unpack_from("!Q", self._raw, 2)[0], 10
            if second & 0x80 or n > self.max_line + (1 << 16):  # servers never mask
                break
            if not self._fill(at + n):
                break
            payload = bytes(self._raw[at:at + n])
            del self._raw[:at + n]
            opcode = first & 0x0F
            if opcode in (0x0, 0x1, 0x2):
                return payload
            if opcode == 0x9:
                self._send(0xA, payload)  # pong
            elif opcode == 0x8:
                break
        self.close()
        return None

    def _chunk(self) -> bytes | None:
        return self._frame()

    def close(self) -> None:
        if not self._closed:
            self._closed = True
            try:
                self._send(0x8, struct.pack("!H", 1000))
            except PortClosed:
                pass
        self._sock.close()


def _handshake(sock: socket.socket, host: str, path: str, token: str | None) -> bytes:
    """Upgrade ``sock`` to a WebSocket on ``path``; what was read past the reply's head."""
    key = base64.b64encode(os.urandom(16))
    head = (f"GET {path} HTTP/1.1\r\nHost: {host}\r\nUpgrade: websocket\r\n"
            "Connection: Upgrade\r\nSec-WebSocket-Version: 13\r\n").encode()
    head += b"Sec-WebSocket-Key: " + key + b"\r\n"
    if token:
        head += f"Authorization: Bearer {token}\r\n".encode()
    sock.sendall(head + b"\r\n")
    head_bytes, _, rest = _reply_head(sock, "no WebSocket upgrade").partition(b"\r\n\r\n")
    lines = head_bytes.split(b"\r\n")
    if lines[0].split()[1:2] != [b"101"]:
        raise OSError(f"refused: {lines[0].decode('latin-1')}")
    accept = base64.b64encode(hashlib.sha1(key + _GUID).digest())
    if not any(line.lower() == b"sec-websocket-accept: " + accept.lower() for line in lines[1:]):
        raise OSError("a wrong Sec-WebSocket-Accept")
    return rest


def _reply_head(sock: socket.socket, missing: str) -> bytes:
    """An HTTP reply's head and what came after it (``OSError(missing)`` if none)."""
    reply = b""
    while b"\r\n\r\n" not in reply:
        chunk = sock.recv(4096)
        if not chunk or len(reply) > _MAX_HEAD:
            raise OSError(missing)
        reply += chunk
    return reply


def _handed(address: str, path: str) -> HandedChannel | None:
    """The connection handed over by the daemon on its Unix socket ``address``, or None
    (nothing is left open then)."""
    lease = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    fds: list[int] = []
    try:
        lease.settimeout(OPEN_TIMEOUT_S)
        lease.connect(address)
        check_peer(lease, address)  # the daemon of root or this user only, as the SDK's
        lease.sendall(f"POST {path.removesuffix('/socket')}/handoff HTTP/1.1\r\n"
                      "Host: localhost\r\nContent-Length: 0\r\n\r\n".encode())
        first, fds, _, _ = socket.recv_fds(lease, 1, 1)
        if first != b"\0" or len(fds) != 1:  # a refusal's head, or an older daemon's 404
            raise OSError("not handed over")
        head = _reply_head(lease, "no reply to the handoff")
        if head.split(b" ", 2)[1:2] != [b"200"]:
            raise OSError("refused")
        sock = socket.socket(fileno=fds[0])  # ENOTSOCK (an OSError) for anything else
        fds.clear()
        if sock.type != socket.SOCK_STREAM:
            sock.close()
            raise OSError("not a stream")
        sock.setblocking(True)  # the daemon's side was not (one file description)
        lease.settimeout(None)
        return HandedChannel(sock, lease)
    except (OSError, httpcore.ConnectError):  # another user's socket, a refusal, no route
        for fd in fds:
            os.close(fd)
        lease.close()
        return None


def open_channel(sandbox: corral.Sandbox, port: int,
                 first_line: bytes) -> PortChannel | HandedChannel | None:
    """A channel to ``port`` of ``sandbox`` (``first_line`` sent on it at once), or None
    where none can be had (see the module docstring)."""
    parts = urlsplit(sandbox.client.url)
    token = sandbox.client.connect_args.get("token")
    path = PORT_SOCKET.format(id=sandbox.id, port=port)
    if parts.scheme == "unix" and (handed := _handed(parts.netloc + parts.path, path)):
        try:
            handed.write(first_line)
            return handed
        except PortClosed:
            handed.close()
            return None
    try:
        if parts.scheme == "unix":
            sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
            address: Any = parts.netloc + parts.path
            host = "localhost"
        elif parts.scheme == "http" and parts.hostname:
            info = socket.getaddrinfo(parts.hostname, parts.port or 80,
                                      type=socket.SOCK_STREAM)[0]
            sock = socket.socket(info[0], socket.SOCK_STREAM)
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            address, host = info[4], parts.netloc
        else:
            return None  # https (no TLS here) or a cluster (its router routes no such path)
    except OSError:
        return None
    try:
        sock.settimeout(OPEN_TIMEOUT_S)
        sock.connect(address)
        if parts.scheme == "unix":  # the daemon of root or this user only, as the SDK's
            check_peer(sock, address)
        rest = _handshake(sock, host, path, token)
        sock.settimeout(None)  # a step takes as long as it takes (the sandbox's lifetime)
    except (OSError, httpcore.ConnectError):  # an older daemon (no route), a refusal,
        sock.close()  # nothing on the port, another user's socket
        return None
    channel = PortChannel(sock, rest)
    try:
        channel.write(first_line)
    except PortClosed:
        channel.close()
        return None
    return channel
