"""Tensorlake's sandbox API on a corral daemon: scripts written for the ``tensorlake``
Python client run unchanged with ``TENSORLAKE_API_URL=http://127.0.0.1:PORT`` and
``TENSORLAKE_API_KEY=<the daemon's --token>``.

This module serves the lifecycle API, which the client sends to
``/v1/namespaces/{namespace}/...`` when the API URL is ``localhost`` / ``127.0.0.1``
and to flat paths (``/sandboxes``, ...) otherwise; both are served. In-sandbox calls
(processes, files) are :mod:`.tensorlake_sandbox`. Namespaces are a boundary: a request
sees only its namespace's sandboxes, snapshots and pools (:mod:`.tensorlake_scope`).
Request bodies are strict and bounded (:class:`~.tensorlake_model.Body`). Everything
goes through the same engine, admission control (creates, copies and pool refills wait
for room like native ones) and bearer-token guard as the native API.

What maps to what:

- create → a corral sandbox (``cpus``, ``memory_mb``, ``disk_mb``; ``timeout_secs`` is
  its lifetime, 0 or unset meaning corral's default; the image through
  :class:`~.tensorlake_model.TensorlakeSettings`). The reply comes once it runs, so
  ``wait=False`` answers a running sandbox too.
- suspend / resume → hibernate / resume for a sandbox on no network (made
  checkpointable: its processes to disk, memory freed; docs/live.md), else (or where
  CRIU refuses it) pause / resume (frozen processes, memory kept).
- snapshot → a corral snapshot of the files (``filesystem`` type; ``memory`` is refused),
  ``completed`` at once; create with ``snapshot_id`` starts from it.
- copy → corral's fork (files and spec, not processes), all or nothing.
- sandbox pools → corral warm pools (``warm_containers`` → ``min_ready``,
  ``max_containers`` → ``max_size``); claim → acquire.

Refused with 501 ``unsupported`` rather than ignored: GPUs, entrypoints, file-system
mounts, exposed ports, egress allow/deny lists, resizing, pool updates, logs.
"""

from __future__ import annotations

import logging
from typing import Any

from pydantic import BaseModel, Field
from starlette.applications import Starlette
from starlette.requests import ClientDisconnect, Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route, Router

from corral.errors import (
    InvalidArgument,
    InvalidState,
    NotFound,
    SnapshotNotFound,
    Unsupported,
)
from corral.pool_schema import (
    DEFAULT_ACQUIRE_TIMEOUT_S,
    DEFAULT_MAX_SIZE,
    MAX_ACQUIRE_TIMEOUT_S,
    PoolDetail,
)
from corral.runtime.events import SandboxEnded
from corral.runtime.pools import PoolManager
from corral.schema import (
    MAX_TIMEOUT_S,
    NetworkMode,
    SandboxInfo,
    SandboxSpec,
    SandboxState,
    SnapshotInfo,
    validate_model,
)
from corral.server import context as ctx
from corral.server.admission import LIVE_STATES
from corral.server.caller import caller_of
from corral.server.compat import tensorlake_sandbox
from corral.server.compat import tensorlake_scope as scope
from corral.server.compat._wire import flat_errors, unsupported
from corral.server.compat.e2b_network import out_rules
from corral.server.compat.tensorlake_model import (
    NAME_TAG,
    TAG,
    Body,
    TensorlakeSettings,
    Text,
    check_image,
    check_name,
    created_json,
    items,
    refuse,
    resources,
    sandbox_json,
    settings,
    snapshot_json,
)
from corral.server.compat.tensorlake_scope import namespace, sandbox_url
from corral.server.context import unless_gone
from corral.server.service import Abandoned
from corral.server.wire import read_json

log = logging.getLogger("corral.server")

SERVICE = "Tensorlake"
MAX_COPIES = 1000
ALL_METHODS = ["GET", "POST", "PUT", "PATCH", "DELETE"]


# -------------------------------------------------------------- request bodies


class _Resources(Body):
    cpus: float | None = None
    memory_mb: int | None = None
    disk_mb: int | None = None
    gpus: list[Any] | None = items()


class _Network(Body):
    allow_internet_access: bool = True
    allow_out: list[Text] = items(list)
    deny_out: list[Text] = items(list)


