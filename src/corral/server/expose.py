"""Exposed ports: an HTTP or WebSocket service inside a sandbox, reached through the
daemon at a URL that carries its own access token (docs/network.md).

``POST /v1/sandboxes/{id}/ports {"port": 8000}`` (the sandbox's owner) gives back
``{"port", "token", "url"}``; ``url`` is ``<daemon>/expose/<token>/``. Whoever holds
that URL (a grader, a browser, a WebSocket client) reaches that one port of that one
sandbox, and nothing else: the token is 256 random bits, looked up by its digest; it
dies with the sandbox. The daemon dials the port itself, inside the sandbox's network
namespace (:meth:`corral.runtime.engine.Engine.connect_port`), so it works with
``network="none"`` and the sandbox gains no way out.

Requests are relayed as HTTP/1.1 (``h11``) with ``Connection: close`` and ``Host:
localhost:<port>``, bodies up to the daemon's upload limit; responses stream back.
"""

from __future__ import annotations

import asyncio
import hashlib
import secrets
from collections.abc import AsyncIterator, Iterator
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import h11
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse
from starlette.types import Receive, Scope, Send
from starlette.websockets import WebSocket, WebSocketDisconnect

from corral.api.models import ExposeRequest
from corral.errors import CorralError, FileTooLarge, InvalidState
from corral.runtime.engine import Engine
from corral.runtime.events import SandboxEnded
from corral.server import context as ctx
from corral.server.caller import UNIDENTIFIED, Caller, caller_of
from corral.server.caller import Scope as Access
from corral.server.tenant_model import ADMIN_NAME, Tenant
from corral.server.wire import error_response, paced
from corral.server.ws_flow import SPENT, TRY_LATER, UP_REFUSAL, Relayed

if TYPE_CHECKING:
    from websockets.asyncio.client import ClientConnection

PREFIX = "/expose/"
MAX_PORTS = 64  # exposed at once per sandbox
WS_MAX_MESSAGE = 1 << 24  # bytes of one message from the sandbox's WebSocket server
# A client's message to the sandbox is bounded by uvicorn's ws_max_size, the same 16 MiB
# (kept: it is the port socket's too, and each relay holds one at a time, in its
# tenant's output budget); one larger than this goes in fragments of this size, each
# written once the sandbox's server took the last (not a masked copy of it all)
WS_FRAGMENT = 1 << 16
# (``expect``: the daemon answers a client's ``Expect: 100-continue`` itself, once the
# relay first reads the body (uvicorn); the sandbox's server gets the body as it comes)
_HOP = {b"connection", b"keep-alive", b"proxy-connection", b"te", b"trailer", b"upgrade",
        b"transfer-encoding", b"host", b"content-length", b"proxy-authorization",
        b"expect"}




@dataclass(frozen=True)
class Exposure:
    sandbox_id: str
    port: int
    owner: str | None  # the tenant the sandbox belongs to (None: the admin's)
    token_id: str = ADMIN_NAME  # the token that exposed it: the URL dies with it

    def holder(self) -> Caller:
        """Who a relay is held under (``Door.calls``): the exposing token, so that its
        revoke ends the relays in flight (the admin's cannot be revoked)."""
        if self.token_id == ADMIN_NAME:
            return UNIDENTIFIED
        return Caller(Tenant(""), self.token_id, Access.TENANT)


# Every relayed page gets an opaque origin of its own: it is served from the daemon's
# origin, where the dashboard's session cookie lives, so a sandbox's scripts would
# otherwise read and drive the dashboard of whoever opens the page (the admin). Scripts,
# forms, popups and the page's WebSockets still work. Added to the server's own header,
# if any: a browser enforces both, so the sandbox cannot lift it.
ISOLATE = (b"content-security-policy",
           b"sandbox allow-scripts allow-forms allow-popups allow-modals allow-downloads "
           b"allow-pointer-lock")


# A relayed page shares the daemon's origin (or, E2B's get_host, a host below its
# domain): a cookie it set for the whole origin reached the dashboard (``/ui``): a
# tenant's page set its own dashboard session there, and the admin who opened it was
# logged into the dashboard as that tenant (tests/security/test_expose_cookie_toss.py).
_ORIGIN_WIDE = {b"clear-site-data"}  # it would drop the dashboard's session too


