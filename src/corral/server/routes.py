"""The endpoints of API v1, as one table that both routes requests and describes them.

:data:`ENDPOINTS` is the single source: :func:`build_routes` turns it into Starlette
routes and :mod:`corral.server.openapi` into ``GET /openapi.json``, so a route cannot
exist without being documented. Handlers find the engine, the admission control and
the settings on ``request.app.state`` (see :func:`corral.server.create_app`).
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
from collections.abc import Awaitable
from typing import Any, TypeVar

from starlette.requests import ClientDisconnect, Request
from starlette.responses import JSONResponse, Response

import corral
from corral.errors import CorralError, Forbidden, InvalidArgument
from corral.pool_schema import AcquireRequest, PoolSpec
from corral.runtime.engine import Engine
from corral.runtime.pathutil import resolve_path
from corral.runtime.pools import PoolManager
from corral.schema import (
    NetworkMode,
    SandboxInfo,
    SandboxSpec,
    SandboxState,
    validate_model,
)
from corral.server.admission import Admission
from corral.server.endpoint import RAW
from corral.server.limits import check_host_limits
from corral.server.models import (
    ExecRequest,
    ForkRequest,
    MkdirRequest,
    SnapshotRequest,
    StopRequest,
    exec_response,
    file_json,
)
from corral.server.settings import ServerSettings
from corral.server.streaming import start_stream
from corral.server.wire import read_body, read_json

logger = logging.getLogger("corral.server")

T = TypeVar("T")


# ----------------------------------------------------------------------- helpers


def _engine(request: Request) -> Engine:
    return request.app.state.engine


def _admission(request: Request) -> Admission:
    return request.app.state.admission


def _settings(request: Request) -> ServerSettings:
    return request.app.state.settings


def _pools(request: Request) -> PoolManager:
    return request.app.state.pools


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


async def _watch_disconnect(request: Request) -> None:
    while (await request.receive())["type"] != "http.disconnect":
        pass


async def unless_disconnected(request: Request, work: Awaitable[T]) -> T:
    """Await ``work``, cancelling it if the client hangs up first (a queued create
    leaves the queue, a command is killed); then raise :class:`ClientDisconnect`."""
    task = asyncio.ensure_future(work)
    watch = asyncio.ensure_future(_watch_disconnect(request))
    try:
        await asyncio.wait({task, watch}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        watch.cancel()
        if not task.done():
            task.cancel()
            await asyncio.wait({task})  # let it clean up; never raises
    if task.cancelled():
        raise ClientDisconnect()
    return task.result()


def _info_json(info: SandboxInfo) -> dict[str, Any]:
    return info.model_dump(mode="json")


# ---------------------------------------------------------------------- daemon


async def health(request: Request) -> Response:
    return JSONResponse({"status": "ok"})


async def info(request: Request) -> Response:
    engine, admission = _engine(request), _admission(request)
    admission.prune()
    counts = {state.value: 0 for state in SandboxState}
    counts.update(engine.counts())
    lim = admission.limits
    return JSONResponse(
        {
            "version": corral.__version__,
            "cgroup_version": engine.cgroups.version,
            "capacity": dataclasses.asdict(lim),
            "committed_memory_mb": admission.committed_memory_mb,
            "starting": admission.starting,
            "queued": admission.queued,
            "counts": counts,
            "pools": [p.model_dump(mode="json") for p in _pools(request).list_pools()],
        }
    )


# ------------------------------------------------------------------- sandboxes


async def create_admitted(engine: Engine, admission: Admission, spec: SandboxSpec) -> SandboxInfo:
    """Create a sandbox once admission control lets it start (also a pool's refills); a
    ``snapshot`` is resolved first, so admission counts the memory it will really get."""
    spec = engine.resolve_spec(spec)
    check_host_limits(spec)
    async with admission.admit(spec.memory_mb) as slot:
        created = await engine.create(spec)
        slot.commit(created.id)
        return created


async def delete_admitted(engine: Engine, admission: Admission, sandbox_id: str) -> None:
    """Delete a sandbox and give its place back to admission control."""
    await engine.delete(sandbox_id)
    admission.release(sandbox_id)


async def _unless_gone(request: Request, work: Awaitable[SandboxInfo]) -> SandboxInfo:
    """``work`` gets a sandbox for the client; if the client left meanwhile, delete it."""
    got = await unless_disconnected(request, work)
    if await request.is_disconnected():  # it left just as the sandbox became ready
        await delete_admitted(_engine(request), _admission(request), got.id)
        _pools(request).release(got.id)
        raise ClientDisconnect()
    return got


def _check_network(request: Request, spec: SandboxSpec) -> None:
    """``network="host"`` hands a sandbox the host's network (its services, the cloud
    metadata address): over TCP only if the daemon was started to allow it."""
    if spec.network != NetworkMode.HOST or _settings(request).allow_host_network:
        return
    if request.scope.get("server") == (str(_settings(request).socket.absolute()), None):
        return  # the Unix socket: the daemon's owner
    raise Forbidden(
        "network='host' gives the sandbox the host's network: over TCP it needs a daemon "
        "started with --allow-host-network (the Unix socket may always ask for it)",
        details={"field": "network"},
    )


async def create_sandbox(request: Request) -> Response:
    engine, admission = _engine(request), _admission(request)
    # Parsed from the body as sent: a snapshot's spec fills in only the fields left out.
    spec = SandboxSpec.parse(await read_json(request, "sandbox spec", required=False))
    spec = engine.resolve_spec(spec)  # SnapshotNotFound now, not after waiting in the queue
    engine.images.get(spec.image)  # ImageNotFound now, too
    _check_network(request, spec)
    created = await _unless_gone(request, create_admitted(engine, admission, spec))
    return JSONResponse(_info_json(created), status_code=201)


async def list_sandboxes(request: Request) -> Response:
    states = request.query_params.getlist("state") or None
    infos = _engine(request).list(tags=request.query_params.getlist("tag"), state=states)
    return JSONResponse({"sandboxes": [_info_json(i) for i in infos]})


async def get_sandbox(request: Request) -> Response:
    engine, sid = _engine(request), _sid(request)
    body = _info_json(engine.get(sid))
    if body["state"] in (SandboxState.RUNNING.value, SandboxState.PAUSED.value):
        try:
            body["usage"] = engine.usage(sid)
        except (CorralError, OSError):
            pass  # it ended meanwhile
    return JSONResponse(body)


async def pause_sandbox(request: Request) -> Response:
    return JSONResponse(_info_json(await _engine(request).pause(_sid(request))))


async def kill_processes(request: Request) -> Response:
    return JSONResponse({"killed": await _engine(request).kill_processes(_sid(request))})


async def resume_sandbox(request: Request) -> Response:
    return JSONResponse(_info_json(await _engine(request).resume(_sid(request))))


async def stop_sandbox(request: Request) -> Response:
    body = validate_model(
        StopRequest, await read_json(request, "stop request", required=False), "stop request"
    )
    stopped = await _engine(request).stop(_sid(request), grace=body.grace)
    _admission(request).release(stopped.id)
    _pools(request).release(stopped.id)
    return JSONResponse(_info_json(stopped))


async def delete_sandbox(request: Request) -> Response:
    sid = _sid(request)
    await delete_admitted(_engine(request), _admission(request), sid)
    _pools(request).release(sid)
    return _no_content()


async def snapshot_sandbox(request: Request) -> Response:
    body = validate_model(
        SnapshotRequest, await read_json(request, "snapshot request", required=False),
        "snapshot request",
    )
    made = await _engine(request).snapshot(_sid(request), name=body.name)
    return JSONResponse(made.model_dump(mode="json"), status_code=201)


async def fork_sandbox(request: Request) -> Response:
    """A snapshot, then ``n`` creates from it through admission control; the snapshot
    is deleted at once (its layers stay while the copies run). All or nothing."""
    body = validate_model(ForkRequest, await read_json(request, "fork request"), "fork request")
    engine, admission, sid = _engine(request), _admission(request), _sid(request)
    admission.check_fits(engine.get(sid).spec.memory_mb, body.n)  # all or nothing: at once
    snap = await engine.snapshot(sid)
    try:
        spec = engine.fork_spec(sid, snap.id)
        made = await asyncio.gather(
            *(create_admitted(engine, admission, spec) for _ in range(body.n)),
            return_exceptions=True,
        )
    finally:
        await engine.delete_snapshot(snap.id)
    ok = [r for r in made if isinstance(r, SandboxInfo)]
    failed = [r for r in made if isinstance(r, BaseException)]
    if failed or await request.is_disconnected():
        await asyncio.gather(*(delete_admitted(engine, admission, r.id) for r in ok))
        if failed:
            raise failed[0]
        raise ClientDisconnect()
    return JSONResponse({"sandboxes": [_info_json(i) for i in ok]}, status_code=201)


# ------------------------------------------------------------------- snapshots


def _snapshot_ref(request: Request) -> str:
    return request.path_params["id_or_name"]


async def list_snapshots(request: Request) -> Response:
    snaps = _engine(request).list_snapshots()
    return JSONResponse({"snapshots": [s.model_dump(mode="json") for s in snaps]})


async def get_snapshot(request: Request) -> Response:
    return JSONResponse(_engine(request).get_snapshot(_snapshot_ref(request)).model_dump(mode="json"))


async def delete_snapshot(request: Request) -> Response:
    await _engine(request).delete_snapshot(_snapshot_ref(request))
    return _no_content()


# ------------------------------------------------------------------------ exec


async def _exec_request(request: Request) -> dict[str, Any]:
    body = validate_model(ExecRequest, await read_json(request, "exec request"), "exec request")
    return {
        "cmd": body.cmd,
        "timeout": body.timeout,
        "env": body.env,
        "cwd": body.cwd,
        "stdin": body.stdin_bytes(),
        "max_output": body.max_output,
    }


async def exec_command(request: Request) -> Response:
    kwargs = await _exec_request(request)
    work = _engine(request).exec(_sid(request), **kwargs)
    return JSONResponse(exec_response(await unless_disconnected(request, work)))


async def exec_stream(request: Request) -> Response:
    kwargs = await _exec_request(request)
    return await start_stream(_engine(request).exec_stream(_sid(request), **kwargs))


# ----------------------------------------------------------------------- files


def _sandbox_path(request: Request, default: str | None = None) -> str:
    """The ``path`` query parameter, checked against the sandbox before any I/O."""
    workdir = _engine(request).get(_sid(request)).spec.workdir
    return resolve_path(workdir, _param(request, "path", default))


async def upload_file(request: Request) -> Response:
    engine, sid = _engine(request), _sid(request)
    path, mode = _sandbox_path(request), _octal_mode(request)
    data = await read_body(request, _settings(request).max_upload_bytes, "upload")
    try:
        await engine.write_file(sid, path, data, mode=mode)
    except CorralError:
        await _remove_partial(engine, sid, path)
        raise
    return _no_content()


async def _remove_partial(engine: Engine, sid: str, path: str) -> None:
    """After a failed upload, leave no half-written file behind."""
    try:
        if not (await engine.stat(sid, path)).is_dir:
            await engine.remove(sid, path)
    except CorralError:
        pass  # nothing was written, or the sandbox is gone


async def download_file(request: Request) -> Response:
    engine, sid = _engine(request), _sid(request)
    limit = _settings(request).max_upload_bytes
    data = await engine.read_file(sid, _sandbox_path(request), max_bytes=limit)
    return Response(data, media_type=RAW)


async def remove_file(request: Request) -> Response:
    recursive = _flag(request, "recursive", False)
    await _engine(request).remove(_sid(request), _sandbox_path(request), recursive=recursive)
    return _no_content()


async def list_files(request: Request) -> Response:
    entries = await _engine(request).list_dir(_sid(request), _sandbox_path(request, "."))
    return JSONResponse({"entries": [file_json(e) for e in entries]})


async def stat_file(request: Request) -> Response:
    return JSONResponse(file_json(await _engine(request).stat(_sid(request), _sandbox_path(request))))


async def make_dir(request: Request) -> Response:
    body = validate_model(MkdirRequest, await read_json(request, "mkdir request"), "mkdir request")
    await _engine(request).mkdir(_sid(request), body.path, parents=body.parents, mode=body.mode)
    return _no_content()


# ----------------------------------------------------------------------- pools


def _pool_name(request: Request) -> str:
    return request.path_params["name"]


async def create_pool(request: Request) -> Response:
    body = validate_model(PoolSpec, await read_json(request, "pool", required=False), "pool")
    _check_network(request, body.spec)
    made = _pools(request).create_pool(
        body.name, body.spec, min_ready=body.min_ready, max_size=body.max_size
    )
    return JSONResponse(made.model_dump(mode="json"), status_code=201)


async def list_pools(request: Request) -> Response:
    return JSONResponse({"pools": [p.model_dump(mode="json") for p in _pools(request).list_pools()]})


async def get_pool(request: Request) -> Response:
    return JSONResponse(_pools(request).get_pool(_pool_name(request)).model_dump(mode="json"))


async def delete_pool(request: Request) -> Response:
    await _pools(request).delete_pool(_pool_name(request))
    return _no_content()


async def acquire_from_pool(request: Request) -> Response:
    body = validate_model(
        AcquireRequest, await read_json(request, "acquire request", required=False),
        "acquire request",
    )
    work = _pools(request).acquire(_pool_name(request), body.timeout)
    return JSONResponse(_info_json(await _unless_gone(request, work)))


# ----------------------------------------------------------------------- table
