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
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Any, TypeVar

from starlette.requests import ClientDisconnect, Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

import corral
from corral.errors import CorralError, InvalidArgument
from corral.image_schema import BuildEvent, BuildRequest, ImageInfo, ImageList
from corral.pool_schema import AcquireRequest, PoolDetail, PoolInfo, PoolList, PoolSpec
from corral.runtime.engine import Engine
from corral.runtime.pathutil import resolve_path
from corral.runtime.pools import PoolManager
from corral.schema import (
    FileInfo,
    SandboxInfo,
    SandboxSpec,
    SandboxState,
    SnapshotInfo,
    validate_model,
)
from corral.server.admission import Admission
from corral.server.image_routes import (
    build_image,
    delete_image,
    get_image,
    import_image_route,
    list_images,
)
from corral.server.limits import check_host_limits
from corral.server.models import (
    DaemonInfo,
    ExecRequest,
    ExecResponse,
    FileList,
    ForkRequest,
    Health,
    KilledProcesses,
    MkdirRequest,
    SandboxDetail,
    SandboxList,
    SnapshotList,
    SnapshotRequest,
    StopRequest,
    exec_response,
    file_json,
)
from corral.server.processes import (
    ExchangeRequest,
    ExchangeResponse,
    ProcessInfo,
    ProcessList,
    SignalRequest,
    SpawnRequest,
    exchange,
    exchange_many,
    get_process,
    kill_process,
    list_processes,
    read_output,
    signal_process,
    spawn_process,
    write_stdin,
)
from corral.server.settings import ServerSettings
from corral.server.streaming import start_stream
from corral.server.wire import read_body, read_json

logger = logging.getLogger("corral.server")

T = TypeVar("T")
RAW = "application/octet-stream"  # a body or reply of raw bytes
NDJSON = "application/x-ndjson"  # a reply of one JSON object per line
Handler = Callable[[Request], Awaitable[Response]]


@dataclass(frozen=True)
class Query:
    """A query parameter, for the OpenAPI document."""

    name: str
    type: str
    description: str
    required: bool = False
    repeat: bool = False


@dataclass(frozen=True)
class Endpoint:
    """One route: what it takes and what it gives back (``reply`` None means 204)."""

    method: str
    path: str
    handler: Handler
    summary: str
    body: Any = None
    reply: Any = None
    status: int = 200
    query: tuple[Query, ...] = ()


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


async def create_sandbox(request: Request) -> Response:
    engine, admission = _engine(request), _admission(request)
    # Parsed from the body as sent: a snapshot's spec fills in only the fields left out.
    spec = SandboxSpec.parse(await read_json(request, "sandbox spec", required=False))
    spec = engine.resolve_spec(spec)  # SnapshotNotFound now, not after waiting in the queue
    engine.images.get(spec.image)  # ImageNotFound now, too
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
    snap = await engine.snapshot(sid)
    try:
        spec = engine.get(sid).spec.model_copy(update={"snapshot": snap.id})
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

_SB = "/v1/sandboxes/{sandbox_id}"
_POOL = "/v1/pools/{name}"
_SNAP = "/v1/snapshots/{id_or_name}"
_IMAGE = "/v1/images/{name}"
_PROC = _SB + "/processes/{process_id}"
_PATH = Query(
    "path", "string", "a path in the sandbox (relative ones start at its workdir)", required=True
)