class _SpecFields(Body):
    image: Text | None = None
    resources: _Resources | None = None
    timeout_secs: int | None = Field(None, ge=0, le=int(MAX_TIMEOUT_S))
    entrypoint: list[Text] | None = items()
    network: _Network | None = None


class CreateRequest(_SpecFields):
    snapshot_id: Text | None = None
    name: Text | None = None
    allow_unauthenticated_access: bool | None = None
    exposed_ports: list[int] | None = items()
    file_systems: list[Any] | None = items()
    wait: bool | None = None
    max_pending_secs: int | None = None
    auto_resume: bool | None = None


class PoolRequest(_SpecFields):
    max_containers: int | None = Field(None, ge=1)
    warm_containers: int | None = Field(None, ge=0)


def _spec(
    req: _SpecFields,
    cfg: TensorlakeSettings,
    ns: str,
    *,
    name: str | None = None,
    snapshot_id: str | None = None,
) -> SandboxSpec:
    """The corral spec for a Tensorlake create or pool; options corral cannot honour
    are refused, never dropped."""
    res = req.resources or _Resources()
    gpus = _gpu_count(res.gpus) if res.gpus else 0
    if req.entrypoint:
        raise refuse("entrypoint", "start the command with sandbox.start_process() instead")
    network: NetworkMode | dict[str, list[str]] = cfg.network
    if req.network is not None:
        if not req.network.allow_internet_access:
            network = NetworkMode.NONE
        elif req.network.allow_out or req.network.deny_out:  # an egress policy
            network = out_rules(list(req.network.allow_out), list(req.network.deny_out))
    tags = [TAG, scope.ns_tag(ns)]
    if name is not None:
        tags.append(NAME_TAG + check_name(name))
    fields: dict[str, Any] = {"tags": tags}
    if snapshot_id is None or req.image is not None:
        fields["image"] = cfg.image(req.image)
    if snapshot_id is not None:
        fields["snapshot"] = snapshot_id  # unset fields come from the snapshot
    if snapshot_id is None or req.network is not None:
        fields["network"] = network
    for key in ("cpus", "memory_mb", "disk_mb"):
        if getattr(res, key) is not None:
            fields[key] = getattr(res, key)
    if req.timeout_secs:
        fields["timeout"] = req.timeout_secs
    if gpus:  # exclusive GPUs of this host (runtime.gpus), like Tensorlake's own
        fields["gpus"] = gpus
    elif fields.get("network") == NetworkMode.NONE:  # what CRIU can dump: suspend
        fields["checkpointable"] = True  # then hibernates it (docs/live.md)
    return SandboxSpec.parse(fields)


def _gpu_count(requests: list[Any]) -> int:
    """The GPUs a Tensorlake ``resources.gpus`` list asks for: the sum of its ``count``s.
    Its ``model`` (the SDK sends ``A10`` unless told) is not a selector here: a corral
    host has the GPUs it has, and ``info`` names them."""
    total = 0
    for req in requests:
        count = req.get("count", 1) if isinstance(req, dict) else None
        if isinstance(count, bool) or not isinstance(count, int) or count < 1:
            raise InvalidArgument("resources.gpus: each entry needs a positive integer "
                                  f"'count', got {req!r}")
        total += count
    return total


async def _body(request: Request, model: type[BaseModel], what: str) -> Any:
    return validate_model(model, await read_json(request, what, required=False), what)


# ------------------------------------------------------------------ sandboxes


