"""``--log-format json``: the daemon's log as JSON lines, and one line per request.

Every record (the daemon's own, uvicorn's) becomes one JSON object on stderr with
``time`` (UTC, ISO 8601), ``level``, ``logger`` and ``message`` (and ``exc`` with the
traceback, if any). :class:`AccessLog`, the outermost middleware, adds one record per
HTTP request on the ``corral.access`` logger::

    {"time": "2026-11-26T05:01:02.345Z", "level": "info", "logger": "corral.access",
     "message": "GET /v1/sandboxes/{sandbox_id} 200", "tenant": "admin", "method": "GET",
     "route": "/v1/sandboxes/{sandbox_id}", "status": 200, "duration_ms": 1.234}

``route`` is the template of the route that served the request, never the path
itself: a path can carry a token (SandboxFusion's does) or a client's junk. A request
no route took (refused before routing, or unknown) has ``"route": null``, and a
refused one (401) ``"tenant": null``.
"""

from __future__ import annotations

import json
import logging
import time
from typing import Any

from starlette.types import ASGIApp, Message, Receive, Scope, Send

from corral.server.tenants import ADMIN_NAME, caller_name

ACCESS_LOGGER = "corral.access"
LOG_FORMATS = ("text", "json")
TEXT_FORMAT = "%(asctime)s %(levelname)s %(name)s: %(message)s"
# What a LogRecord always has: everything else on it was passed as ``extra=``.
_STANDARD = frozenset(logging.LogRecord("", 0, "", 0, "", None, None).__dict__) | {
    "message", "asctime", "taskName"}

access_log = logging.getLogger(ACCESS_LOGGER)


class JsonFormatter(logging.Formatter):
    """A record as one line of JSON; ``extra=`` fields become keys of their own."""

    def format(self, record: logging.LogRecord) -> str:
        entry: dict[str, Any] = {
            "time": time.strftime("%Y-%m-%dT%H:%M:%S", time.gmtime(record.created))
            + f".{int(record.msecs):03d}Z",
            "level": record.levelname.lower(),
            "logger": record.name,
            "message": record.getMessage(),
        }
        for key, value in record.__dict__.items():
            if key not in _STANDARD and not key.startswith("_"):
                entry.setdefault(key, value)
        if record.exc_info:
            entry["exc"] = self.formatException(record.exc_info)
        return json.dumps(entry, default=str, ensure_ascii=False)


def formatter(log_format: str) -> logging.Formatter:
    """The formatter of ``--log-format`` (``text``, the default, or ``json``)."""
    return JsonFormatter() if log_format == "json" else logging.Formatter(TEXT_FORMAT)


def route_template(scope: Scope) -> str | None:
    """The path template of the route that took the request, if one did."""
    route = scope.get("route")
    path = getattr(route, "path", None)
    return path if isinstance(path, str) else None


class AccessLog:
    """Outermost middleware: one ``corral.access`` record per HTTP request, at its end."""

    def __init__(self, app: ASGIApp) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        began = time.perf_counter()
        status = 0  # no reply was started (the client left, or the server failed)

        async def send_status(message: Message) -> None:
            nonlocal status
            if message["type"] == "http.response.start":
                status = message["status"]
            await send(message)

        try:
            await self.app(scope, receive, send_status)
        finally:
            route = route_template(scope)
            access_log.info(
                "%s %s %d", scope["method"], route or "-", status,
                extra={
                    "tenant": None if status == 401 else _principal(scope),
                    "method": scope["method"],
                    "route": route,
                    "status": status,
                    "duration_ms": round((time.perf_counter() - began) * 1000, 3),
                },
            )


def _principal(scope: Scope) -> str:
    """Whom the guard let in: a tenant's name, ``admin``, or "" if no credential was
    checked (an endpoint that checks its own, like SandboxFusion's path token)."""
    name = caller_name(scope)
    return ADMIN_NAME if name is None else name
