"""The handlers of the sandbox, snapshot, pool and daemon endpoints of API v1.

Each serves one operation declared in :mod:`corral.api.operations` (the wire contract
shared with the SDK); :mod:`corral.server.endpoints` binds them by name, so a route
cannot exist undeclared or undocumented. Handlers find the engine, the admission
control and the settings on ``request.app.state`` (see :func:`corral.server.create_app`).
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
from typing import Any, TypeVar

from starlette.requests import ClientDisconnect, Request
from starlette.responses import JSONResponse, Response

from corral._version import __version__
from corral.api.models import (
    ExecRequest,
    ForkRequest,
    MkdirRequest,
    SnapshotRequest,
    StopRequest,
    exec_response,
    file_json,
)
from corral.api.operation import RAW
from corral.errors import CorralError, InvalidArgument
from corral.pool_schema import PoolSpec
from corral.runtime.pathutil import resolve_path
from corral.schema import (
    SandboxInfo,
    SandboxSpec,
    SandboxState,
)
from corral.server import context as ctx
from corral.server.builds import builds_gate
from corral.server.caller import caller_of
from corral.server.context import unless_disconnected, unless_gone
from corral.server.reserved_tags import check_tags
from corral.server.service import Abandoned, check_network
from corral.server.streaming import start_stream
from corral.server.wire import HeldJSONResponse, body_pieces, file_response

logger = logging.getLogger("corral.server")

T = TypeVar("T")


# ----------------------------------------------------------------------- helpers


def _sid(request: Request) -> str:
    return request.path_params["sandbox_id"]


def _param(request: Request, name: str, default: str | None = None) -> str:
    value = request.query_params.get(name, default)
    if value is None:
        raise InvalidArgument(f"missing query parameter {name!r}, e.g. ?{name}=/workspace/x")
    return value


def _flag(request: Request, name: str, default: bool) -> bool:
    value = request.query_params.get(name)
    if value is None:
        return default
    if value.lower() in ("1", "true", "yes"):
        return True
    if value.lower() in ("0", "false", "no"):
        return False
    raise InvalidArgument(f"query parameter {name!r} must be true or false, got {value!r}")


def _octal_mode(request: Request) -> int:
    value = request.query_params.get("mode", "0644")
    try:
        mode = int(value, 8)
    except ValueError:
        mode = -1
    if not 0 <= mode <= 0o7777:
        raise InvalidArgument(f"invalid file mode {value!r}: use octal digits, e.g. mode=0644")
    return mode


def _no_content() -> Response:
    return Response(status_code=204)


def info_json(info: SandboxInfo, request: Request) -> dict[str, Any]:
    data = info.model_dump(mode="json")
    node = ctx.settings(request).node
    if node is None:
        del data["node"]  # outside a cluster the reply stays as it always was
    else:
        data["node"] = node
    return data


# ---------------------------------------------------------------------- daemon


async def health(request: Request) -> Response:
    return JSONResponse({"status": "ok"})


def _activity(request: Request) -> dict[str, float]:
    """Memory committed, creates starting and queued, image builds running: the
    daemon's in all for the admin, only its own for a tenant."""
    admission, builds, caller = ctx.admission(request), builds_gate(request), caller_of(request)
    if caller.tenant is None:
        return {"committed_memory_mb": admission.committed_memory_mb,
                "starting": admission.starting, "queued": admission.queued,
                "builds": builds.running}  # image builds now (server/builds.py)
    name = caller.name
    return {"committed_memory_mb": admission.quotas.usage(name or "").memory_mb,
            "starting": admission.starting_of(name), "queued": admission.queued_of(name),
            "builds": builds.running_of(name)}


async def info(request: Request) -> Response:
    engine, admission = ctx.engine(request), ctx.admission(request)
    counts = {state.value: 0 for state in SandboxState}
    counts.update(engine.counts(owner=ctx.owner(request)))  # the caller's own
    lim = admission.limits
    return JSONResponse(
        {
            "version": __version__,
            "cgroup_version": engine.cgroups.version,
            "capacity": dataclasses.asdict(lim),
            **_activity(request),  # the caller's own: a tenant never sees another's creates
            "counts": counts,
            # the GPU inventory; how many are free and who holds how many (a cluster's
            # autoscaler is shown that) is host activity: the admin's only
            "gpus": {"total": engine.gpus.total, **(
                {"free": len(engine.gpus.free()), "holding": engine.gpus.holding()}
                if caller_of(request).tenant is None else {})},
            "pools": [p.model_dump(mode="json")
                      for p in ctx.service(request).list_pools(caller_of(request))],
            "default_lease": ctx.settings(request).default_lease,  # server/leases.py
            # where it keeps its state (`corral doctor` checks those): the admin's only
            **({"state_dir": str(engine.layout.state_dir),
                "cache_dir": str(engine.layout.cache_dir)}
               if caller_of(request).tenant is None else {}),
            **({"node": node} if (node := ctx.settings(request).node) else {}),
        }
    )