async def create_sandbox(request: Request) -> Response:
    engine, ns = ctx.engine(request), namespace(request)
    req: CreateRequest = await _body(request, CreateRequest, "Tensorlake sandbox request")
    if req.file_systems:
        raise refuse("file_systems mounts", "copy files in with sandbox.write_file()")
    if req.exposed_ports:
        raise refuse("exposed_ports", "corral sandboxes have no ingress proxy")
    owner = ctx.owner(request)
    snap = None if req.snapshot_id is None else scope.snapshot(engine, req.snapshot_id, ns,
                                                                owner).id
    spec = _spec(req, settings(request), ns, name=req.name, snapshot_id=snap)
    if snap is None:
        check_image(engine, req.image, spec.image)
    if req.name is not None:
        holders = ctx.service(request).own(  # names are per tenant: never another's
            caller_of(request), engine.list(tags=[NAME_TAG + req.name, scope.ns_tag(ns)],
                                            state=LIVE_STATES, owner=owner))
        if holders:
            raise InvalidState(
                f"the name {req.name!r} is held by sandbox {holders[0].id}: connect to it, "
                "delete it, or choose another name",
                details={"name": req.name, "sandbox_id": holders[0].id},
            )
    service = ctx.service(request)
    caller = caller_of(request)
    spec = service.plan(await service.with_image(spec, caller), caller,
                        host_network=ctx.host_network_allowed(request), frontend="tensorlake")
    created = await unless_gone(request, service.create(spec, caller))
    status = 202 if req.wait is False else 200
    return JSONResponse(created_json(created, sandbox_url(request)), status_code=status)


def _pool_ready_ids(pools: PoolManager, owner: str | None) -> set[str]:
    return {sid for p in pools.details(owner=owner) for sid in p.ready_ids}


async def list_sandboxes(request: Request) -> Response:
    ns, url = namespace(request), sandbox_url(request)
    owner = ctx.owner(request)
    warm = _pool_ready_ids(ctx.pools(request), owner)  # a pool's idle ones are not handed out
    infos = ctx.engine(request).list(tags=[scope.ns_tag(ns)], owner=owner)
    return JSONResponse(
        {"sandboxes": [sandbox_json(i, ns, url) for i in infos if i.id not in warm]}
    )


def _target(request: Request) -> SandboxInfo:
    return scope.resolve(ctx.engine(request), request.path_params["sandbox_id"], namespace(request),
                         caller_of(request))


async def get_sandbox(request: Request) -> Response:
    info = _target(request)
    return JSONResponse(sandbox_json(info, namespace(request), sandbox_url(request)))


async def delete_sandbox(request: Request) -> Response:
    sid = _target(request).id
    tensorlake_sandbox.processes(request).drop(sid)
    await ctx.service(request).delete(sid, caller_of(request))
    return JSONResponse({})


async def suspend_sandbox(request: Request) -> Response:
    """Tensorlake's suspend keeps memory: a checkpointable sandbox is hibernated (its
    processes to disk, its memory freed), any other frozen, as is one CRIU refuses
    (its memory kept resident instead)."""
    target, verbs = _target(request), ctx.sandboxes(request)
    info = None
    if target.spec.checkpointable and target.state == SandboxState.RUNNING:
        try:
            info = await verbs.hibernate(target.id)
        except Unsupported as exc:  # no CRIU here, or a process it refuses: frozen
            log.warning("suspend of sandbox %s froze it: it could not hibernate (%s)",
                        target.id, exc.message)
    if info is None:
        info = await verbs.pause(target.id)
    return JSONResponse(sandbox_json(info, namespace(request), sandbox_url(request)))


async def resume_sandbox(request: Request) -> Response:
    info = await ctx.sandboxes(request).resume(_target(request).id)
    return JSONResponse(sandbox_json(info, namespace(request), sandbox_url(request)))


class _SnapshotRequest(Body):
    snapshot_type: Text | None = None


async def snapshot_sandbox(request: Request) -> Response:
    body: _SnapshotRequest = await _body(request, _SnapshotRequest, "snapshot request")
    if body.snapshot_type not in (None, "filesystem"):
        raise refuse(
            f"{body.snapshot_type!r} snapshots",
            "corral snapshots hold a sandbox's files, not its memory: leave out "
            "snapshot_type or use SnapshotType.FILESYSTEM",
        )
    snap = await ctx.sandboxes(request).snapshot(_target(request).id)
    return JSONResponse({"snapshot_id": snap.id, "status": "completed"})


async def list_sandbox_snapshots(request: Request) -> Response:
    sid, ns = _target(request).id, namespace(request)
    snaps = [s for s in scope.snapshots(ctx.engine(request), ns, ctx.owner(request))
             if s.source_sandbox == sid]
    return JSONResponse({"snapshots": [snapshot_json(s, ns) for s in snaps]})


