"""What the dashboard shows, read through the native API's own handlers.

Every list on the page comes from the handler that serves it to API clients
(``GET /v1/sandboxes``, ``/v1/pools``, ``/v1/snapshots``, ``/v1/images``, ``/v1/info``,
``/v1/evals``), called with the dashboard's request, whose credentials are the
session's token (:mod:`corral.server.ui.gate`): whatever those handlers let a caller
see (a tenant its own sandboxes) is what the page shows, and the stop and delete
buttons are the API's stop and delete. The page is rendered on the server; the live
view (``GET /ui/events``) sends the same panels again as server-sent events.
"""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass
from typing import Any
from urllib.parse import urlencode

from starlette.requests import Request
from starlette.responses import JSONResponse, Response

from corral.api.models import StopRequest
from corral.errors import CorralError, InvalidArgument
from corral.schema import SandboxState
from corral.server import context as ctx
from corral.server import evals, routes
from corral.server.image_routes import list_images
from corral.server.streaming import NDJSONResponse
from corral.server.ui.render import page, render
from corral.server.ui.sessions import Session

MAX_ROWS = 300  # sandboxes drawn on the page (the count says how many more there are)
MAX_ERRORS = 20
MAX_TAG_FILTERS = 8
EVENT_INTERVAL_S = 1.0
EVENT_STREAM_MAX_S = 600.0  # then the browser reconnects (EventSource does by itself)
PANELS = ("sandboxes", "admission", "pools", "images", "snapshots", "evals", "errors")
STATES = tuple(s.value for s in SandboxState)


@dataclass(frozen=True)
class Filters:
    """The page's filters, from its query string (empty fields are no filter)."""

    tags: tuple[str, ...] = ()
    state: str = ""
    tenant: str = ""

    @classmethod
    def of(cls, request: Request) -> Filters:
        q = request.query_params
        tags = tuple(t.strip() for t in q.getlist("tag") if t.strip())[:MAX_TAG_FILTERS]
        state = q.get("state", "").strip()
        if state and state not in STATES:
            raise InvalidArgument(f"unknown state {state[:40]!r}: one of {', '.join(STATES)}")
        return cls(tags, state, q.get("tenant", "").strip()[:128])

    def query(self) -> str:
        pairs = [("tag", t) for t in self.tags]
        pairs += [(k, v) for k, v in (("state", self.state), ("tenant", self.tenant)) if v]
        return urlencode(pairs)


def _as(request: Request, query: str) -> Request:
    """The same request (its credentials, its app) with another query string."""
    return Request({**request.scope, "query_string": query.encode()}, request.receive)


async def _read(handler: Callable[[Request], Awaitable[Response]], request: Request) -> Any:
    reply = await handler(request)
    return json.loads(bytes(reply.body))


async def gather(request: Request, filters: Filters) -> dict[str, Any]:
    """Everything the page shows, as the native API gives it to this caller."""
    listed = (await _read(routes.list_sandboxes, _as(request, filters.query())))["sandboxes"]
    if filters.tenant:  # the API filters by tenant for an admin; a tenant sees its own only
        listed = [s for s in listed if s["spec"].get("tenant") == filters.tenant]
    listed.sort(key=lambda s: s["created_at"], reverse=True)
    verbs = ctx.sandboxes(request)
    rows = []
    for s in listed[:MAX_ROWS]:
        usage = None
        if s["state"] in ("running", "paused"):
            try:
                usage = verbs.usage(s["id"])
            except (CorralError, OSError):
                pass  # it ended meanwhile
        rows.append({**s, "tenant": s["spec"].get("tenant"), "usage": usage})
    failed = (await _read(routes.list_sandboxes, _as(request, "state=failed")))["sandboxes"]
    runs = (await _read(evals.list_evals, request))["evals"]
    pools = (await _read(routes.list_pools, request))["pools"]
    return {
        "sandboxes": rows,
        "hidden": max(0, len(listed) - MAX_ROWS),
        "info": await _read(routes.info, _as(request, "")),
        "pools": pools,
        "images": (await _read(list_images, request))["images"],
        "snapshots": (await _read(routes.list_snapshots, request))["snapshots"],
        "evals": runs,
        "errors": _errors(failed, runs, pools),
        "filters": filters,
        "states": STATES,
    }


def _errors(
    failed: list[dict[str, Any]], runs: list[dict[str, Any]], pools: list[dict[str, Any]]
) -> list[dict[str, Any]]:
    """Recent failures: sandboxes that failed, evaluation runs that did, pools' last
    failed create."""
    out = [{"at": s.get("ended_at") or s["created_at"], "what": f"sandbox {s['id']}",
            "message": s.get("reason") or "failed"} for s in failed]
    out += [{"at": r["updated_at"], "what": f"evaluation {r['name']}",
             "message": r.get("error") or "failed"} for r in runs if r["state"] == "failed"]
    out += [{"at": p["created_at"], "what": f"pool {p['name']}", "message": p["last_error"]}
            for p in pools if p.get("last_error")]
    out.sort(key=lambda e: e["at"], reverse=True)
    return out[:MAX_ERRORS]


def _session(request: Request) -> Session:
    session: Session = request.scope["state"]["ui_session"]
    return session


def panels(data: dict[str, Any]) -> dict[str, str]:
    """Each panel's HTML (autoescaped), by the id of its element on the page."""
    return {name: render(f"panel_{name}.html", **data) for name in PANELS}


# ----------------------------------------------------------------------- routes


async def dashboard(request: Request) -> Response:
    filters = Filters.of(request)
    data = await gather(request, filters)
    return page("dashboard.html", csrf=_session(request).csrf, panels=panels(data),
                events_url="/ui/events" + (f"?{filters.query()}" if filters.query() else ""),
                **data)


async def whoami(request: Request) -> Response:
    """Answers only what the guard let through (the gate's login check)."""
    return Response(status_code=204)


async def events(request: Request) -> Response:
    """The panels again whenever they change, as server-sent events (``update``)."""
    filters = Filters.of(request)
    return SSEResponse(_updates(request, filters))


async def _updates(request: Request, filters: Filters) -> AsyncIterator[bytes]:
    last: dict[str, str] = {}
    deadline = time.monotonic() + EVENT_STREAM_MAX_S
    yield b"retry: 2000\n\n"
    while time.monotonic() < deadline:
        try:
            now = panels(await gather(request, filters))
        except CorralError as exc:
            yield _event("failure", {"message": exc.message})
            return
        changed = {k: v for k, v in now.items() if last.get(k) != v}
        if changed:
            yield _event("update", changed)
            last = now
        else:
            yield b": keep-alive\n\n"
        await asyncio.sleep(EVENT_INTERVAL_S)


def _event(name: str, data: Any) -> bytes:
    return f"event: {name}\ndata: {json.dumps(data, separators=(',', ':'))}\n\n".encode()


class SSEResponse(NDJSONResponse):
    """Server-sent events, stopped as soon as the browser goes away."""

    media_type = "text/event-stream"


async def stop(request: Request) -> Response:
    reply = await routes.stop_sandbox(request, StopRequest())
    return JSONResponse(json.loads(bytes(reply.body)))


async def delete(request: Request) -> Response:
    return await routes.delete_sandbox(request)
