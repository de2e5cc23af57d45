"""The dashboard's page of one sandbox (``GET /ui/sandboxes/{id}``): its info and usage,
its processes, a directory of its files, and its log, read through the native API's
own handlers with the session's credentials, like the rest of the dashboard
(:mod:`corral.server.ui.views`): a tenant sees only its own sandboxes' pages.

Each part that cannot be read (a sandbox that ended has no processes; a path that is
not a directory) shows the API's error message in its place; reload the page to see
it again.

A terminal (``static/terminal.js``): ``POST .../terminal`` spawns ``bash -l`` (else
``sh``) on a pseudo-terminal through the API's spawn handler; the page then reads its
output with the API's output stream and sends keys to its stdin, both through routes
under ``/ui`` (the session's cookie, and its CSRF token for the POSTs, like the stop and
delete buttons); leaving the page does not kill the shell (it ends with ``exit``).
"""

from __future__ import annotations

import json
import time
from typing import Any
from urllib.parse import urlencode

from starlette.requests import Request
from starlette.responses import Response

from corral.api.process_models import SpawnRequest
from corral.errors import CorralError
from corral.runtime.uids import SANDBOX_HOME
from corral.server import ops_routes, processes, routes
from corral.server.ui.render import page
from corral.server.ui.views import _as, _read, _session

MAX_LOG_ENTRIES = 200  # the last entries shown
MAX_FILES = 500  # entries of a directory shown
MAX_DETAIL = 400  # characters of a log entry's details


async def _part(handler: Any, request: Request, query: str = "") -> tuple[Any, str | None]:
    """What a handler answers this caller, or its error message."""
    try:
        return await _read(handler, _as(request, query)), None
    except CorralError as exc:
        return None, exc.message


def _log_rows(entries: list[dict[str, Any]]) -> list[dict[str, Any]]:
    rows = []
    for e in entries[-MAX_LOG_ENTRIES:]:
        detail = {k: v for k, v in e.items() if k not in ("seq", "kind", "at")}
        text = json.dumps(detail, ensure_ascii=False, separators=(", ", ": "))
        rows.append({"at": time.strftime("%H:%M:%S", time.localtime(e.get("at") or 0)),
                     "kind": e.get("kind", ""), "detail": text[:MAX_DETAIL]})
    return rows


async def sandbox_page(request: Request) -> Response:
    info, error = await _part(routes.get_sandbox, request)
    if info is None:
        return page("sandbox.html", status=404, error=error, info=None,
                    csrf=_session(request).csrf)
    path = request.query_params.get("path") or info["spec"].get("workdir") or SANDBOX_HOME
    files, files_error = await _part(routes.list_files, request, urlencode({"path": path}))
    procs, procs_error = await _part(processes.list_processes, request)
    logs, logs_error = await _part(ops_routes.sandbox_logs, request, "limit=100000")
    entries = sorted((files or {}).get("entries", []),
                     key=lambda f: (not f["is_dir"], f["name"]))[:MAX_FILES]
    parent = path.rstrip("/").rsplit("/", 1)[0] or "/"
    return page(
        "sandbox.html", info=info, error=None, csrf=_session(request).csrf,
        path=path, parent=parent if path != "/" else None, files=entries,
        files_error=files_error, processes=(procs or {}).get("processes", []),
        processes_error=procs_error, logs=_log_rows((logs or {}).get("entries", [])),
        logs_error=logs_error,
        link=lambda p: "?" + urlencode({"path": p}),
    )


TERMINAL = SpawnRequest(
    cmd=["/bin/sh", "-c", "if command -v bash >/dev/null; then exec bash -l; else exec sh -l; fi"],
    pty=True, rows=30, cols=110, env={"TERM": "dumb"},
)


async def open_terminal(request: Request) -> Response:
    """``POST /ui/sandboxes/{id}/terminal``: a shell on a terminal (the API's spawn)."""
    return await processes.spawn_process(request, TERMINAL)


async def terminal_output(request: Request) -> Response:
    """``GET .../processes/{pid}/output``: the API's output stream (NDJSON)."""
    return await processes.read_output(request)


async def terminal_input(request: Request) -> Response:
    """``POST .../processes/{pid}/stdin``: the API's stdin write (raw body)."""
    return await processes.write_stdin(request)