def _own_cookie(value: bytes, own: bytes) -> bool:
    """Whether a relayed ``Set-Cookie`` stays within the exposure: no ``Domain`` (a
    parent domain holds the daemon), and under ``/expose/<token>/`` every ``Path``
    within ``own`` (none: the page's own directory). E2B's host (``own`` ``/``) is a
    host of its own: any path."""
    for attr in value.split(b";")[1:]:
        name, _, arg = attr.partition(b"=")
        name = name.strip().lower()
        if name == b"domain" or (name == b"path" and own != b"/"
                                 and not (arg.strip() + b"/").startswith(own)):
            return False
    return True


def _digest(token: str) -> bytes:
    return hashlib.sha256(token.encode()).digest()


class Exposures:
    """The access tokens of exposed ports, by digest; a sandbox's die with it."""

    def __init__(self, engine: Engine) -> None:
        self._by_digest: dict[bytes, Exposure] = {}
        self._tokens: dict[tuple[str, int], str] = {}
        engine.events.subscribe(SandboxEnded, self._ended)

    def _ended(self, event: SandboxEnded) -> None:
        for key in [k for k in self._tokens if k[0] == event.sandbox_id]:
            self._by_digest.pop(_digest(self._tokens.pop(key)), None)

    def add(self, sandbox_id: str, port: int, owner: str | None,
            token_id: str = ADMIN_NAME) -> str:
        if (token := self._tokens.get((sandbox_id, port))) is not None:
            if self._by_digest[_digest(token)].token_id == token_id:
                return token
            self._by_digest.pop(_digest(self._tokens.pop((sandbox_id, port))))  # (another
            # token's: a URL of its own, which dies with it)
        if sum(k[0] == sandbox_id for k in self._tokens) >= MAX_PORTS:
            raise CorralError(f"sandbox {sandbox_id} has {MAX_PORTS} ports exposed already")
        token = secrets.token_urlsafe(32)
        self._tokens[(sandbox_id, port)] = token
        self._by_digest[_digest(token)] = Exposure(sandbox_id, port, owner, token_id)
        return token

    def find(self, token: str) -> Exposure | None:
        return self._by_digest.get(_digest(token))


def exposures(app: Starlette) -> Exposures:
    return app.state.exposures  # type: ignore[no-any-return]


KEY = "corral.exposure"  # scope key: the Exposure a request is for (set by the guard)
PREFIX_KEY = "corral.exposure_prefix"  # and the part of its path that named it


def lift(scope: Scope, by_host: tuple[str, int, str] | None = None) -> Exposure | None:
    """The exposure a request is for, marked on its scope: a path ``/expose/<token>/...``
    whose token is valid, or ``by_host`` (a sandbox, port and token id a front-end
    authenticated: E2B's ``get_host``; its relays are held under that token). The guard lets only these through without a bearer token."""
    path: str = scope.get("path", "")
    app = scope["app"]
    if path.startswith(PREFIX):
        token = path[len(PREFIX):].split("/", 1)[0]
        exp = exposures(app).find(token) if token else None
        if exp is not None and app.state.door.by_token_id(exp.token_id) is None:
            exp = None  # the token that exposed it was revoked
        prefix = len(PREFIX) + len(token)
    elif by_host is not None:
        info = app.state.engine.registry.get(by_host[0])
        exp = None if info is None else Exposure(*by_host[:2], info.spec.tenant, by_host[2])
        prefix = 0
    else:
        return None
    if exp is not None:
        scope[KEY], scope[PREFIX_KEY] = exp, prefix
    return exp


async def expose_port(request: Request, body: ExposeRequest) -> Response:
    """``POST /v1/sandboxes/{id}/ports``: the caller's own running sandbox only."""
    sid = request.path_params["sandbox_id"]
    info = ctx.sandboxes(request).get(sid)  # SandboxNotFound for another tenant's
    if info.state.terminal:
        raise InvalidState(f"sandbox {sid} is {info.state.value}: a port of a running "
                           "sandbox can be exposed", details={"sandbox_id": sid})
    token = exposures(request.app).add(sid, body.port, info.spec.tenant,
                                       caller_of(request).token_id)
    url = f"{str(request.base_url).rstrip('/')}{PREFIX}{token}/"
    return JSONResponse({"port": body.port, "token": token, "url": url}, status_code=201)


async def _connect(engine: Engine, exp: Exposure) -> tuple[asyncio.StreamReader,
                                                          asyncio.StreamWriter]:
    sock = await engine.connect_port(exp.sandbox_id, exp.port, owner=exp.owner)
    return await asyncio.open_connection(sock=sock)