ENDPOINTS: tuple[Endpoint, ...] = (
    Endpoint("GET", "/v1/health", health, "Is the daemon up", reply=Health),
    Endpoint("GET", "/v1/info", info, "Version, limits and what is in use", reply=DaemonInfo),
    Endpoint(
        "POST",
        "/v1/sandboxes",
        create_sandbox,
        "Create a sandbox (waits for room)",
        body=SandboxSpec,
        reply=SandboxInfo,
        status=201,
    ),
    Endpoint(
        "GET",
        "/v1/sandboxes",
        list_sandboxes,
        "List sandboxes",
        reply=SandboxList,
        query=(
            Query("tag", "string", "carries this tag (all must match)", repeat=True),
            Query("state", "string", "is in this state (any may match)", repeat=True),
        ),
    ),
    Endpoint("GET", _SB, get_sandbox, "One sandbox, with usage while alive", reply=SandboxDetail),
    Endpoint("POST", _SB + "/pause", pause_sandbox, "Freeze a sandbox", reply=SandboxInfo),
    Endpoint("POST", _SB + "/resume", resume_sandbox, "Thaw a sandbox", reply=SandboxInfo),
    Endpoint(
        "POST",
        _SB + "/kill-processes",
        kill_processes,
        "SIGKILL every process the sandbox's code started; the sandbox stays running",
        reply=KilledProcesses,
    ),
    Endpoint(
        "POST",
        _SB + "/stop",
        stop_sandbox,
        "Stop a sandbox (record kept)",
        body=StopRequest,
        reply=SandboxInfo,
    ),
    Endpoint("DELETE", _SB, delete_sandbox, "Delete a sandbox (idempotent)", status=204),
    Endpoint(
        "POST",
        _SB + "/snapshot",
        snapshot_sandbox,
        "Commit a sandbox's files as a snapshot (create from it with snapshot=)",
        body=SnapshotRequest,
        reply=SnapshotInfo,
        status=201,
    ),
    Endpoint(
        "POST",
        _SB + "/fork",
        fork_sandbox,
        "Start n copies of a sandbox's files and spec (each waits for room)",
        body=ForkRequest,
        reply=SandboxList,
        status=201,
    ),
    Endpoint(
        "POST",
        _SB + "/exec",
        exec_command,
        "Run a command to completion",
        body=ExecRequest,
        reply=ExecResponse,
    ),
    Endpoint(
        "POST",
        _SB + "/exec/stream",
        exec_stream,
        "Run a command, streaming its output",
        body=ExecRequest,
        reply=NDJSON,
    ),
    Endpoint(
        "POST",
        _SB + "/processes",
        spawn_process,
        "Start an interactive process (stdin stays open; see docs/api.md)",
        body=SpawnRequest,
        reply=ProcessInfo,
        status=201,
    ),
    Endpoint("GET", _SB + "/processes", list_processes, "List processes", reply=ProcessList),
    Endpoint("GET", _PROC, get_process, "One process, with its result once exited",
             reply=ProcessInfo),
    Endpoint(
        "POST",
        _PROC + "/stdin",
        write_stdin,
        "Write to a process's stdin (raw body); close=true closes it after",
        body=RAW,
        status=204,
        query=(Query("close", "boolean", "close stdin after writing the body"),),
    ),
    Endpoint(
        "GET",
        _PROC + "/output",
        read_output,
        "Stream a process's unread output, then its exit (leaving does not kill it)",
        reply=NDJSON,
    ),
    Endpoint(
        "POST",
        _PROC + "/exchange",
        exchange,
        "Write the body to stdin, reply with the next line of stdout (empty: it exited)",
        body=RAW,
        reply=RAW,
        query=(Query("timeout", "number", "seconds to wait for the line (default: none)"),),
    ),
    Endpoint(
        "POST",
        "/v1/processes/exchange",
        exchange_many,
        "Write to many processes, then read one line from each, in one request",
        body=ExchangeRequest,
        reply=ExchangeResponse,
    ),
    Endpoint(
        "POST", _PROC + "/signal", signal_process, "Signal a process's group",
        body=SignalRequest, status=204,
    ),
    Endpoint("DELETE", _PROC, kill_process, "Kill a process and forget it (idempotent)",
             status=204),
    Endpoint(
        "PUT",
        _SB + "/files",
        upload_file,
        "Write a file (parents created)",
        body=RAW,
        status=204,
        query=(_PATH, Query("mode", "string", "octal permissions, e.g. 0644")),
    ),
    Endpoint("GET", _SB + "/files", download_file, "Read a file", reply=RAW, query=(_PATH,)),
    Endpoint(
        "DELETE",
        _SB + "/files",
        remove_file,
        "Remove a file or directory",
        status=204,
        query=(_PATH, Query("recursive", "boolean", "remove a directory's contents too")),
    ),
    Endpoint(
        "GET",
        _SB + "/files/list",
        list_files,
        "List a directory",
        reply=FileList,
        query=(Query("path", "string", "the directory (default: the workdir)"),),
    ),
    Endpoint(
        "GET", _SB + "/files/stat", stat_file, "Describe a file", reply=FileInfo, query=(_PATH,)
    ),
    Endpoint(
        "POST", _SB + "/files/mkdir", make_dir, "Make a directory", body=MkdirRequest, status=204
    ),
    Endpoint(
        "POST", "/v1/pools", create_pool, "Create a warm pool", body=PoolSpec, reply=PoolInfo,
        status=201,
    ),
    Endpoint("GET", "/v1/pools", list_pools, "List warm pools", reply=PoolList),
    Endpoint("GET", _POOL, get_pool, "One pool, with its sandboxes' ids", reply=PoolDetail),
    Endpoint("DELETE", _POOL, delete_pool, "Delete a pool and its ready sandboxes", status=204),
    Endpoint(
        "POST",
        _POOL + "/acquire",
        acquire_from_pool,
        "Hand out a live sandbox of the pool (delete it after use)",
        body=AcquireRequest,
        reply=SandboxInfo,
    ),
    Endpoint("GET", "/v1/snapshots", list_snapshots, "List snapshots", reply=SnapshotList),
    Endpoint("GET", "/v1/images", list_images, "List images", reply=ImageList),
    Endpoint("GET", _IMAGE, get_image, "One image", reply=ImageInfo),
    Endpoint(
        "DELETE", _IMAGE, delete_image,
        "Delete an image (idempotent; refused while sandboxes, snapshots or images use it)",
        status=204,
    ),
    Endpoint(
        "POST",
        "/v1/images/build",
        build_image,
        "Build an image from a spec (JSON, or a tar with build.json and context/), "
        "streaming its log",
        body=BuildRequest,
        reply=(NDJSON, BuildEvent),
    ),
    Endpoint(
        "POST",
        "/v1/images/import",
        import_image_route,
        "Import a docker save tarball or an OCI image layout (as a tar)",
        body=RAW,
        reply=ImageInfo,
        status=201,
        query=(Query("name", "string", "the image's name (one of that name is replaced)",
                     required=True),),
    ),
    Endpoint("GET", _SNAP, get_snapshot, "One snapshot, by id or name", reply=SnapshotInfo),
    Endpoint(
        "DELETE", _SNAP, delete_snapshot,
        "Delete a snapshot (idempotent; sandboxes started from it keep running)", status=204,
    ),
)


def build_routes() -> list[Route]:
    """Starlette routes for :data:`ENDPOINTS` plus ``GET /openapi.json``."""
    from corral.server.openapi import openapi_route

    routes = [Route(e.path, e.handler, methods=[e.method]) for e in ENDPOINTS]
    return [*routes, openapi_route(ENDPOINTS)]
