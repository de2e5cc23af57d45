"""Routes for operating sandboxes: their logs (``GET .../logs``, ``?follow=1`` streams)
and their lifetime (``PATCH /v1/sandboxes/{id}`` with ``{"timeout": seconds}``).

The log store (:class:`~corral.runtime.sandbox_logs.SandboxLogs`) is opened with the app
(:func:`open_logs`) and kept on ``app.state.logs``; it is written from the engine's
events, never from here.
"""

from __future__ import annotations

import json
from collections.abc import AsyncIterator
from typing import Any

from starlette.requests import Request
from starlette.responses import JSONResponse, Response

from corral.api.models import TimeoutRequest
from corral.errors import InvalidArgument, SandboxNotFound
from corral.runtime.engine import Engine
from corral.runtime.sandbox_logs import MAX_READ, SandboxLogs
from corral.schema import SandboxInfo
from corral.server import context as ctx
from corral.server.caller import caller_of
from corral.server.lifetime import set_lifetime
from corral.server.settings import ServerSettings
from corral.server.streaming import NDJSONResponse

FOLLOW_POLL_S = 1.0  # a follower looks at the sandbox's state at least this often





def open_logs(settings: ServerSettings, engine: Engine) -> SandboxLogs:
    def owner_of(sandbox_id: str) -> str | None:  # whose bound its log counts against
        info = engine.registry.get(sandbox_id)
        if info is None:
            raise KeyError(sandbox_id)
        return info.spec.tenant

    logs = SandboxLogs(engine.layout.state_dir / "logs.db", retention=settings.log_retention,
                       owner_of=owner_of)
    logs.attach(engine.events)
    return logs


def logs_of(request: Request) -> SandboxLogs:
    logs: SandboxLogs = request.app.state.logs
    return logs


async def patch_sandbox(request: Request, body: TimeoutRequest) -> Response:
    info = await set_lifetime(request, request.path_params["sandbox_id"], float(body.timeout))
    return JSONResponse(info.model_dump(mode="json"))


def _int_param(request: Request, name: str, default: int) -> int:
    value = request.query_params.get(name)
    if value is None:
        return default
    if not value.isdecimal():
        raise InvalidArgument(f"query parameter {name!r} must be a whole number >= 0, "
                              f"got {value!r}")
    return int(value)


def _state(engine: Engine, sid: str, owner: str | None) -> SandboxInfo | None:
    try:
        return engine.get(sid, owner=owner)
    except SandboxNotFound:
        return None


async def sandbox_logs(request: Request) -> Response:
    engine, logs, sid = ctx.engine(request), logs_of(request), request.path_params["sandbox_id"]
    after = _int_param(request, "after", 0)
    limit = min(_int_param(request, "limit", MAX_READ), MAX_READ)
    follow = request.query_params.get("follow", "0").lower()
    if follow not in ("0", "1", "true", "false", "yes", "no"):
        raise InvalidArgument(f"query parameter 'follow' must be true or false, got {follow!r}")
    owner = caller_of(request).name
    if (tenant := owner) is not None:  # a tenant: only its own sandbox's
        try:
            engine.get(sid, owner=owner)  # another's answers as an unknown id
        except SandboxNotFound:
            if logs.deleted_owner(sid) != (True, tenant):  # a deleted one of its own: kept
                raise
    if _state(engine, sid, owner) is None and not logs.known(sid):
        raise SandboxNotFound(
            f"no sandbox {sid!r} and no logs of one: it never existed, or was deleted "
            "longer ago than the daemon's --log-retention", details={"sandbox_id": sid})
    if follow in ("1", "true", "yes"):
        return NDJSONResponse(_follow(engine, logs, sid, after, owner))
    entries = logs.read(sid, after, limit)
    nxt = entries[-1]["seq"] if entries else after
    return JSONResponse({"sandbox_id": sid, "entries": entries, "next": nxt})


def _line(entry: dict[str, Any]) -> bytes:
    return json.dumps(entry, ensure_ascii=False, separators=(",", ":")).encode() + b"\n"


async def _follow(engine: Engine, logs: SandboxLogs, sid: str, after: int,
                  owner: str | None) -> AsyncIterator[bytes]:
    """Entries as they are logged; ends with ``{"kind": "end", "state": ...}`` once the
    sandbox has ended (or was deleted) and its last entries were sent."""
    while True:
        info = _state(engine, sid, owner)
        ended = info is None or info.state.terminal
        entries = logs.read(sid, after)
        for entry in entries:
            yield _line(entry)
        if entries:
            after = entries[-1]["seq"]
            continue
        if ended or logs.closed:
            yield _line({"kind": "end", "state": info.state.value if info else "deleted"})
            return
        await logs.wait(FOLLOW_POLL_S)
