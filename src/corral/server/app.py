"""The ASGI application: routes, error replies, and the guard in front of them.

:func:`create_app` builds a fresh app around an open :class:`~corral.runtime.engine.Engine`;
nothing is kept at module level. Every error a client sees has the shape
``{"error": {"code", "message", "details"}}``:

- a :class:`~corral.errors.CorralError` gets its own ``status`` and ``to_dict()``;
- an unknown route gets 404 ``not_found``, a wrong method 405 ``method_not_allowed``;
- anything else is logged with its traceback and the client gets 500 ``internal``.

Who a request is comes from one place, the door (:mod:`corral.server.door`): the Unix
socket is the admin; TCP clients send ``Authorization: Bearer TOKEN``, or what their
front-end's client sends (SandboxFusion's token in the path, E2B's ``X-API-KEY`` and
per-sandbox ``X-Access-Token``). The token is checked from the headers alone: a
refused request's body is never read, and its connection is closed. The request then
runs as its :class:`~corral.server.caller.Caller`, and is cancelled at once if its
token is revoked or its dashboard session ends. What a request may cost before and
after that is bounded in :mod:`corral.server.limits` (per-client requests in flight:
``max_client_requests``).
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field

import anyio
from starlette.applications import Starlette
from starlette.exceptions import HTTPException
from starlette.middleware import Middleware
from starlette.requests import ClientDisconnect, Request
from starlette.responses import JSONResponse, Response
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from corral.errors import CorralError, Forbidden, InternalError, TooManyRequests, Unauthorized
from corral.runtime.engine import Engine
from corral.server import expose, metrics, node_proof, port_socket
from corral.server.accesslog import AccessLog
from corral.server.admission import Admission, Limits
from corral.server.auth_throttle import AuthThrottle, retry_headers
from corral.server.caller import CALLER_KEY, UNIDENTIFIED, Caller
from corral.server.cluster_tenants import open_tenancy
from corral.server.coalesce import FLUSH_KEY
from corral.server.compat import e2b_api as e2b_compat
from corral.server.compat import e2b_door, e2b_fork
from corral.server.compat import sandboxfusion as sandboxfusion_compat
from corral.server.compat import tensorlake as tensorlake_compat
from corral.server.conn_limits import client_key, mark_authenticated
from corral.server.door import Door
from corral.server.endpoints import build_routes
from corral.server.leases import Leases
from corral.server.limits import ClientLimiter, too_many
from corral.server.ops_routes import open_logs
from corral.server.peer_auth import PeerCredential
from corral.server.quotas import Quotas, snapshot_quota
from corral.server.revocation import Revocation
from corral.server.route_index import IndexedRouter
from corral.server.sandbox_verbs import SandboxVerbs
from corral.server.service import SandboxService
from corral.server.settings import ServerSettings
from corral.server.stream_limits import StreamBook, StreamLimits
from corral.server.tenants import Tenants, TokenStore
from corral.server.ui import mount as mount_dashboard
from corral.server.wire import ReplyCut, error_response

logger = logging.getLogger("corral.server")


@dataclass
class Activity:
    """When the daemon last served a request, and how many are in flight (for idle exit)."""

    in_flight: int = 0
    last: float = field(default_factory=time.monotonic)

    def idle_for(self) -> float:
        """Seconds since the last request ended; 0 while one is in flight."""
        return 0.0 if self.in_flight else time.monotonic() - self.last


def _http_error(request: Request, exc: Exception) -> Response:
    assert isinstance(exc, HTTPException)
    where = f"{request.method} {request.url.path}"
    if exc.status_code == 404:
        code, message = "not_found", f"no route {where}: see GET /openapi.json for the API"
    elif exc.status_code == 405:
        allowed = _allowed_methods(request)
        code, message = "method_not_allowed", f"{where} is not allowed: see GET /openapi.json"
        body = {"error": {"code": code, "message": message, "details": {"allow": allowed}}}
        return JSONResponse(body, status_code=405, headers={"Allow": ", ".join(allowed)})
    else:
        code, message = "http_error", f"{where}: {exc.detail}"
    body = {"error": {"code": code, "message": message, "details": {}}}
    return JSONResponse(body, status_code=exc.status_code, headers=exc.headers)


def _allowed_methods(request: Request) -> list[str]:
    """Every method some route serves at the request's path (Starlette names only the
    first route that matched the path)."""
    allowed: set[str] = set()
    for route in request.app.router.routes:
        regex, methods = getattr(route, "path_regex", None), getattr(route, "methods", None)
        if regex is not None and methods and regex.match(request.url.path):
            allowed |= methods
    return sorted(allowed)


def _corral_error(request: Request, exc: Exception) -> Response:
    assert isinstance(exc, CorralError)
    # A refused or stalled upload may still be arriving: hang up rather than read it all.
    return error_response(exc, {"Connection": "close"} if exc.status in (408, 413) else None)


class Guard:
    """Outermost middleware: the door (who the caller is), activity, the calls a
    credential has open, and the last line against crashes."""

    def __init__(
        self, app: ASGIApp, *, door: Door, activity: Activity, clients: ClientLimiter,
        throttle: AuthThrottle,
    ) -> None:
        self.app = app
        self.door = door  # who a credential is, and what it has open (server/door.py)
        self.activity = activity
        self.clients = clients
        self.throttle = throttle  # wrong credentials cost time (auth_throttle.py)

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "websocket":  # an exposed port's (server/expose.py)
            if (exp := self._exposure(scope)) is not None:  # held under its token
                with anyio.CancelScope() as call, \
                        self.door.calls.holding(exp.holder(), call.cancel):
                    await expose.relay(scope, receive, send)
            elif port_socket.match(scope) is not None:  # or a port socket's (port_socket.py)
                await self._port_socket(scope, receive, send)
            else:
                await send({"type": "websocket.close", "code": 1008})
            return
        if scope["type"] != "http":  # lifespan is off: no such thing
            return
        self.activity.in_flight += 1
        started = False

        flush = scope.get(FLUSH_KEY)

        async def tracked_send(message: Message) -> None:
            nonlocal started
            started = True
            await send(message)
            if flush is not None and message["type"] == "http.response.body" \
                    and not message.get("more_body"):
                flush()  # the reply leaves now, not after the handler's unwinding

        client = None
        try:
            on_socket = self.door.on_socket(scope)
            # an IPv6 client is its /64 (conn_limits.client_key); on the socket: unused
            address = "" if on_socket else client_key(str((scope.get("client") or ("?",))[0]))
            # an exposed port's own token, else the door (both put the caller in the scope)
            exposure = self._exposure(scope)
            exposed = exposure is not None
            # what the door will check (an exposed port's traffic is the sandbox app's own)
            credential = None if exposed else self.door.presented(scope)
            slow = None if on_socket else self.throttle.refusal(address, credential)
            if slow is not None:  # a guesser: refused before its credential is checked
                await error_response(slow, retry_headers(slow))(scope, receive, send)
                return
            caller = UNIDENTIFIED if exposed else self.door.authenticate(scope)
            if not on_socket and not exposed:  # (auth_throttle.py)
                self._count(scope, address, credential, caller)
            if not isinstance(caller, Caller):  # its body is never read: hang up after the reply
                headers = {"WWW-Authenticate": "Bearer", "Connection": "close"}
                reply = (e2b_door.refusal(scope, caller, headers)  # E2B's shape if E2B's
                         if isinstance(caller, Unauthorized) else None)
                await (reply or error_response(caller, headers))(scope, receive, send)
                return
            if caller is not UNIDENTIFIED:
                mark_authenticated(scope)  # its connection is no stranger now (conn_limits)
            if not on_socket:
                client = (scope.get("client") or ("?",))[0]
                if not self.clients.enter(client):
                    refusal = TooManyRequests(**too_many(client, self.clients.limit))
                    client = None
                    headers = {"Retry-After": "1", "Connection": "close"}
                    await error_response(refusal, headers)(scope, receive, send)
                    return
            app = expose.relay if expose.KEY in scope else self.app  # an exposed port's
            if not exposed and port_socket.match_handoff(scope) is not None:  # handed over
                app = self._handoff
            # the caller is in the scope (caller_of): handlers pass it on explicitly
            held = caller if exposure is None else exposure.holder()  # (its token's)
            with anyio.CancelScope() as call, self.door.calls.holding(held, call.cancel):
                await app(scope, receive, tracked_send)
            if call.cancelled_caught and not started:  # streams just end (the connection too)
                await error_response(_revoked(), {"Connection": "close"})(scope, receive, send)
        except ClientDisconnect:
            logger.debug("client left during %s %s", scope["method"], scope["path"])
        except ReplyCut as exc:  # part-way through a streamed reply (a file that shrank)
            logger.warning("%s %s ended part-way: %s", scope["method"], scope["path"], exc)
        except Exception:
            logger.exception("unexpected error serving %s %s", scope["method"], scope["path"])
            if not started:
                err = InternalError("internal error in the corral daemon; see its log")
                await error_response(err)(scope, receive, send)
        finally:
            if client is not None:
                self.clients.leave(client)
            self.activity.in_flight -= 1
            self.activity.last = time.monotonic()

    async def _port_socket(self, scope: Scope, receive: Receive, send: Send) -> None:
        """A WebSocket to a port of the caller's sandbox: through the door like any
        request (throttled, authenticated, held under the caller's credential)."""
        on_socket = self.door.on_socket(scope)
        address = client_key(str((scope.get("client") or ("?",))[0]))
        credential = self.door.presented(scope)
        if not on_socket and self.throttle.refusal(address, credential) is not None:
            await send({"type": "websocket.close", "code": port_socket.POLICY})
            return
        caller = self.door.authenticate(scope)
        if not on_socket:
            self._count(scope, address, credential, caller)
        if not isinstance(caller, Caller):
            await send({"type": "websocket.close", "code": port_socket.POLICY})
            return
        if caller is not UNIDENTIFIED:
            mark_authenticated(scope)
        state = scope["app"].state  # Starlette's own, set before its middleware runs
        verbs = SandboxVerbs(state.engine, caller)  # the service layer, for this caller
        self.activity.in_flight += 1
        try:
            with anyio.CancelScope() as call, self.door.calls.holding(caller, call.cancel):
                await port_socket.serve(scope, receive, send, verbs, state.streams)
        except Exception:
            logger.exception("unexpected error relaying %s", scope["path"])
        finally:
            self.activity.in_flight -= 1
            self.activity.last = time.monotonic()

    async def _handoff(self, scope: Scope, receive: Receive, send: Send) -> None:
        state = scope["app"].state  # Starlette's own, set before its middleware runs
        verbs = SandboxVerbs(state.engine, scope[CALLER_KEY])  # the service layer
        await port_socket.handoff(scope, receive, send, verbs, state.streams)

    def _count(self, scope: Scope, address: str, credential: str | None,
               caller: Caller | CorralError) -> None:
        if isinstance(caller, Caller) and caller is not UNIDENTIFIED:
            self.throttle.succeeded(address, credential)
        elif not isinstance(caller, Forbidden):  # a good credential on the wrong route
            self.throttle.failed(address, credential)

    def _exposure(self, scope: Scope) -> expose.Exposure | None:
        """An exposed port's request (server/expose.py): by its URL's token, or E2B's
        get_host (Host ``PORT-ID.domain`` with a live traffic token of the sandbox's,
        checked by the door)."""
        exp = expose.lift(scope, e2b_door.traffic_target(scope, self.door.opens))
        if exp is not None:
            scope[CALLER_KEY] = UNIDENTIFIED  # sees nothing; the relay acts for the port
        return exp


def _revoked() -> Unauthorized:
    return Unauthorized(
        "the token of this request was revoked, or its dashboard session ended, while it ran"
    )


def create_app(settings: ServerSettings, engine: Engine) -> Starlette:
    """The HTTP API of one daemon around an open engine (see docs/api.md).

    ``app.state`` holds ``settings``, ``engine``, ``admission``, ``pools`` (the warm
    pools, whose refills pass admission control; close them before the engine) and
    ``activity`` and ``logs`` (close it after the engine).
    """
    activity = Activity()
    cluster = open_tenancy(settings, engine)  # on a Ray cluster: the cluster's tenants
    tenants = Tenants(cluster.store if cluster else TokenStore(engine.registry.db), settings.token)
    door = Door(tenants, token=settings.token, unix_socket=str(settings.socket.absolute()),
                peer=PeerCredential(settings.peer_token),
                extractors=[sandboxfusion_compat.credentials, e2b_door.credentials])
    engine.owners.require_caller()  # from now on, engine code acting for nobody raises
    # shared with the cwsandbox gRPC port (compat/cwsandbox_guard.py): one edge
    throttle = AuthThrottle()
    streams = StreamBook(settings.max_session_streams, settings.max_tenant_streams)
    app = Starlette(
        routes=build_routes(),
        middleware=[
            *([Middleware(AccessLog)] if settings.log_format == "json" else []),
            Middleware(
                Guard,
                door=door,
                activity=activity,
                clients=ClientLimiter(settings.max_client_requests),
                throttle=throttle,
            ),
            Middleware(StreamLimits, book=streams),  # live streams per session and tenant
            # E2B's requests, marked by the guard
            Middleware(e2b_compat.Dispatch, extra=e2b_fork.CONTROL),
        ],
        exception_handlers={HTTPException: _http_error, CorralError: _corral_error},
    )
    app.router = IndexedRouter(app.router.routes)  # a few candidates per request (route_index.py)
    limits = Limits(
        max_starting=settings.max_starting,
        max_sandboxes=settings.max_sandboxes,
        max_memory_mb=settings.max_memory_mb,
        queue_size=settings.queue_size,
        queue_timeout=settings.queue_timeout,
    )
    app.state.settings = settings
    app.state.engine = engine
    app.state.activity = activity
    app.state.tenants = tenants
    app.state.door = door
    app.state.throttle, app.state.streams = throttle, streams
    admission = Admission(limits, cluster.quotas(tenants.quota_of) if cluster
                          else Quotas(tenants.quota_of))
    service = app.state.service = SandboxService(
        engine, admission, tenants, max_lifetime=settings.max_lifetime)
    app.state.admission, app.state.pools = service.admission, service.pools
    engine.snapshots.quota_of = snapshot_quota(tenants.quota_of)  # server/quotas.py
    engine.lifetime_cap = service.lifetime_left  # a hibernated sandbox resumes within it
    engine.output_budget = settings.output_budget()  # commands' output in memory
    app.state.cluster_tenancy = cluster  # its refresh runs with the daemon (daemon.py)
    revocation = app.state.revocation = Revocation(door, service, settings.on_revoke)
    if cluster is not None:  # a revoke made on another node ends things here too
        cluster.on_revoked = revocation
    expose.mount(app, engine)  # and exposed ports at /expose/<token>/ (server/expose.py)
    app.state.logs = open_logs(settings, engine)  # commands and lifecycle, kept (ops_routes)
    app.state.leases = service.leases = Leases(engine.registry.db, engine)  # server/leases.py
    tensorlake_compat.mount(app)  # Tensorlake's API on the same listeners (compat/)
    sandboxfusion_compat.mount(app)  # and SandboxFusion's /run_code, /run_jupyter
    e2b_compat.mount(app)  # and E2B's API and envd (e2b_compat.Dispatch routes them)
    mount_dashboard(app)  # and the dashboard at /ui (corral.server.ui)
    node_proof.mount(app, settings)  # on a cluster: proves who it is, ahead of any guard
    if settings.metrics:
        metrics.mount(app)  # GET /metrics, fed by the engine's and the service's events
    return app
