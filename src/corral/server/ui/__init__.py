"""The dashboard at ``/ui``: the daemon's sandboxes, pools, images, snapshots, admission
queue, recent errors and evaluation runs, live, in a browser; no build step.

:func:`mount` adds it to an app: its routes (:mod:`corral.server.ui.views`, behind the
daemon's guard like every API route) and its front door (:mod:`corral.server.ui.gate`:
log in once with a token, then a session cookie). Server-rendered HTML from autoescaped
templates, two small scripts of our own (``static/ui.js``: the live updates, the
buttons; ``static/terminal.js``: a sandbox page's terminal, :mod:`.sandbox_view`) and a
stylesheet; the Content-Security-Policy allows nothing else.
"""

from __future__ import annotations

from pathlib import Path

from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import PlainTextResponse, Response
from starlette.routing import Route, Router
from starlette.types import Receive, Scope, Send

from corral.server.ui import sandbox_view, views
from corral.server.ui.gate import UiGate
from corral.server.ui.render import page
from corral.server.ui.sessions import Sessions

__all__ = ["mount"]

STATIC = Path(__file__).parent / "static"
ASSETS = {"ui.js": "text/javascript; charset=utf-8", "ui.css": "text/css; charset=utf-8",
          "terminal.js": "text/javascript; charset=utf-8"}


async def login_page(request: Request) -> Response:
    return page("login.html")


def _public() -> Router:
    """What needs no session: the login form, the script and the stylesheet (these two
    files by name: no path from a request ever reaches the file system)."""
    assets = {name: (STATIC / name).read_bytes() for name in ASSETS}

    async def asset(request: Request) -> Response:
        name = request.path_params["name"]
        if name not in assets:
            return PlainTextResponse("not found", status_code=404)
        return Response(assets[name], media_type=ASSETS[name],
                        headers={"cache-control": "no-cache"})

    async def not_found(scope: Scope, receive: Receive, send: Send) -> None:
        await PlainTextResponse("not found", status_code=404)(scope, receive, send)

    return Router(routes=[
        Route("/ui/login", login_page, methods=["GET"]),
        Route("/ui/static/{name:path}", asset, methods=["GET"]),
    ], default=not_found)


def mount(app: Starlette) -> None:
    """Serve the dashboard at ``/ui`` on ``app`` (before it starts).

    Its routes sit in the app router's fallback chain, like the compatibility
    front-ends: ``/openapi.json`` documents the API, and the page is not part of it.
    """
    sb = "/ui/sandboxes/{sandbox_id}"
    pages = [
        Route("/ui", views.dashboard, methods=["GET"]),
        Route("/ui/whoami", views.whoami, methods=["GET"]),
        Route("/ui/events", views.events, methods=["GET"]),
        Route(sb, sandbox_view.sandbox_page, methods=["GET"]),  # its logs, files, processes
        Route(sb + "/terminal", sandbox_view.open_terminal, methods=["POST"]),
        Route(sb + "/processes/{process_id}/output", sandbox_view.terminal_output,
              methods=["GET"]),
        Route(sb + "/processes/{process_id}/stdin", sandbox_view.terminal_input,
              methods=["POST"]),
        Route(sb + "/stop", views.stop, methods=["POST"]),
        Route(sb + "/delete", views.delete, methods=["POST"]),
    ]
    app.router.default = Router(routes=pages, default=app.router.default)
    app.state.ui_sessions = Sessions()
    app.add_middleware(UiGate, sessions=app.state.ui_sessions, public=_public(),
                       door=app.state.door)
