# Generated from _async/_lean.py by scripts/gen_sync.py: edit that file, not this one.
# ruff: noqa: I001  (the imports keep the source's order, sorted for _async)
"""Whole replies on the daemon's Unix socket, over connections kept open (client/_wire.py).

Each connection is checked like httpx's (:func:`corral.client._unix.check_peer`: root or
this user serves it) when it is opened; one that the daemon closed while it was idle is
dropped before use. Transport failures are httpx's own exceptions, so
:func:`corral.client._transport.daemon_errors` reports them as for any other request.
"""

from __future__ import annotations

import os
import time
from collections import deque

import httpcore
import httpx

from corral.client._unix import UnixBackend
from corral.client._wire import LeanRequest, Reply

IDLE_S = 60.0
"""How long an idle connection is kept (the daemon keeps its end for 300 s)."""
MAX_IDLE = 64  # as the httpx pool's max_keepalive_connections
_READ_BYTES = 64 << 10


def _translated(exc: Exception) -> httpx.TransportError:
    """httpx's exception of the same name (ConnectError, ReadTimeout, ...)."""
    kind = getattr(httpx, type(exc).__name__, None)
    if not (isinstance(kind, type) and issubclass(kind, httpx.TransportError)):
        kind = httpx.TransportError
    return kind(str(exc) or type(exc).__name__)


class LeanPool:
    """Connections to one Unix socket for requests of :class:`~corral.client._wire.LeanRequest`."""

    def __init__(self, uds: str) -> None:
        self._uds = uds
        self._backend = UnixBackend()
        self._idle: deque[tuple[float, httpcore.NetworkStream]] = deque()
        self._pid = os.getpid()  # a forked child must not share its parent's connections
        self._closed = False

    def send(self, request: LeanRequest) -> httpx.Response:
        """Send ``request`` and read its reply whole."""
        timeout = request.timeout
        try:
            stream = self._take(timeout.connect)
        except (httpcore.NetworkError, httpcore.TimeoutException) as exc:
            raise _translated(exc) from exc
        reply = Reply(request.method)
        try:
            try:
                stream.write(request.data, timeout.write)
            except httpcore.WriteError:  # it may have answered (413) and hung up: read on
                reply.keep_alive = False
            while not reply.feed(stream.read(_READ_BYTES, timeout.read)):
                pass
        except (httpcore.NetworkError, httpcore.TimeoutException) as exc:
            stream.close()
            raise _translated(exc) from exc
        except BaseException:  # cancelled, or a reply that is no HTTP: never reused
            stream.close()
            raise
        if reply.keep_alive and not self._closed and len(self._idle) < MAX_IDLE:
            self._idle.append((time.monotonic(), stream))
        else:
            stream.close()
        return reply.response(request)

    def _take(self, timeout: float | None) -> httpcore.NetworkStream:
        if os.getpid() != self._pid:
            self._idle.clear()  # the parent's: left to it, unused and unclosed here
            self._pid = os.getpid()
        now = time.monotonic()
        while True:
            try:
                used, stream = self._idle.pop()  # the last used: the likeliest to be warm
            except IndexError:
                break
            # readable while idle: the daemon closed it (or sent what nobody asked for)
            if now - used < IDLE_S and not stream.get_extra_info("is_readable"):
                return stream
            stream.close()
        return self._backend.connect_unix_socket(self._uds, timeout)

    def close(self) -> None:
        """Close the idle connections; those in use close when their reply is read."""
        self._closed = True
        while self._idle:
            self._idle.pop()[1].close()