# ------------------------------------------------------------------- sandboxes


async def create_sandbox(request: Request, spec: SandboxSpec) -> Response:
    service = ctx.service(request)
    # As sent (fields_set): a snapshot's spec fills in only the fields left out.
    caller = caller_of(request)
    spec = service.plan(await service.with_image(spec, caller), caller,
                        host_network=ctx.host_network_allowed(request))
    created = await unless_gone(request, service.create(spec, caller, wait=_wait_param(request)))
    return JSONResponse(info_json(created, request), status_code=201)


def _wait_param(request: Request) -> float | None:
    """``?wait=SECONDS``: the caller's deadline for waiting in admission control (for
    room, or for its tenant's quota); the daemon's ``queue_timeout`` caps it."""
    value = request.query_params.get("wait")
    if value is None:
        return None
    try:
        wait = float(value)
    except ValueError:
        wait = -1.0
    if not 0 <= wait < float("inf"):
        raise InvalidArgument(f"query parameter 'wait' must be seconds >= 0, got {value!r}")
    return wait


async def list_sandboxes(request: Request) -> Response:
    states = request.query_params.getlist("state") or None
    infos = ctx.service(request).list_sandboxes(  # the caller's own (admin: tenant= filters)
        caller_of(request), tags=request.query_params.getlist("tag"), states=states,
        tenant=request.query_params.get("tenant"),
    )
    return JSONResponse({"sandboxes": [info_json(i, request) for i in infos]})


async def get_sandbox(request: Request) -> Response:
    engine, sid = ctx.sandboxes(request), _sid(request)
    body = info_json(engine.get(sid), request)
    if body["state"] in (SandboxState.RUNNING.value, SandboxState.PAUSED.value):
        try:
            body["usage"] = engine.usage(sid)
        except (CorralError, OSError):
            pass  # it ended meanwhile
    return JSONResponse(body)


async def pause_sandbox(request: Request) -> Response:
    return JSONResponse(info_json(await ctx.sandboxes(request).pause(_sid(request)), request))


async def kill_processes(request: Request) -> Response:
    return JSONResponse({"killed": await ctx.sandboxes(request).kill_processes(_sid(request))})


async def resume_sandbox(request: Request) -> Response:
    return JSONResponse(info_json(await ctx.sandboxes(request).resume(_sid(request)), request))


async def hibernate_sandbox(request: Request) -> Response:
    return JSONResponse(info_json(await ctx.sandboxes(request).hibernate(_sid(request)),
                                   request))


async def stop_sandbox(request: Request, body: StopRequest) -> Response:
    stopped = await ctx.service(request).stop(_sid(request), caller_of(request), grace=body.grace)
    return JSONResponse(info_json(stopped, request))


async def delete_sandbox(request: Request) -> Response:
    await ctx.service(request).delete(_sid(request), caller_of(request))
    return _no_content()


async def snapshot_sandbox(request: Request, body: SnapshotRequest) -> Response:
    made = await ctx.sandboxes(request).snapshot(_sid(request), name=body.name)
    return JSONResponse(made.model_dump(mode="json"), status_code=201)


async def checkpoint_sandbox(request: Request, body: SnapshotRequest) -> Response:
    made = await ctx.sandboxes(request).checkpoint(_sid(request), name=body.name)
    return JSONResponse(made.model_dump(mode="json"), status_code=201)


async def fork_sandbox(request: Request, body: ForkRequest) -> Response:
    """A snapshot, then ``n`` creates from it through admission control; all or nothing."""
    try:
        made = await ctx.service(request).fork(
            _sid(request), body.n, caller_of(request), abandoned=request.is_disconnected,
            live=body.live,
        )
    except Abandoned:
        raise ClientDisconnect() from None
    return JSONResponse({"sandboxes": [info_json(i, request) for i in made]}, status_code=201)


# ------------------------------------------------------------------- snapshots


def _snapshot_ref(request: Request) -> str:
    return request.path_params["id_or_name"]


async def list_snapshots(request: Request) -> Response:
    snaps = ctx.service(request).list_snapshots(caller_of(request))
    return JSONResponse({"snapshots": [s.model_dump(mode="json") for s in snaps]})