async def copy_sandbox(request: Request) -> Response:
    """``times`` new sandboxes with this one's files and spec, like the native fork:
    one snapshot, creates through admission control, all or nothing."""
    raw = request.query_params.get("times", "1")
    if not raw.isdecimal() or not 1 <= int(raw) <= MAX_COPIES:
        raise InvalidArgument(f"times must be a whole number from 1 to {MAX_COPIES}, got {raw!r}")
    source = _target(request)
    tags = [t for t in source.spec.tags if not t.startswith(NAME_TAG)]  # names are unique
    try:
        ok = await ctx.service(request).fork(
            source.id, int(raw), caller_of(request), tags=tags,
            abandoned=request.is_disconnected,
            frontend="tensorlake", live=False,  # its files, as Tensorlake's copy
        )
    except Abandoned:
        raise ClientDisconnect() from None
    url = sandbox_url(request)
    return JSONResponse(
        {"source_sandbox_id": source.id, "sandboxes": [created_json(i, url) for i in ok]}
    )


# ------------------------------------------------------------------ snapshots


async def list_snapshots(request: Request) -> Response:
    ns = namespace(request)
    snaps = scope.snapshots(ctx.engine(request), ns, ctx.owner(request))
    return JSONResponse({"snapshots": [snapshot_json(s, ns) for s in snaps]})


def _snapshot(request: Request) -> SnapshotInfo:
    ref = request.path_params["snapshot_id"]
    return scope.snapshot(ctx.engine(request), ref, namespace(request), ctx.owner(request))


async def get_snapshot(request: Request) -> Response:
    return JSONResponse(snapshot_json(_snapshot(request), namespace(request)))


async def delete_snapshot(request: Request) -> Response:
    snap = _snapshot(request)
    if not await ctx.engine(request).delete_snapshot(snap.id, owner=ctx.owner(request)):
        raise SnapshotNotFound(f"no snapshot {snap.id!r}", details={"snapshot_id": snap.id})
    return JSONResponse({})


# ---------------------------------------------------------------------- pools


def _pool_json(request: Request, got: PoolDetail, *, detail: bool) -> dict[str, Any]:
    spec = got.spec
    body: dict[str, Any] = {
        "id": got.name,
        "namespace": namespace(request),
        "image": spec.image,
        "resources": resources(spec.cpus, spec.memory_mb, spec.disk_mb),
        "timeout_secs": int(spec.timeout),
        "max_containers": got.max_size,
        "warm_containers": got.min_ready,
        "created_at": got.created_at,
    }
    if detail:
        body["containers"] = [
            {"id": sid, "state": "Idle", "sandbox_id": None, "executor_id": "corral"}
            for sid in got.ready_ids
        ] + [
            {"id": sid, "state": "Running", "sandbox_id": sid, "executor_id": "corral"}
            for sid in got.acquired_ids
        ]
    return body


async def create_pool(request: Request) -> Response:
    engine, ns = ctx.engine(request), namespace(request)
    req: PoolRequest = await _body(request, PoolRequest, "Tensorlake pool request")
    spec = _spec(req, settings(request), ns)
    check_image(engine, req.image, spec.image)
    warm = req.warm_containers or 0
    made = ctx.pools(request).create_pool(
        None, spec, min_ready=warm, max_size=req.max_containers or max(DEFAULT_MAX_SIZE, warm),
        owner=ctx.owner(request))
    return JSONResponse({"pool_id": made.name, "namespace": ns})


async def list_pools(request: Request) -> Response:
    found = scope.pools(ctx.pools(request), namespace(request), ctx.owner(request))
    return JSONResponse({"pools": [_pool_json(request, p, detail=False) for p in found]})


async def get_pool(request: Request) -> Response:
    got = scope.pool(ctx.pools(request), request.path_params["pool_id"], namespace(request),
                     ctx.owner(request))
    return JSONResponse(_pool_json(request, got, detail=True))


async def delete_pool(request: Request) -> Response:
    owner = ctx.owner(request)
    name = scope.pool(ctx.pools(request), request.path_params["pool_id"], namespace(request),
                      owner).name
    if not await ctx.pools(request).delete_pool(name, owner=owner):
        raise NotFound(f"no sandbox pool {name!r}", details={"pool": name})
    return JSONResponse({})


