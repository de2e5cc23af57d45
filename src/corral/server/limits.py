"""What one request may cost the daemon, and what happens before it is authenticated.

Every bound here is enforced before the expensive step it protects:

- **Before authentication** (HTTP, :class:`BoundedHttpProtocol`): the request line and
  headers must arrive within :data:`HEADER_TIMEOUT_S` and fit in
  :data:`MAX_HEADER_BYTES`, or the connection is answered (408 / 431) and closed. No
  body is read before the token is checked (:class:`corral.server.app.Guard` answers a
  401 with ``Connection: close`` and never reads it). Protocol errors are answered in
  the JSON error shape, never as plain text.
- **Before parsing** (:func:`parse_json`): a JSON body must be UTF-8, nest at most
  :data:`MAX_JSON_DEPTH` deep and hold at most :data:`MAX_JSON_ITEMS` values; this is
  checked by a linear scan (regular expressions, no recursion) before ``json.loads``,
  so neither a deep nesting nor millions of elements reach the parser or pydantic.
- **While reading** (:func:`corral.server.wire.read_body`): a body that stalls for
  :data:`BODY_IDLE_TIMEOUT_S` is cut (408 ``request_timeout``).
- **While replying** (:class:`BoundedHttpProtocol`, TCP and the Unix socket): from
  when a connection's transport pauses for writing (its buffer above the high-water
  mark: the client reads less than the daemon sends), it must drain at least
  ``--write-min-rate`` bytes a second (and at least one byte) on average over each
  ``--write-stall-timeout`` seconds while it stays paused, or it is reset: a reply
  nobody reads, or one read a trickle at a time (1.5 KB a minute held a reply open for
  ever when any byte read restarted the wait), gives back what it holds (its output
  budget room, its buffers, its descriptor). A client that reads slowly but really
  (the default minimum, 1 KiB/s, is below any network's rate) gets its whole reply.
  The window runs on through a resume: a client cannot reset it by draining just the
  buffer's low-water gap.
- **Per client** (:class:`ClientLimiter`): at most ``--max-client-requests`` requests
  in flight per TCP peer address (gRPC calls counted apart, per peer address too);
  more get 429 ``too_many_requests``. The Unix socket is one trusted owner: unlimited.
"""

from __future__ import annotations

import fcntl
import json
import logging
import os
import re
import resource
import socket
import struct
import termios
import time
from collections import Counter
from contextlib import suppress
from http import HTTPStatus
from itertools import accumulate
from typing import Any

from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol

from corral.errors import CorralError, HeadersTooLarge, InvalidArgument, RequestTimeout
from corral.schema import DEFAULT_TIMEOUT_S, SandboxInfo, SandboxSpec
from corral.server.coalesce import FLUSH_KEY, CoalescedWrites

logger = logging.getLogger("corral.server")

MAX_JSON_DEPTH = 64
MAX_JSON_ITEMS = 65_536  # values (array elements, object members) in one JSON body
MAX_HEADER_BYTES = 64 << 10  # request line + headers
HEADER_TIMEOUT_S = 10.0  # from connection (or a request's first byte) to its last header
BODY_IDLE_TIMEOUT_S = 60.0  # longest pause between two pieces of a request body
LINGER_S = 1.0  # after a refusal, the rest of the request is read and dropped this long

# A JSON string, possibly unterminated (possessive: every character is scanned once).
_STRING = re.compile(r'"(?:[^"\\]++|\\.)*+(?:"|\\?\Z)', re.DOTALL)
_NOT_BRACKET = re.compile(r"[^\[\]{}]++")
_DEPTH_STEP = {"[": 1, "{": 1, "]": -1, "}": -1}


