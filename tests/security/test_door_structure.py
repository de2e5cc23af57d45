"""One door, proved on the structure (issue 23): every registered HTTP route of every
front-end and every gRPC method resolves its caller through the daemon's one door,
and code that acts without a caller fails closed.

- Every route (native, Tensorlake, SandboxFusion, the dashboard, metrics, the peer
  routes, and E2B's control, envd and Code Interpreter routers) is walked: without a
  credential, or with a wrong one in its front-end's own header, it is refused before
  its handler runs; only the login page and the dashboard's static files are public.
- Every gRPC method, called on the servicer without passing the door's interceptor,
  is UNAUTHENTICATED: the servicer has no guard of its own, it asks the door's.
- Credentials are checked in one module: nothing else calls ``Tenants.identify`` or
  builds a :class:`PeerCredential`.
- The engine's owner rule has no admin default in the daemon: acting for nobody raises.
These run in-process (no root): a fake engine, the app through httpx's ASGI transport.
"""

from __future__ import annotations

import asyncio
import re
from pathlib import Path

import httpx
import pytest
from starlette.routing import Route, Router

import corral.server
from corral.errors import InternalError
from corral.runtime.ownership import UNSET, Owners
from corral.server import ServerSettings, create_app
from corral.server.compat import e2b_api, e2b_interpreter
from tests.server.test_units import FakeEngine

TOKEN = "door-structure-token-" + "x" * 24
PUBLIC = {("GET", "/ui/login")}  # the login form (its static files are under /ui/static/)


def _app():
    return create_app(ServerSettings(token=TOKEN, max_memory_mb=4096), FakeEngine())


def _walk(router: Router) -> list[Route]:
    """Every route of ``router`` and of the routers chained as its fallbacks."""
    found: list[Route] = []
    while isinstance(router, Router):
        found += [r for r in router.routes if isinstance(r, Route)]
        router = router.default  # type: ignore[assignment]
    return found


def _requests(routes: list[Route]) -> list[tuple[str, str]]:
    out = []
    for route in routes:
        path = re.sub(r"\{[^}:]+(:path)?\}", "sb-0123456789ab", route.path)
        for method in sorted(route.methods or ()):
            if method != "HEAD":
                out.append((method, path))
    return out


def _client(app) -> httpx.AsyncClient:
    transport = httpx.ASGITransport(app=app, raise_app_exceptions=False)
    return httpx.AsyncClient(transport=transport, base_url="http://corral")


async def _refused_all(app, requests, headers) -> list[tuple[str, str, int]]:
    async with _client(app) as client:
        let_in = []
        for method, path in requests:
            reply = await client.request(method, path, headers=headers, content=b"{}")
            # 429: the auth throttle (auth_throttle.py) refused the guesser before the door
            if reply.status_code not in (401, 429):
                let_in.append((method, path, reply.status_code))
        return let_in


def test_every_http_route_is_behind_the_door():
    app = _app()
    routes = _walk(app.router)
    requests = [r for r in _requests(routes) if r not in PUBLIC]
    assert len(requests) > 60  # the walk really found the route tables
    fusion = [r for r in requests if r[1].startswith("/sandboxfusion/")]
    others = [r for r in requests if r not in fusion]
    for headers in ({}, {"Authorization": "Bearer wrong"}, {"Authorization": "Basic eA=="}):
        assert asyncio.run(_refused_all(app, others, headers)) == []
    # SandboxFusion's token is in its path: a wrong one is refused in its own words
    async def fusion_refused() -> list:
        async with _client(app) as client:
            return [(m, p, r.status_code) for m, p in fusion
                    if (r := await client.request(m, p, json={})).status_code not in (401, 403, 429)]
    assert asyncio.run(fusion_refused()) == []


def test_every_e2b_route_is_behind_the_door():
    dispatch = e2b_api.Dispatch(app=None)  # type: ignore[arg-type]
    app = _app()
    for kind, headers in (
        ("api", {"X-API-KEY": "wrong"}),
        ("envd", {"E2b-Sandbox-Id": "sb-0123456789ab", "X-Access-Token": "admin.00"}),
        ("jupyter", {"E2b-Sandbox-Id": "sb-0123456789ab", "E2b-Sandbox-Port":
                     e2b_interpreter.PORT, "E2B-Traffic-Access-Token": "admin.00"}),
    ):
        requests = _requests(_walk(dispatch.routers[kind]))
        assert requests, kind
        assert asyncio.run(_refused_all(app, requests, headers)) == [], kind


def test_the_dashboard_serves_nothing_but_its_login_without_a_session():
    app = _app()
    ui = [r for r in _requests(_walk(app.router)) if r[1].startswith("/ui")]
    assert len(ui) >= 4
    refused = asyncio.run(_refused_all(app, [r for r in ui if r not in PUBLIC], {}))
    assert all(code in (401, 403) for _, _, code in refused), refused


