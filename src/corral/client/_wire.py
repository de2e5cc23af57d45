"""HTTP/1.1 for whole replies on the daemon's Unix socket, without httpx's client.

A call of the SDK through ``httpx.Client`` spent ~0.5 ms of the caller's CPU on a
request the daemon served in ~0.1 ms (URL merging, cookies, auth and redirect hooks,
httpcore's pool and h11's state machine; ``benchmarks/bench_pool.py``). A request whose
body is in memory (JSON, bytes) and whose reply is read whole is written here as bytes
and its reply parsed by hand (:class:`Reply`), then handed back as an
:class:`httpx.Response`, so callers see no difference. Anything else (streamed replies,
bodies sent in pieces or from files, TCP, a transport the caller chose) keeps httpx.
The I/O is in :mod:`corral.client._async._lean` (and its blocking twin).
"""

from __future__ import annotations

import json
import re
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import httpx

from corral.client._body import CHUNK_BYTES

# What a path may hold as it is sent: anything else (a space, a non-ASCII name, a
# fragment) is left to httpx, which percent-encodes it.
_SAFE_TARGET = re.compile(r"[A-Za-z0-9\-._~!$&'()*+,;=:@/%?]*")
# The keyword arguments a lean request understands; any other goes through httpx.
_KNOWN = frozenset({"json", "content", "params", "headers", "timeout"})
# Headers that frame the message or the connection: a caller who names one gets httpx
# (which checks them against the body), never a second copy written here (a request
# with two lengths, or a length and chunks, reads differently to different parsers).
_FRAMING = frozenset({"content-length", "transfer-encoding", "host", "connection", "expect",
                      "upgrade", "te", "trailer"})
# Replies that never have a body (RFC 9112 section 6.3).
_NO_BODY = frozenset({204, 304})
MAX_HEAD_BYTES = 64 << 10  # the daemon's replies have a few short headers


@dataclass(frozen=True)
class LeanRequest:
    """A request ready to be written: its bytes, and what is needed to report on it."""

    method: str
    url: str  # for error messages (httpx.Request, built only for an error)
    data: bytes
    timeout: httpx.Timeout


class Encoder:
    """Builds :class:`LeanRequest` for one client: its host, default headers and timeout."""

    def __init__(self, base_url: str, headers: httpx.Headers, timeout: httpx.Timeout) -> None:
        self._base = base_url.rstrip("/")
        self._host = httpx.URL(base_url).netloc.decode("ascii")
        # httpx's defaults, without Accept-Encoding: a reply read here is never decoded
        self._headers = {k.lower(): v for k, v in headers.items() if k.lower() not in
                         ("accept-encoding", "host", "connection")}
        self._timeout = timeout

    def encode(self, method: str, path: str, kwargs: Mapping[str, Any]) -> LeanRequest | None:
        """The request, or None when httpx must send it (see the module's docstring)."""
        if not _KNOWN.issuperset(kwargs) or not _SAFE_TARGET.fullmatch(path):
            return None
        content_type = None
        if kwargs.get("json") is not None:
            if kwargs.get("content") is not None:
                return None
            body = json.dumps(kwargs["json"], ensure_ascii=False, separators=(",", ":"),
                              allow_nan=False).encode("utf-8")
            content_type = "application/json"
        else:
            content = kwargs.get("content")
            if content is None:
                body = b""
            elif isinstance(content, bytes):
                body = content
            elif isinstance(content, str):
                body = content.encode("utf-8")
            else:  # an iterator or a file: httpx sends it in pieces
                return None
        if len(body) > CHUNK_BYTES:  # sent in bounded pieces (client/_body.py)
            return None
        params = kwargs.get("params")
        if params:
            if "?" in path:
                return None
            query = str(httpx.QueryParams(params))
            if query:
                path = f"{path}?{query}"
        headers = self._headers
        extra = kwargs.get("headers")
        if extra:
            extra = {k.lower(): v for k, v in dict(extra).items()}
            if not _FRAMING.isdisjoint(extra):
                return None
            headers = {**headers, **extra}
        lines = [f"{method} {path} HTTP/1.1\r\nhost: {self._host}\r\n"]
        for key, value in headers.items():
            if "\r" in value or "\n" in value or "\r" in key or "\n" in key:
                return None  # httpx refuses these: let it say so
            lines.append(f"{key}: {value}\r\n")
        if content_type is not None and "content-type" not in headers:
            lines.append(f"content-type: {content_type}\r\n")
        if body or method not in ("GET", "HEAD", "DELETE", "OPTIONS"):
            lines.append(f"content-length: {len(body)}\r\n")
        lines.append("\r\n")
        try:
            head = "".join(lines).encode("ascii")
        except UnicodeEncodeError:
            return None
        timeout = kwargs.get("timeout", self._timeout)
        if not isinstance(timeout, httpx.Timeout):
            return None
        return LeanRequest(method, self._base + path, head + body, timeout)


