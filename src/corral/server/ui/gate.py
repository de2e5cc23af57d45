"""The dashboard's front door: cookie sessions in, the daemon's own guard behind.

:class:`UiGate` sits outside the daemon's :class:`~corral.server.app.Guard` and sees
only requests under ``/ui``:

- the login form, its script and stylesheet are served without a session;
- ``POST /ui/login`` takes the typed token (a small form body, bounded in size and
  time), asks the guard whether it is good (an internal ``GET /ui/whoami`` carrying
  it as a bearer token), and opens a session (:mod:`corral.server.ui.sessions`);
- every other ``/ui`` request needs a session cookie; the gate removes whatever
  credentials the request carried and hands the guard the session's token, so the
  guard decides exactly as for an API client (a revoked token ends the session);
- a request that changes anything (every method but GET/HEAD) also needs the
  session's CSRF token in ``X-CSRF-Token`` and, when the browser names it, an
  ``Origin`` of this daemon.

Every reply under ``/ui`` gets the security headers of :mod:`corral.server.ui.render`.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import Awaitable, Callable
from http.cookies import SimpleCookie
from urllib.parse import parse_qs, urlsplit

from starlette.datastructures import Headers
from starlette.responses import RedirectResponse, Response
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from corral.errors import CorralError, Forbidden, InvalidArgument, Unauthorized
from corral.server.door import SESSION_KEY, Door
from corral.server.ui.render import SECURITY_HEADERS, page
from corral.server.ui.sessions import (
    COOKIE,
    CSRF_HEADER,
    Session,
    Sessions,
    clear_cookie_header,
    cookie_header,
)
from corral.server.wire import error_response

PREFIX = "/ui"
WHOAMI = "/ui/whoami"
MAX_LOGIN_BODY = 4096
LOGIN_BODY_TIMEOUT_S = 10.0
_CREDENTIALS = (b"authorization", b"x-api-key", b"x-access-token", b"cookie")
SAFE_METHODS = ("GET", "HEAD")

Public = Callable[[Scope, Receive, Send], Awaitable[None]]


def under_ui(path: str) -> bool:
    return path == PREFIX or path.startswith(PREFIX + "/")


def session_id(headers: Headers) -> str | None:
    raw = headers.get("cookie")
    if not raw:
        return None
    jar: SimpleCookie = SimpleCookie()
    try:
        jar.load(raw)
    except Exception:  # a malformed Cookie header is no session
        return None
    morsel = jar.get(COOKIE)
    return morsel.value if morsel is not None else None


def same_origin(scope: Scope, headers: Headers) -> bool:
    """False if the browser says the request came from another site."""
    if headers.get("sec-fetch-site") not in (None, "same-origin", "none"):
        return False
    origin = headers.get("origin")
    if origin is None:
        return True  # not a browser's cross-site request (browsers send Origin on POST)
    host = headers.get("host", "")
    parts = urlsplit(origin)
    return parts.netloc == host and parts.scheme in ("http", "https")


class UiGate:
    """ASGI middleware: see the module docstring."""

    def __init__(self, app: ASGIApp, *, sessions: Sessions, public: Public, door: Door) -> None:
        self.app = app
        self.sessions = sessions
        self.public = public
        self.door = door  # the daemon's door: a session's calls end with the session

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or not under_ui(scope["path"]):
            await self.app(scope, receive, send)
            return
        await self._serve(scope, receive, _with_headers(send))

    async def _serve(self, scope: Scope, receive: Receive, send: Send) -> None:
        path, method = scope["path"], scope["method"]
        headers = Headers(scope=scope)
        if path.startswith(PREFIX + "/static/") or (path == "/ui/login" and method in SAFE_METHODS):
            await self.public(scope, receive, send)
            return
        if path == "/ui/login" and method == "POST":
            await self._login(scope, receive, send, headers)
            return
        sid = session_id(headers)
        session = self.sessions.get(sid)
        if session is None:
            if method in SAFE_METHODS and "text/html" in headers.get("accept", ""):
                reply: Response = RedirectResponse("/ui/login", status_code=303)
            else:
                reply = error_response(Unauthorized(
                    "no dashboard session: log in at /ui/login (the daemon's token, typed once)"
                ))
            await reply(scope, receive, send)
            return
        if method not in SAFE_METHODS:
            if not same_origin(scope, headers) or not session.csrf_ok(headers.get(CSRF_HEADER)):
                refusal = Forbidden(
                    "this dashboard request lacks its session's CSRF token (X-CSRF-Token) or "
                    "came from another site: use the buttons of the page at /ui"
                )
                await error_response(refusal)(scope, receive, send)
                return
            if path == "/ui/logout":
                self._end(sid)
                out = RedirectResponse("/ui/login", status_code=303)
                out.headers["set-cookie"] = clear_cookie_header(secure=_secure(scope))
                await out(scope, receive, send)
                return
        await self._as_session(scope, receive, send, sid, session)

    async def _as_session(
        self, scope: Scope, receive: Receive, send: Send, sid: str | None, session: Session
    ) -> None:
        inner = _bearer_scope(scope, session.token)
        inner["state"] = {**scope.get("state", {}), "ui_session": session}
        inner[SESSION_KEY] = sid  # the door keeps the session's calls under it

        async def watch(message: Message) -> None:
            if message["type"] == "http.response.start" and message["status"] == 401:
                self._end(sid)  # the token no longer opens the daemon
            await send(message)

        await self.app(inner, receive, watch)

    def _end(self, sid: str | None) -> None:
        """Log out: the session goes, and every call it has open (live streams) ends."""
        self.sessions.close(sid)
        if sid:
            self.door.end_session(sid)

    async def _login(self, scope: Scope, receive: Receive, send: Send, headers: Headers) -> None:
        secure = _secure(scope)
        if not same_origin(scope, headers):
            await page("login.html", 403, error="log in from this daemon's own page")(
                scope, receive, send)
            return
        try:
            token = await _read_token(receive, headers)
        except CorralError as exc:
            await page("login.html", exc.status, error=exc.message)(scope, receive, send)
            return
        status = await self._check(scope, token)
        if status // 100 != 2:
            error = ("wrong token: type the daemon's token (--token or CORRAL_TOKEN) or a "
                     "tenant token" if status == 401 else
                     "too many failed logins from here: wait a minute, then try again"
                     if status == 429 else f"the daemon refused the login ({status})")
            await page("login.html", 401 if status == 401 else status, error=error)(
                scope, receive, send)
            return
        sid, _ = self.sessions.open(token)
        out = RedirectResponse("/ui", status_code=303)
        out.headers["set-cookie"] = cookie_header(sid, secure=secure)
        await out(scope, receive, send)

    async def _check(self, scope: Scope, token: str) -> int:
        """The status the daemon's guard gives ``token`` (through ``GET /ui/whoami``)."""
        probe = _bearer_scope(scope, token)
        probe.update(method="GET", path=WHOAMI, raw_path=WHOAMI.encode(), query_string=b"")
        status = 500

        async def nothing() -> Message:
            return {"type": "http.request", "body": b"", "more_body": False}

        async def keep(message: Message) -> None:
            nonlocal status
            if message["type"] == "http.response.start":
                status = message["status"]

        await self.app(probe, nothing, keep)
        return status


