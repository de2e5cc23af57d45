"""E2B's ``fork`` and ``create_snapshot`` on corral's live checkpoints (docs/e2b.md,
"Fork and snapshots"; docs/live.md).

- ``sandbox.fork(count=N, timeout=T)`` (``POST /sandboxes/{id}/fork``): corral's live
  fork of a checkpointable sandbox (created with metadata ``{"corral.checkpointable":
  "true"}`` or ``lifecycle={"on_timeout": "pause"}``): one checkpoint, then ``count``
  (1 to 20) running copies, each with its processes and memory and a lifetime of ``T``
  seconds (E2B's default 15). As E2B's API does, each copy succeeds or fails on its
  own: the reply holds, per copy, its sandbox or its error. Any other sandbox is refused
  whole (409, ``not_checkpointable``), as is one CRIU cannot dump (501).
- ``sandbox.create_snapshot(name=...)`` (``POST /sandboxes/{id}/snapshots``): a live
  checkpoint (``mode="full"``, the default; checkpointable sandboxes only) or a snapshot
  of the files (``mode="filesystem"``); ``Sandbox.create(snapshot_id)`` starts from it
  (:func:`corral.server.compat.e2b_api.create_sandbox`) and ``Sandbox.delete_snapshot``
  (``DELETE /templates/{id}``) deletes it; ``Sandbox.list_snapshots`` lists them.
  Snapshots are the caller's own, as corral's.
"""

from __future__ import annotations

from typing import Any

from pydantic import Field
from starlette.requests import ClientDisconnect, Request
from starlette.responses import JSONResponse, Response

from corral.errors import CorralError, InvalidState, SnapshotNotFound
from corral.schema import MAX_TIMEOUT_S, SandboxInfo, SnapshotInfo
from corral.server import context as ctx
from corral.server.caller import caller_of
from corral.server.compat.e2b_api import (
    _SB,
    _Body,
    _body,
    _target,
    created_json,
    error,
    paged,
    unsupported,
)
from corral.server.lifetime import set_lifetime
from corral.server.service import Abandoned

MAX_FORKS = 20  # E2B's own bound on count
DEFAULT_FORK_TIMEOUT_S = 15  # E2B's API default for the forks' lifetime
_HOW = ("create it with metadata {'corral.checkpointable': 'true'} (or lifecycle "
        "on_timeout='pause') to fork or snapshot its memory (docs/e2b.md)")


class ForkBody(_Body):
    timeout: int = Field(DEFAULT_FORK_TIMEOUT_S, ge=1, le=int(MAX_TIMEOUT_S))
    count: int = Field(1, ge=1, le=MAX_FORKS)


class SnapshotBody(_Body):
    name: str | None = Field(None, min_length=1, max_length=200)
    memory: bool | None = None


def _checkpointable(info: SandboxInfo, what: str) -> None:
    if not info.spec.checkpointable:
        raise InvalidState(f"{what} of sandbox {info.id} keeps its memory, and corral "
                           f"checkpoints only a sandbox created checkpointable: {_HOW}",
                           details={"sandbox_id": info.id, "cause": "not_checkpointable"})


def _failed(exc: BaseException) -> dict[str, Any]:
    if isinstance(exc, CorralError):
        return {"code": exc.status, "message": exc.message}
    return {"code": 500, "message": f"the fork failed to start ({type(exc).__name__}); "
                                    "see the daemon's log"}


async def fork_sandbox(request: Request) -> Response:
    body: ForkBody = await _body(request, ForkBody, "fork request")
    info = _target(request)
    _checkpointable(info, "a fork")
    try:
        made = await ctx.service(request).fork(
            info.id, body.count, caller_of(request), abandoned=request.is_disconnected,
            frontend="e2b", live=True, each=True)
    except Abandoned:
        raise ClientDisconnect() from None
    results: list[dict[str, Any]] = []
    for copy in made:
        if isinstance(copy, SandboxInfo):
            try:  # E2B: the forks live `timeout` seconds from now
                copy = await set_lifetime(request, copy.id, float(body.timeout))
            except CorralError as exc:
                await ctx.service(request).delete(copy.id, caller_of(request))
                copy = exc
        results.append({"sandbox": created_json(request, copy)} if isinstance(copy, SandboxInfo)
                       else {"error": _failed(copy)})
    return JSONResponse(results, status_code=201)


def _snapshot_json(snap: SnapshotInfo) -> dict[str, Any]:
    return {"snapshotID": snap.id, "names": [snap.name] if snap.name else []}


async def create_snapshot(request: Request) -> Response:
    body: SnapshotBody = await _body(request, SnapshotBody, "snapshot request")
    info = _target(request)
    verbs = ctx.sandboxes(request)
    if body.memory is False:  # mode="filesystem": its files only
        snap = await verbs.snapshot(info.id, name=body.name)
    else:
        _checkpointable(info, "a snapshot with mode='full'")
        snap = await verbs.checkpoint(info.id, name=body.name)
    return JSONResponse(_snapshot_json(snap), status_code=201)


async def list_snapshots(request: Request) -> Response:
    """``Sandbox.list_snapshots(sandbox_id=, name=)``: the caller's snapshots (the
    admin's: all), oldest first, paged as sandboxes are."""
    q = request.query_params
    snaps = sorted((s for s in ctx.service(request).list_snapshots(caller_of(request))
                    if q.get("sandboxID") in (None, s.source_sandbox)
                    and q.get("name") in (None, s.name, s.id)), key=lambda s: s.created_at)
    page, headers = paged(request, snaps)
    return JSONResponse([_snapshot_json(s) for s in page], headers=headers)


async def delete_template(request: Request) -> Response:
    """``Sandbox.delete_snapshot``: a snapshot of the caller's; templates stay unsupported."""
    ref = request.path_params["template_id"]
    try:
        ctx.engine(request).get_snapshot(ref, owner=ctx.owner(request))
    except SnapshotNotFound:  # a snapshot's id: gone (the SDK's False); else a template
        return error(404, f"no snapshot {ref}") if ref.startswith("snap-") else \
            await unsupported(request)
    await ctx.engine(request).delete_snapshot(ref, owner=ctx.owner(request))
    return Response(status_code=204)


CONTROL = (
    ("POST", _SB + "/fork", fork_sandbox),
    ("POST", _SB + "/snapshots", create_snapshot),
    ("GET", "/snapshots", list_snapshots),
    ("DELETE", "/templates/{template_id}", delete_template),
)