class Reply:
    """A reply parsed as its bytes arrive: :meth:`feed` until it says the reply is whole."""

    def __init__(self, method: str) -> None:
        self._head_only = method == "HEAD"
        self._buf = bytearray()
        self.status = 0
        self.reason = b""
        self.headers: list[tuple[bytes, bytes]] = []
        self._length: int | None = None  # the body's, once the head is read
        self._chunked = False
        self._to_eof = False
        self._body = bytearray()
        self.keep_alive = True

    def feed(self, data: bytes) -> bool:
        """Take the next bytes (``b""`` at the end of the stream); True when whole."""
        if not data:
            if self._to_eof and self.status:
                self.keep_alive = False
                self._body += self._buf
                return True
            raise httpx.RemoteProtocolError(
                "the daemon closed the connection without sending a complete reply")
        self._buf += data
        if not self.status:
            end = self._buf.find(b"\r\n\r\n")
            if end < 0:
                if len(self._buf) > MAX_HEAD_BYTES:
                    raise httpx.RemoteProtocolError("the daemon's reply head is too long")
                return False
            self._parse_head(bytes(self._buf[:end]))
            del self._buf[:end + 4]
        return self._body_done()

    def _parse_head(self, head: bytes) -> None:
        lines = head.split(b"\r\n")
        try:
            version, status, *reason = lines[0].split(b" ", 2)
            self.status = int(status)
            if not version.startswith(b"HTTP/1.") or not 100 <= self.status <= 599:
                raise ValueError
        except ValueError:
            raise httpx.RemoteProtocolError(
                f"not an HTTP/1.1 reply from the daemon: {lines[0][:80]!r}") from None
        self.reason = reason[0] if reason else b""
        for line in lines[1:]:
            name, sep, value = line.partition(b":")
            if not sep:
                raise httpx.RemoteProtocolError(f"malformed header in the daemon's reply: {line[:80]!r}")
            value = value.strip()
            self.headers.append((name, value))
            lower = name.lower()
            if lower == b"content-length":
                self._length = int(value)
            elif lower == b"transfer-encoding":
                self._chunked = value.lower() == b"chunked"
            elif lower == b"connection" and value.lower() == b"close":
                self.keep_alive = False
        if self._head_only or self.status in _NO_BODY or self.status < 200:
            self._length, self._chunked = 0, False
        elif not self._chunked and self._length is None:
            self._to_eof = True

    def _body_done(self) -> bool:
        buf = self._buf
        if self._to_eof:
            return False
        if not self._chunked:
            assert self._length is not None
            if len(buf) < self._length:
                return False
            self._body += buf[:self._length]
            if len(buf) > self._length:  # nothing may follow a reply we did not ask for
                self.keep_alive = False
            del buf[:]
            return True
        while True:  # chunked: SIZE\r\nDATA\r\n ... 0\r\n(trailers)\r\n
            end = buf.find(b"\r\n")
            if end < 0:
                return False
            try:
                size = int(bytes(buf[:end]).split(b";", 1)[0], 16)
            except ValueError:
                raise httpx.RemoteProtocolError("malformed chunk in the daemon's reply") from None
            if size == 0:  # the last chunk: done after its (empty) trailer section
                return buf.find(b"\r\n\r\n", end) >= 0
            if len(buf) < end + 2 + size + 2:
                return False
            self._body += buf[end + 2:end + 2 + size]
            del buf[:end + 2 + size + 2]

    def response(self, request: LeanRequest) -> httpx.Response:
        """The reply as httpx's :class:`~httpx.Response`, its body read.

        Built on a stream whose body is set as read: ``content=``, or ``read()``, pass
        the bytes through httpx's decoder and chunker (15-20 us a call, as much as the
        rest of the reply's parse). A reply with a ``content-encoding`` (never the
        daemon's) is read by httpx, which decodes it."""
        body = bytes(self._body)
        response = LeanResponse(
            request, self.status, headers=self.headers, stream=httpx.ByteStream(body),
            extensions={"http_version": b"HTTP/1.1", "reason_phrase": self.reason},
        )
        if any(name.lower() == b"content-encoding" for name, _ in self.headers):
            response.read()
        else:
            response._content = body  # what read() sets
            response.is_stream_consumed = response.is_closed = True
        return response


class LeanResponse(httpx.Response):
    """An :class:`httpx.Response` whose ``request`` is built only if asked for (error
    messages quote its method and path; building it costs as much as parsing the reply)."""

    def __init__(self, lean: LeanRequest, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._lean = lean

    @property
    def request(self) -> httpx.Request:
        if self._request is None:
            self._request = httpx.Request(self._lean.method, self._lean.url)
        return self._request

    @request.setter
    def request(self, value: httpx.Request) -> None:
        self._request = value
