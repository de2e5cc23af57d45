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
- **While replying** (:class:`corral.server.write_stall.WriteStall`, TCP and the Unix
  socket, HTTP and WebSocket): a connection paused for writing whose client reads less
  than ``--write-min-rate`` bytes a second (default 1 KiB/s), or nothing, on average
  over ``--write-stall-timeout`` (60 s) is reset, so a reply nobody reads, or one read
  a trickle at a time, gives back what it holds (its output budget room, its buffers,
  its descriptor); a client that reads slowly but really gets its whole reply.
- **Per client** (:class:`ClientLimiter`): at most ``--max-client-requests`` requests
  in flight per TCP peer address (gRPC calls counted apart, per peer address too);
  more get 429 ``too_many_requests``. The Unix socket is one trusted owner: unlimited.
"""

from __future__ import annotations

import json
import os
import re
import resource
import time
from collections import Counter
from http import HTTPStatus
from itertools import accumulate
from typing import Any

from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol

from corral.errors import CorralError, HeadersTooLarge, InvalidArgument, RequestTimeout
from corral.schema import DEFAULT_TIMEOUT_S, SandboxInfo, SandboxSpec
from corral.server.coalesce import FLUSH_KEY, CoalescedWrites
from corral.server.write_stall import WriteStall

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


class BoundedHttpProtocol(HttpToolsProtocol):
    """uvicorn's httptools protocol with the pre-authentication bounds of this module."""

    _header_timer: Any = None
    _header_bytes = 0
    _refused = False
    _unix = False
    write_stall: float | None = None  # seconds (the daemon's: conn_limits.protocol_for)
    write_min_rate = 0.0  # bytes a second a paused reply must drain, on average
    _stall: WriteStall | None = None

    def connection_made(self, transport: Any) -> None:  # type: ignore[override]
        # a response's headers and body leave in one send (corral.server.coalesce)
        super().connection_made(CoalescedWrites(transport, self.loop))
        self._unix = isinstance(transport.get_extra_info("sockname"), str)
        if self.write_stall:
            who = ("a connection on the Unix socket" if self._unix else
                   f"a connection from {self.client[0] if self.client else '?'}")
            self._stall = WriteStall(self.loop, self.write_stall, self.write_min_rate, who)
        self._arm()

    def handle_websocket_upgrade(self) -> None:
        if self._stall is not None:  # (the WebSocket protocol watches its own)
            self._stall.stop()
        # the WebSocket protocol gets the socket's own transport, with nothing held
        if isinstance(self.transport, CoalescedWrites):
            self.transport.flush()
            self.transport = self.transport.raw
        super().handle_websocket_upgrade()

    def connection_lost(self, exc: Exception | None) -> None:
        self._disarm()
        if self._stall is not None:
            self._stall.stop()
        super().connection_lost(exc)

    def pause_writing(self) -> None:
        super().pause_writing()
        if self._stall is not None:
            self._stall.paused(self.transport)

    def resume_writing(self) -> None:
        if self._stall is not None:
            self._stall.resumed()
        super().resume_writing()

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