def test_every_grpc_method_gets_its_caller_from_the_door_only():
    pytest.importorskip("cwsandbox")
    import grpc
    from cwsandbox._proto import sandbox_pb2

    from corral.server.compat.cwsandbox import CwSandboxFrontend
    from corral.server.compat.cwsandbox_edge import GrpcEdge
    from corral.server.conn_limits import ConnectionBook

    app = _app()
    settings = ServerSettings(token=TOKEN, max_memory_mb=4096, grpc=("127.0.0.1", 0))
    frontend = CwSandboxFrontend(
        settings, app.state.engine, app.state.service, app.state.door,
        edge=GrpcEdge(ConnectionBook(16, 4)), throttle=app.state.throttle,
        streams=app.state.streams)
    assert frontend.guard.door is app.state.door  # the HTTP API's door, not a copy
    # and its edge's books are the HTTP API's (one throttle, one count of live streams)
    assert frontend.guard.throttle is app.state.throttle
    assert frontend.guard.streams is app.state.streams
    servicer = frontend.service
    assert not hasattr(servicer, "identify") and not hasattr(servicer, "_authenticate")

    class Aborted(Exception):
        pass

    class Context:
        """A call that never passed the interceptor."""

        code = None

        def invocation_metadata(self):
            return (("authorization", f"Bearer {TOKEN}"),)

        def peer(self):
            return "ipv4:127.0.0.1:1"

        def done(self):
            return False

        async def abort(self, code, details="", trailing_metadata=()):
            self.code = code
            raise Aborted(details)

    async def call(method) -> object:
        context, name = Context(), method.name

        async def no_requests():
            return
            yield

        message = getattr(sandbox_pb2, method.input_type.name)()
        request = no_requests() if method.client_streaming else message
        try:
            result = getattr(servicer, name)(request, context)
            if hasattr(result, "__anext__"):
                async for _ in result:
                    pass
            else:
                await result
        except Aborted:
            pass
        return context.code

    methods = sandbox_pb2.DESCRIPTOR.services_by_name["SandboxService"].methods
    assert len(methods) > 5
    for method in methods:
        code = asyncio.run(call(method))
        assert code in (grpc.StatusCode.UNAUTHENTICATED, grpc.StatusCode.UNIMPLEMENTED), (
            method.name, code)


def test_credentials_are_checked_in_the_door_alone():
    root = Path(corral.server.__file__).parent
    for path in root.rglob("*.py"):
        text = path.read_text()
        rel = path.relative_to(root).as_posix()
        if rel not in ("door.py", "tenants.py"):
            assert ".identify(" not in text, rel
        if rel not in ("door.py", "app.py", "peer_auth.py"):
            assert "PeerCredential(" not in text, rel
        assert "acting_as(caller_name" not in text, rel


def test_engine_code_acting_for_nobody_fails_closed():
    owners = Owners()
    assert owners.of(UNSET) is None  # an engine used as a library: the admin
    owners.require_caller()  # what the daemon does
    with pytest.raises(InternalError, match="no caller"):
        owners.of(UNSET)
    assert owners.of("alice") == "alice" and owners.of(None) is None  # named: as named
    app = _app()
    with pytest.raises(InternalError):
        app.state.engine.owners.of(UNSET)


VERBS = ("pause", "resume", "exec", "exec_stream", "spawn", "read_file", "write_file", "stat",
         "list_dir", "mkdir", "remove", "kill_processes", "snapshot")


def test_front_ends_reach_sandboxes_through_the_service_not_the_engine():
    """Exec, processes, files and pause go through the service's verbs for the
    request's caller (``ctx.sandboxes(request)``), never straight to the engine."""
    root = Path(corral.server.__file__).parent
    direct = re.compile(r"(ctx\.engine\(request\)|_engine\(request\))\.(%s)\(" % "|".join(VERBS))
    assigned = re.compile(r"^\s*engine(, \w+)* = ctx\.engine\(request\)", re.M)
    front_ends = [root / "routes.py", root / "processes.py", *sorted((root / "compat").glob("*.py"))]
    for path in front_ends:
        text = path.read_text()
        rel = path.relative_to(root).as_posix()
        assert not direct.search(text), (rel, direct.search(text))
        for match in assigned.finditer(text):  # an engine held in a handler: no verb on it
            rest = text[match.end():match.end() + 2000].split("\ndef ")[0].split("\nasync def ")[0]
            called = re.search(r"\bengine\.(%s)\(" % "|".join(VERBS), rest)
            assert called is None, (rel, match.group(0), called)


def test_the_service_acts_for_the_caller_it_is_given_never_an_ambient_one():
    """Issue 23: ``SandboxService`` verbs take the Caller; outside any request (no owner
    set, the daemon fails closed) they still act for exactly the caller they get."""
    from corral.server.caller import ADMIN, Caller
    from corral.server.tenant_model import Tenant

    app = _app()
    engine, service = app.state.engine, app.state.service
    seen: list[str | None] = []
    engine.list = lambda **kwargs: seen.append(engine.owners.of(kwargs.get("owner", UNSET))) or []
    with pytest.raises(InternalError):
        engine.list()  # engine code with no owner: fail closed
    with pytest.raises(TypeError):
        service.list_sandboxes()  # a service verb with no caller: refused by its signature
    assert service.list_sandboxes(Caller.of_tenant(Tenant("alice"))) == []
    assert service.list_sandboxes(ADMIN) == []
    assert seen == ["alice", None]


def test_no_module_has_an_ambient_owner():
    """Who acts is the Caller the door resolved, passed on as ``owner=``: there is no
    context variable to set or read anywhere in corral (runtime/ownership.py)."""
    root = Path(corral.__file__).parent
    ambient = re.compile(r"acting_as\(|owners\.acting\(|\.detached\(\)")
    found = [f"{p.relative_to(root)}:{m.group(0)}" for p in sorted(root.rglob("*.py"))
             for m in ambient.finditer(p.read_text())]
    assert found == []
    assert "contextvars" not in (root / "runtime" / "ownership.py").read_text()