def _secure(scope: Scope) -> bool:
    return scope.get("scheme") == "https"


def _bearer_scope(scope: Scope, token: str) -> Scope:
    """A copy of ``scope`` whose only credentials are ``Authorization: Bearer token``."""
    kept = [(k, v) for k, v in scope["headers"] if k.lower() not in _CREDENTIALS]
    return {**scope, "headers": [*kept, (b"authorization", f"Bearer {token}".encode("latin-1"))]}


async def _read_token(receive: Receive, headers: Headers) -> str:
    """The ``token`` field of the login form: a small body, read within a time limit."""
    body = bytearray()

    async def read() -> None:
        while True:
            message = await receive()
            if message["type"] == "http.disconnect":
                raise InvalidArgument("the browser left during the login")
            body.extend(message.get("body", b""))
            if len(body) > MAX_LOGIN_BODY:
                raise InvalidArgument("the login form is too large: send only the token")
            if not message.get("more_body"):
                return

    try:
        await asyncio.wait_for(read(), LOGIN_BODY_TIMEOUT_S)
    except asyncio.TimeoutError:
        raise InvalidArgument("the login form did not arrive in time") from None
    kind = headers.get("content-type", "").split(";")[0].strip()
    token: object = None
    if kind == "application/json":
        try:
            data = json.loads(bytes(body))
            token = data.get("token") if isinstance(data, dict) else None
        except ValueError:
            pass
    else:
        token = next(iter(parse_qs(bytes(body).decode("utf-8", "replace")).get("token", [])), None)
    if not isinstance(token, str) or not token.strip():
        raise InvalidArgument("type the daemon's token into the form")
    try:
        token.strip().encode("latin-1")
    except UnicodeEncodeError:
        raise InvalidArgument("wrong token: a token is plain ASCII") from None
    return token.strip()


def _with_headers(send: Send) -> Send:
    """``send`` adding the dashboard's security headers to the reply."""

    async def sending(message: Message) -> None:
        if message["type"] == "http.response.start":
            have = {k.lower() for k, _ in message.get("headers", [])}
            extra = [(k.encode(), v.encode()) for k, v in SECURITY_HEADERS.items()
                     if k.encode() not in have]
            message = {**message, "headers": [*message.get("headers", []), *extra]}
        await send(message)

    return sending
