"""How many live streams one dashboard session, and one tenant, may hold open at once.

A live stream is a reply that stays open while something happens: the dashboard's
server-sent events, a followed log, a command's streamed output, an E2B or Tensorlake
process stream. Each costs the daemon work for as long as it lasts (the dashboard's
redraws every panel every second), so one caller holding hundreds of them slowed
everyone else's requests (400 from one session took the admin's ``/v1/info`` from
69 ms to 2.65 s).

:class:`StreamLimits`, a middleware behind the guard, recognises a live stream by its
reply (a streamed body, no ``Content-Length``, of a streaming media type: so every
front-end is covered without a list of routes) and counts it, until it ends, against:

- its **dashboard session**, at most ``--max-session-streams`` (a browser needs one per
  open tab);
- its **tenant**, at most ``--max-tenant-streams`` (the admin and the Unix socket are
  not counted).

One over a limit is answered 429 ``too_many_requests`` instead, and whatever produced
it is stopped at once (a command it would have streamed is killed, as when a client
hangs up).
"""

from __future__ import annotations

from collections import Counter

from starlette.types import ASGIApp, Message, Receive, Scope, Send

from corral.errors import TooManyRequests
from corral.server.tenants import caller_name
from corral.server.wire import error_response

LIVE_TYPES = (b"text/event-stream", b"application/x-ndjson", b"application/connect+json",
              b"application/connect+proto", b"application/grpc")


class _Refused(Exception):
    """Stops the stream's producer after its refusal was sent."""


def is_live(message: Message) -> bool:
    """Whether a reply's start announces a live stream (see the module docstring)."""
    media, length = b"", False
    for key, value in message.get("headers") or ():
        name = key.lower()
        if name == b"content-type":
            media = value.split(b";")[0].strip().lower()
        elif name == b"content-length":
            length = True
    return not length and media in LIVE_TYPES


class StreamBook:
    """The live streams of one daemon, by session and by tenant."""

    def __init__(self, per_session: int, per_tenant: int) -> None:
        self.per_session = per_session
        self.per_tenant = per_tenant
        self._open: Counter[tuple[str, object]] = Counter()

    def take(self, keys: list[tuple[str, object]]) -> TooManyRequests | None:
        """Count one more stream under every key; the refusal if one is full."""
        for kind, key in keys:
            limit = self.per_session if kind == "session" else self.per_tenant
            if self._open[(kind, key)] >= limit:
                flag = "--max-session-streams" if kind == "session" else "--max-tenant-streams"
                whose = "this dashboard session" if kind == "session" else f"tenant {key}"
                return TooManyRequests(
                    f"{whose} already holds {limit} live streams (the daemon's {flag}): "
                    "close some (a browser tab, a followed log, a streamed command) first",
                    details={"limit": flag.lstrip("-").replace("-", "_"), "value": limit},
                )
        for key in keys:
            self._open[key] += 1
        return None

    def give(self, keys: list[tuple[str, object]]) -> None:
        for key in keys:
            self._open[key] -= 1
            if self._open[key] <= 0:
                del self._open[key]

    def held(self, kind: str, key: object) -> int:
        return self._open.get((kind, key), 0)


def _keys(scope: Scope) -> list[tuple[str, object]]:
    keys: list[tuple[str, object]] = []
    session = (scope.get("state") or {}).get("ui_session")
    if session is not None:
        keys.append(("session", id(session)))  # it lives in the daemon's Sessions meanwhile
    tenant = caller_name(scope)  # None: the admin; "": nobody checked (not counted)
    if tenant:
        keys.append(("tenant", tenant))
    return keys


class StreamLimits:
    """ASGI middleware counting live streams (see the module docstring)."""

    def __init__(self, app: ASGIApp, *, book: StreamBook) -> None:
        self.app = app
        self.book = book

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        held: list[tuple[str, object]] = []
        refused = False

        async def sending(message: Message) -> None:
            nonlocal refused
            if refused:
                raise _Refused()
            if message["type"] == "http.response.start" and is_live(message):
                keys = _keys(scope)
                refusal = self.book.take(keys) if keys else None
                if refusal is not None:
                    refused = True
                    await error_response(refusal, {"Retry-After": "5"})(scope, receive, send)
                    raise _Refused()
                held.extend(keys)
            await send(message)

        try:
            await self.app(scope, receive, sending)
        except _Refused:
            pass
        finally:
            if held:
                self.book.give(held)