def parse_json(raw: bytes | bytearray, what: str) -> Any:
    """``raw`` as JSON, refused (400) if it is not UTF-8, nests deeper than
    :data:`MAX_JSON_DEPTH` or holds more than :data:`MAX_JSON_ITEMS` values."""
    try:
        text = bytes(raw).decode("utf-8")
    except UnicodeDecodeError as exc:
        raise InvalidArgument(f"the {what} is not UTF-8 JSON: {exc}") from None
    skeleton = _STRING.sub("", text)  # what is left of the JSON outside its strings
    items = skeleton.count(",") + skeleton.count("[") + skeleton.count("{")
    if items > MAX_JSON_ITEMS:
        raise InvalidArgument(
            f"the {what} holds more than {MAX_JSON_ITEMS} JSON values: send less",
            details={"limit": "max_json_items", "value": MAX_JSON_ITEMS},
        )
    brackets = _NOT_BRACKET.sub("", skeleton)
    if max(accumulate(map(_DEPTH_STEP.__getitem__, brackets)), default=0) > MAX_JSON_DEPTH:
        raise InvalidArgument(
            f"the {what} nests deeper than {MAX_JSON_DEPTH} levels",
            details={"limit": "max_json_depth", "value": MAX_JSON_DEPTH},
        )
    try:
        return json.loads(text)
    except (ValueError, RecursionError) as exc:
        raise InvalidArgument(f"the {what} is not valid JSON: {exc}") from None


def check_host_limits(spec: SandboxSpec) -> None:
    """Refuse a spec this host can never honour (:class:`InvalidArgument` naming it)."""
    check_open_files(spec.open_files)
    cores = os.cpu_count() or 1
    if spec.cpus > cores:
        raise InvalidArgument(
            f"invalid sandbox spec: cpus: {spec.cpus:g} is more than this host's {cores} "
            "CPUs (cpus is a CPU-time quota; it cannot exceed the CPUs there are)",
            details={"errors": [{"field": "cpus", "message": f"at most {cores}"}],
                     "limit": cores},
        )


DAEMON_LIFETIME = "this daemon's maximum lifetime (corral serve --max-lifetime)"
TENANT_LIFETIME = "your tenant's maximum lifetime (corral token create --max-lifetime)"


def check_lifetime(seconds: float, limit: float, whose: str = DAEMON_LIFETIME) -> None:
    """Refuse a lifetime of ``seconds`` above ``limit`` (``whose``: which maximum)."""
    if seconds > limit:
        raise InvalidArgument(
            f"timeout {seconds:g} s is more than {whose}, {limit:g} s: ask for at most that",
            details={"field": "timeout", "max": limit},
        )


def check_total_lifetime(info: SandboxInfo, seconds: float, limit: float,
                         whose: str = DAEMON_LIFETIME) -> None:
    """Refuse moving ``info``'s end to ``seconds`` from now if it would then have
    lived, from its create, longer than ``limit`` in all."""
    lived = max(0.0, time.time() - info.created_at)
    if lived + seconds > limit:
        left = max(0.0, limit - lived)
        raise InvalidArgument(
            f"timeout {seconds:g} s would make sandbox {info.id} live {lived + seconds:.0f} s "
            f"from its create, more than {whose}, {limit:g} s: it has {left:.0f} s left; "
            "ask for at most that, or create a new sandbox",
            details={"field": "timeout", "max": left, "sandbox_id": info.id},
        )


def check_create_lifetime(spec: SandboxSpec, limit: float, whose: str = DAEMON_LIFETIME) -> None:
    """Refuse a create whose ``timeout`` (not the default one) is above ``limit``."""
    if spec.timeout != DEFAULT_TIMEOUT_S:
        check_lifetime(spec.timeout, limit, whose)


def capped_lifetime(spec: SandboxSpec, limit: float) -> SandboxSpec:
    """``spec`` with its ``timeout`` lowered to ``limit`` if it was above."""
    return spec if spec.timeout <= limit else spec.model_copy(update={"timeout": limit})


def check_open_files(open_files: int) -> None:
    """Refuse a sandbox ``open_files`` above the daemon's own hard RLIMIT_NOFILE (the
    sandbox's limit is set below the daemon's: it cannot be raised above it)."""
    hard = resource.getrlimit(resource.RLIMIT_NOFILE)[1]
    if hard != resource.RLIM_INFINITY and open_files > hard:
        raise InvalidArgument(
            f"invalid sandbox spec: open_files: {open_files} is above this daemon's own "
            f"limit of {hard} open files (its hard RLIMIT_NOFILE)",
            details={"errors": [{"field": "open_files", "message": f"at most {hard}"}],
                     "limit": hard},
        )