def _target(scope: Scope) -> bytes:
    """The request's target as the sandbox's server sees it: its path (as sent, still
    percent-encoded) past the ``/expose/<token>`` part, and its query."""
    raw: bytes = scope.get("raw_path") or scope["path"].encode()
    path = b"/" + raw[scope[PREFIX_KEY]:].lstrip(b"/")
    query = scope.get("query_string", b"")
    return path + (b"?" + query if query else b"")


def _framing(request: Request, limit: int) -> tuple[bytes, bytes]:
    """The relayed request's body framing: the client's length (refused past
    ``limit``), or chunks, or no body."""
    length = request.headers.get("content-length")
    if length is not None:
        if not length.isdigit() or int(length) > limit:
            raise FileTooLarge(f"the request body is over the daemon's upload limit ({limit} "
                               "bytes)")
        return b"content-length", length.encode()
    if "chunked" in request.headers.get("transfer-encoding", "").lower():
        return b"transfer-encoding", b"chunked"
    return b"content-length", b"0"


async def _send_body(request: Request, conn: h11.Connection, writer: asyncio.StreamWriter,
                     limit: int) -> None:
    """The client's body to the sandbox's server as it comes: the daemon holds a piece
    at a time (it held the whole body, up to ``--max-upload-bytes``, per relay), and
    cuts it (408) once no piece comes for a while, as every body the daemon reads: a
    client that stopped sending held its relay, and its tenant's stream, for good."""
    sent = 0
    async for chunk in paced(request):
        sent += len(chunk)
        if sent > limit:
            raise FileTooLarge(f"the request body is over the daemon's upload limit ({limit} "
                               "bytes)")
        if chunk:
            writer.write(conn.send(h11.Data(data=chunk)))
            await writer.drain()
    writer.write(conn.send(h11.EndOfMessage()))
    await writer.drain()


async def relay_http(request: Request) -> Response:
    exp: Exposure = request.scope[KEY]
    engine = ctx.engine(request)
    limit = ctx.settings(request).max_upload_bytes
    framing = _framing(request, limit)
    reader, writer = await _connect(engine, exp)
    conn = h11.Connection(h11.CLIENT)
    headers = [(k, v) for k, v in request.headers.raw if k.lower() not in _HOP]
    headers += [(b"host", b"localhost:%d" % exp.port), (b"connection", b"close"), framing]
    try:
        writer.write(conn.send(h11.Request(method=request.method.encode(),
                                           target=_target(request.scope), headers=headers)))
        await _send_body(request, conn, writer, limit)
    except BaseException:
        writer.close()
        raise
    try:  # (a 1xx before the response, a 100 Continue or a 103 Early Hints: skipped)
        while isinstance(head := await _next_event(conn, reader), h11.InformationalResponse):
            pass
    except h11.RemoteProtocolError:  # it closed, or sent what is not HTTP
        head = None
    if not isinstance(head, h11.Response):
        writer.close()
        raise CorralError(f"the server on port {exp.port} sent no HTTP response")

    async def stream() -> AsyncIterator[bytes]:
        try:
            while isinstance(event := await _next_event(conn, reader), h11.Data):
                yield bytes(event.data)
        except h11.RemoteProtocolError:
            pass  # it broke off: the response ends there
        finally:
            writer.close()

    own = request.url.path[:request.scope[PREFIX_KEY]].encode() + b"/"
    out = [(k, v) for k, v in head.headers if k.lower() not in _HOP | _ORIGIN_WIDE
           and (k.lower() != b"set-cookie" or _own_cookie(v, own))] + [ISOLATE]
    response = StreamingResponse(stream(), status_code=head.status_code)
    response.raw_headers = out
    return response


async def _next_event(conn: h11.Connection, reader: asyncio.StreamReader) -> object:
    while True:
        event = conn.next_event()
        if event is h11.NEED_DATA:
            try:
                data = await reader.read(1 << 16)
            except OSError:  # reset by the server (its sandbox ended): as if it closed
                data = b""
            conn.receive_data(data)
            continue
        return event


def _fragments(data: bytes | str) -> bytes | str | Iterator[bytes | str]:
    """A client's message as ``websockets`` sends it to the sandbox: whole, or past
    :data:`WS_FRAGMENT` in fragments, each written as the last one left."""
    if len(data) <= WS_FRAGMENT:
        return data
    return (data[at:at + WS_FRAGMENT] for at in range(0, len(data), WS_FRAGMENT))