def _claim_timeout(request: Request) -> float:
    """How long a claim may wait: the client's own request timeout, less a margin
    for the reply (it sends ``X-Tensorlake-Request-Timeout-Ms``)."""
    raw = request.headers.get("x-tensorlake-request-timeout-ms", "")
    if not raw.isdecimal():
        return DEFAULT_ACQUIRE_TIMEOUT_S
    return min(max(int(raw) / 1000 - 5, 1.0), MAX_ACQUIRE_TIMEOUT_S)


class _ClaimRequest(Body):
    file_systems: list[Any] | None = items()


async def claim_sandbox(request: Request) -> Response:
    body: _ClaimRequest = await _body(request, _ClaimRequest, "claim request")
    if body.file_systems:
        raise refuse("file_systems mounts", "copy files in with sandbox.write_file()")
    pools = ctx.pools(request)
    owner = ctx.owner(request)
    name = scope.pool(pools, request.path_params["pool_id"], namespace(request), owner).name
    got = await unless_gone(request, pools.acquire(name, _claim_timeout(request), owner=owner))
    return JSONResponse(created_json(got, sandbox_url(request)))


# ---------------------------------------------------------------------- table

_SB = "/sandboxes/{sandbox_id}"
_POOL = "/sandbox-pools/{pool_id}"
LIFECYCLE = (
    ("POST", "/sandboxes", create_sandbox),
    ("GET", "/sandboxes", list_sandboxes),
    ("GET", _SB, get_sandbox),
    ("DELETE", _SB, delete_sandbox),
    ("POST", _SB + "/suspend", suspend_sandbox),
    ("POST", _SB + "/resume", resume_sandbox),
    ("POST", _SB + "/snapshot", snapshot_sandbox),
    ("GET", _SB + "/snapshots", list_sandbox_snapshots),
    ("POST", _SB + "/copy", copy_sandbox),
    ("GET", "/snapshots", list_snapshots),
    ("GET", "/snapshots/{snapshot_id}", get_snapshot),
    ("DELETE", "/snapshots/{snapshot_id}", delete_snapshot),
    ("POST", "/sandbox-pools", create_pool),
    ("GET", "/sandbox-pools", list_pools),
    ("GET", _POOL, get_pool),
    ("DELETE", _POOL, delete_pool),
    ("POST", _POOL + "/sandboxes", claim_sandbox),
)


def routes() -> list[Route]:
    """The Tensorlake routes, namespaced and flat, then 501 for the rest of its API."""
    out = [
        Route(prefix + path, flat_errors(handler), methods=[method])
        for prefix in (scope.NS_PREFIX, "")
        for method, path, handler in LIFECYCLE
    ]
    out += tensorlake_sandbox.routes()
    rest = unsupported(SERVICE)
    for prefix in (scope.NS_PREFIX, "/sandboxes", "/snapshots", "/sandbox-pools"):
        out.append(Route(prefix + "/{rest:path}", rest, methods=ALL_METHODS))
    out.append(Route("/archived-sandboxes", rest, methods=ALL_METHODS))
    return out


def mount(app: Starlette) -> None:
    """Serve the Tensorlake API on ``app`` too (its settings are read from the
    environment now: a malformed one stops the daemon from starting).

    Its routes sit behind the native ones, as the app router's fallback: a request no
    native route matches (not even by path) comes here, inside the same guard and
    error handling; what matches nothing here either gets the native 404. The native
    table (and ``/openapi.json``, which documents corral's own API) stays as it is.
    """
    app.state.tensorlake_settings = TensorlakeSettings.from_env()
    table = app.state.tensorlake_processes = tensorlake_sandbox.ProcessTable()
    # A sandbox that ends however it ends (deleted natively, expired, revoked) drops its
    # processes' kept lines and their room in the output budget, as E2B's front-end does
    # (they stayed until a later start_process pruned them: tests/security/test_door_revocation).
    app.state.engine.events.subscribe(SandboxEnded, lambda e: table.drop(e.sandbox_id))
    app.router.default = Router(routes=routes(), default=app.router.default)