class ClientLimiter:
    """Counts requests in flight per client; :meth:`enter` refuses past ``limit``."""

    def __init__(self, limit: int) -> None:
        self.limit = limit
        self._in_flight: Counter[str] = Counter()

    def enter(self, client: str) -> bool:
        """Count one more request of ``client``; False (nothing counted) if at the limit."""
        if self._in_flight[client] >= self.limit:
            return False
        self._in_flight[client] += 1
        return True

    def leave(self, client: str) -> None:
        self._in_flight[client] -= 1
        if self._in_flight[client] <= 0:
            del self._in_flight[client]


def too_many(client: str, limit: int) -> dict[str, Any]:
    """The ``details`` and message of a refusal by :class:`ClientLimiter`."""
    return {
        "message": f"client {client} already has {limit} requests in flight (the daemon's "
        "--max-client-requests): wait for some to finish",
        "details": {"limit": "max_client_requests", "value": limit},
    }


def raw_error(err: CorralError) -> bytes:
    """A whole HTTP/1.1 error reply (JSON shape, ``Connection: close``) as bytes, for
    replies the protocol layer writes before any application runs."""
    body = json.dumps({"error": err.to_dict()}).encode()
    head = (
        f"HTTP/1.1 {err.status} {HTTPStatus(err.status).phrase}\r\n"
        "content-type: application/json\r\n"
        f"content-length: {len(body)}\r\nconnection: close\r\n\r\n"
    )
    return head.encode() + body


class _HeadersTooLarge(Exception):
    """Stops the parser (uvicorn then calls :meth:`send_400_response`, a no-op by then)."""


UNIX_TRANSPORT_KEY = "corral.unix_transport"
"""Where a request on the daemon's Unix socket finds its connection's transport: a port
socket's handoff (``corral.server.port_socket.handoff``) sends a descriptor on it."""


def _kernel_queue(transport: Any) -> int:
    """Bytes the kernel still holds to send on ``transport``'s socket (TCP: unsent and
    unacknowledged; Unix: unread); 0 if it cannot say."""
    sock = transport.get_extra_info("socket")
    try:
        return struct.unpack("i", fcntl.ioctl(sock.fileno(), termios.TIOCOUTQ, b"\0" * 4))[0]
    except (AttributeError, OSError, ValueError):
        return 0