async def _up(websocket: WebSocket, upstream: ClientConnection, held: Relayed) -> None:
    """The client's messages to the sandbox's server. Each waits in the daemon until
    that server has taken it (the client not read meanwhile: ``ws_flow.py``), held in
    the tenant's output budget (:class:`~corral.server.ws_flow.Relayed`); when the
    budget has no room, the relay ends (1013) with :data:`UP_REFUSAL`."""
    from websockets.exceptions import ConnectionClosed

    try:
        while True:
            msg = await websocket.receive()
            if msg["type"] == "websocket.disconnect":
                break
            data = msg["bytes"] if msg.get("bytes") is not None else msg.get("text", "")
            del msg  # (nothing else keeps it while it is sent: what Inbound counts)
            if not held.took(len(data)):
                await websocket.close(code=TRY_LATER, reason=UP_REFUSAL)
                return
            await upstream.send(_fragments(data))
            del data
            held.sent()
    except (WebSocketDisconnect, ConnectionClosed):
        pass
    finally:
        held.release()
    await upstream.close()


async def relay_websocket(websocket: WebSocket) -> None:
    from websockets.asyncio.client import connect
    from websockets.exceptions import ConnectionClosed, InvalidHandshake, InvalidMessage

    exp: Exposure = websocket.scope[KEY]
    engine: Engine = websocket.app.state.engine
    try:
        sock = await engine.connect_port(exp.sandbox_id, exp.port, owner=exp.owner)
    except CorralError:
        await websocket.close(code=1011)
        return
    uri = f"ws://localhost:{exp.port}{_target(websocket.scope).decode()}"
    try:
        # max_queue 1: the sandbox is read only as fast as the client takes what it was
        # sent (websockets' default queued 16 messages of up to 16 MiB per relay)
        upstream = await connect(uri, sock=sock, max_size=WS_MAX_MESSAGE, max_queue=1,
                                 open_timeout=10)
    except (OSError, TimeoutError, InvalidHandshake, InvalidMessage):
        sock.close()
        await websocket.close(code=1011)  # the sandbox's server would not speak WebSocket
        return
    async with upstream:
        await websocket.accept()

        async def down() -> None:
            hold = engine.output_budget.hold(exp.owner)
            try:
                async for msg in upstream:
                    # the message waits in the daemon until the client takes it: its
                    # room in the tenant's output budget, or the relay ends (1013)
                    if hold.grow(len(msg)) < len(msg):
                        await websocket.close(code=TRY_LATER, reason=SPENT)
                        return
                    if isinstance(msg, bytes):
                        await websocket.send_bytes(msg)
                    else:
                        await websocket.send_text(msg)
                    hold.shrink(0)
            finally:
                hold.release()
            await websocket.close()

        held = Relayed(websocket.scope, engine.output_budget.hold(exp.owner))
        tasks: list[asyncio.Task[Any]] = [asyncio.create_task(down()), asyncio.create_task(
            _up(websocket, upstream, held))]
        if (gone := held.gone()) is not None:  # (a client that left while _up waits on
            tasks.append(asyncio.ensure_future(gone))  # the sandbox's server)
        try:
            await asyncio.wait(tasks, return_when=asyncio.FIRST_COMPLETED)
        except ConnectionClosed:
            pass
        finally:
            for t in tasks:
                t.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)


async def relay(scope: Scope, receive: Receive, send: Send) -> None:
    """The ASGI app of requests :func:`lift` marked (the guard sends them here).

    Each relay, for as long as it lasts (a streamed response, a WebSocket), counts as a
    live stream of the sandbox's tenant against ``--max-tenant-streams``
    (server/stream_limits.py): whoever holds the URL is the tenant's guest, and a
    WebSocket leaves the daemon's connection book, so without this one tenant's
    sandbox could hold relays, and the daemon's descriptors, without bound."""
    exp: Exposure = scope[KEY]
    streams = getattr(getattr(scope.get("app"), "state", None), "streams", None)
    keys: list[tuple[str, object]] = [("tenant", exp.owner)] if exp.owner else []
    full = streams.take(keys) if keys and streams is not None else None
    if full is not None:
        if scope["type"] == "websocket":
            await send({"type": "websocket.close", "code": 1013})  # try again later
        else:
            await error_response(full, {"Retry-After": "5"})(scope, receive, send)
        return
    try:
        if scope["type"] == "websocket":
            await relay_websocket(WebSocket(scope, receive, send))
            return
        request = Request(scope, receive)
        try:
            response = await relay_http(request)
        except CorralError as exc:
            response = error_response(exc)
        await response(scope, receive, send)
    finally:
        if keys and streams is not None:
            streams.give(keys)


def mount(app: Starlette, engine: Engine) -> None:
    """Keep the exposed ports' tokens on ``app`` (their requests: :func:`relay`)."""
    app.state.exposures = Exposures(engine)