async def get_snapshot(request: Request) -> Response:
    snap = ctx.engine(request).get_snapshot(_snapshot_ref(request), owner=ctx.owner(request))
    return JSONResponse(snap.model_dump(mode="json"))


async def delete_snapshot(request: Request) -> Response:
    await ctx.engine(request).delete_snapshot(_snapshot_ref(request), owner=ctx.owner(request))
    return _no_content()


# ------------------------------------------------------------------------ exec


def exec_args(body: ExecRequest) -> dict[str, Any]:
    return {
        "cmd": body.cmd,
        "timeout": body.timeout,
        "env": body.env,
        "cwd": body.cwd,
        "stdin": body.stdin_bytes(),
        "max_output": body.max_output,
        "output_tail": body.output_tail,
        "user": body.user,
    }


async def exec_command(request: Request, body: ExecRequest) -> Response:
    verbs, sid = ctx.sandboxes(request), _sid(request)
    hold = verbs.reserve_output(sid, body.max_output)  # kept until the reply is sent
    try:
        # started here (the agent hears of it a turn sooner), its end awaited in a task
        work = verbs.start_exec(sid, **exec_args(body), output_hold=hold)
        return HeldJSONResponse(exec_response(await unless_disconnected(request, work)), hold)
    except BaseException:
        hold.release()
        raise


async def exec_stream(request: Request, body: ExecRequest) -> Response:
    started = asyncio.Event()  # the reply waits for the command's start (or its error)
    return await start_stream(ctx.sandboxes(request).exec_stream(
        _sid(request), **exec_args(body), on_start=started.set), started)


# ----------------------------------------------------------------------- files


def _sandbox_path(request: Request, default: str | None = None) -> str:
    """The ``path`` query parameter, checked against the sandbox before any I/O."""
    workdir = ctx.sandboxes(request).get(_sid(request)).spec.workdir
    return resolve_path(workdir, _param(request, "path", default))


async def upload_file(request: Request) -> Response:
    sid, path, mode = _sid(request), _sandbox_path(request), _octal_mode(request)
    pieces = body_pieces(request, ctx.settings(request).max_upload_bytes, "upload")
    await ctx.write_whole(request, sid, path, pieces, mode=mode)
    return _no_content()


async def download_file(request: Request) -> Response:
    limit = ctx.settings(request).max_upload_bytes
    reading = await ctx.sandboxes(request).open_read(
        _sid(request), _sandbox_path(request), max_bytes=limit)
    return file_response(reading, RAW)


async def remove_file(request: Request) -> Response:
    recursive = _flag(request, "recursive", False)
    await ctx.sandboxes(request).remove(_sid(request), _sandbox_path(request), recursive=recursive)
    return _no_content()


async def list_files(request: Request) -> Response:
    entries = await ctx.sandboxes(request).list_dir(_sid(request), _sandbox_path(request, "."))
    return JSONResponse({"entries": [file_json(e) for e in entries]})


async def stat_file(request: Request) -> Response:
    return JSONResponse(file_json(await ctx.sandboxes(request).stat(_sid(request), _sandbox_path(request))))


async def make_dir(request: Request, body: MkdirRequest) -> Response:
    await ctx.sandboxes(request).mkdir(_sid(request), body.path, parents=body.parents, mode=body.mode)
    return _no_content()


# ----------------------------------------------------------------------- pools


def _pool_name(request: Request) -> str:
    return request.path_params["name"]


async def create_pool(request: Request, body: PoolSpec) -> Response:
    caller = caller_of(request)
    check_network(body.spec, host_network=ctx.host_network_allowed(request),
                  admin=caller.may_use_host_network)
    check_tags(body.spec.tags, "native")  # what its sandboxes carry: reserved_tags
    spec = await ctx.service(request).with_image(body.spec, caller)  # registry: pulled now
    made = ctx.pools(request).create_pool(
        body.name, spec, min_ready=body.min_ready, max_size=body.max_size, owner=caller.name)
    return JSONResponse(made.model_dump(mode="json"), status_code=201)


async def list_pools(request: Request) -> Response:
    pools = ctx.service(request).list_pools(caller_of(request))
    return JSONResponse({"pools": [p.model_dump(mode="json") for p in pools]})


async def get_pool(request: Request) -> Response:
    pool = ctx.pools(request).get_pool(_pool_name(request), owner=ctx.owner(request))
    return JSONResponse(pool.model_dump(mode="json"))


async def delete_pool(request: Request) -> Response:
    await ctx.pools(request).delete_pool(_pool_name(request), owner=ctx.owner(request))
    return _no_content()




# ----------------------------------------------------------------------- table