class BoundedHttpProtocol(HttpToolsProtocol):
    """uvicorn's httptools protocol with the pre-authentication bounds of this module."""

    _header_timer: Any = None
    _header_bytes = 0
    _refused = False
    _unix = False
    write_stall: float | None = None  # seconds (the daemon's: conn_limits.protocol_for)
    write_min_rate = 0.0  # bytes a second a paused reply must drain, on average
    _stall_timer: Any = None
    _stall_mark = 0  # bytes drained (handed to the kernel) when the window began

    def connection_made(self, transport: Any) -> None:  # type: ignore[override]
        # a response's headers and body leave in one send (corral.server.coalesce)
        super().connection_made(CoalescedWrites(transport, self.loop))
        self._unix = isinstance(transport.get_extra_info("sockname"), str)
        self._arm()

    def handle_websocket_upgrade(self) -> None:
        self._unwatch_stall()  # (ws_flow.py bounds what a WebSocket's replies hold)
        # the WebSocket protocol gets the socket's own transport, with nothing held
        if isinstance(self.transport, CoalescedWrites):
            self.transport.flush()
            self.transport = self.transport.raw
        super().handle_websocket_upgrade()

    def connection_lost(self, exc: Exception | None) -> None:
        self._disarm()
        self._unwatch_stall()
        super().connection_lost(exc)

    def pause_writing(self) -> None:
        super().pause_writing()
        if self.write_stall and self._stall_timer is None:
            self._watch()

    # (no resume_writing: the window runs on; its check ends it if no longer paused)

    def _watch(self) -> None:
        assert self.write_stall is not None
        self._stall_mark = self._drained()
        self._stall_timer = self.loop.call_later(self.write_stall, self._check_stall)

    def _drained(self) -> int:
        """Bytes of this connection's replies its client has taken so far: all written
        less what waits in the transport and in the kernel (which holds megabytes on
        loopback: only its own queue, ``SIOCOUTQ``, shows what the client read)."""
        written = getattr(self.transport, "written", 0)
        return written - self.transport.get_write_buffer_size() - _kernel_queue(self.transport)

    def _unwatch_stall(self) -> None:
        if self._stall_timer is not None:
            self._stall_timer.cancel()
            self._stall_timer = None

    def _check_stall(self) -> None:
        self._stall_timer = None
        if not self.flow.write_paused or self.transport.is_closing():
            return  # the replies caught up: the next pause begins a new window
        assert self.write_stall is not None
        drained = self._drained() - self._stall_mark
        if drained > 0 and drained >= self.write_min_rate * self.write_stall:
            self._watch()  # slow, not stalled: a new window
            return
        logger.info("closed a connection from %s: its client read %d bytes of its reply "
                    "in %g s (--write-stall-timeout), less than %g a second "
                    "(--write-min-rate) or none; %d bytes were waiting",
                    self.client[0] if self.client else "the Unix socket", max(drained, 0),
                    self.write_stall, self.write_min_rate,
                    self.transport.get_write_buffer_size())
        sock = self.transport.get_extra_info("socket")
        if sock is not None and not self._unix:  # a reset: the kernel drops the unsent
            with suppress(OSError):  # bytes it holds too (a close would queue a FIN)
                sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
        self.transport.abort()  # the wait in uvicorn's send ends: the reply's holds go

    def data_received(self, data: bytes) -> None:
        if not self._refused:  # else the rest of a refused request: dropped unparsed
            super().data_received(data)

    def _arm(self) -> None:
        if self._header_timer is None:
            self._header_timer = self.loop.call_later(HEADER_TIMEOUT_S, self._headers_late)

    def _disarm(self) -> None:
        if self._header_timer is not None:
            self._header_timer.cancel()
            self._header_timer = None

    def _refuse(self, err: CorralError) -> None:
        """Reply, then close after :data:`LINGER_S` (closing with unread data would
        reset the connection and lose the reply on the client's side)."""
        self._disarm()
        if self._refused or self.transport.is_closing():
            return
        self._refused = True
        self.transport.write(raw_error(err))
        if self.transport.can_write_eof():
            self.transport.write_eof()
        self.loop.call_later(LINGER_S, self.transport.close)

    def _headers_late(self) -> None:
        self._header_timer = None
        self._refuse(RequestTimeout(
            f"the request's headers did not arrive within {HEADER_TIMEOUT_S:g} s"
        ))

    def _count(self, size: int) -> None:
        self._header_bytes += size
        if self._header_bytes > MAX_HEADER_BYTES:
            self._refuse(HeadersTooLarge(
                f"the request line and headers are over {MAX_HEADER_BYTES} bytes",
                details={"limit": "max_header_bytes", "value": MAX_HEADER_BYTES},
            ))
            raise _HeadersTooLarge()

    def on_message_begin(self) -> None:
        super().on_message_begin()
        self._header_bytes = 0
        self._arm()

    def on_url(self, url: bytes) -> None:
        self._count(len(url))
        super().on_url(url)

    def on_header(self, name: bytes, value: bytes) -> None:
        self._count(len(name) + len(value) + 4)
        super().on_header(name, value)

    def on_headers_complete(self) -> None:
        self._disarm()
        if self._unix:  # a port's connection may be handed over on it (port_socket.handoff)
            self.scope[UNIX_TRANSPORT_KEY] = self.transport  # type: ignore[literal-required]
        if isinstance(self.transport, CoalescedWrites):  # a reply's end is sent at once
            self.scope[FLUSH_KEY] = self.transport.flush  # type: ignore[literal-required]
        super().on_headers_complete()

    def send_400_response(self, msg: str) -> None:
        self._refuse(InvalidArgument(f"malformed HTTP request: {msg}"))
