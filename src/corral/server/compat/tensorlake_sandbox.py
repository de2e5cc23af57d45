"""Tensorlake's in-sandbox API (``/api/v1/...``): commands, background processes, files.

Tensorlake's client sends these to the sandbox's ``sandbox_url``: this daemon, under
``/v1/namespaces/{ns}`` when the sandbox was reached through a namespaced path (a call
sees that namespace's sandboxes only; the flat ``/api/v1/...`` sees ``default``'s).
It says which sandbox with ``Host: <sandbox_id>.local`` (when that URL is
``localhost`` / ``127.0.0.1``) or ``X-Tensorlake-Sandbox-Id`` (elsewhere); both are
honoured.

- ``POST /api/v1/processes/run`` runs a command to completion and streams it as
  server-sent events: ``{pid, started_at}``, then ``{line, stream, timestamp}`` per
  output line, then ``{exit_code, signal, oom_killed, reason}``, encoded straight from
  the engine's events (:func:`corral.server.streaming.start_events`): errors that happen
  at once get their own status, and a client that hangs up kills the command.
- ``POST /api/v1/processes`` starts a background process, one of the engine's
  interactive processes (:mod:`.tensorlake_process`): list it, read or follow its
  output, write its stdin (``stdin_mode="pipe"``), signal its process group, kill it.
  Managed processes (name, restart, health_check) and ``user`` are refused with 501.
- ``GET/PUT/DELETE /api/v1/files?path=`` and ``GET /api/v1/files/list?path=``.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import signal
import time
from collections.abc import AsyncIterator
from typing import Any

from pydantic import Field
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

from corral._version import __version__
from corral.api.models import safe_text
from corral.errors import CorralError, InvalidArgument, InvalidState
from corral.runtime.engine import Engine
from corral.runtime.pathutil import resolve_path
from corral.schema import MAX_TIMEOUT_S, FileInfo, validate_model
from corral.server import context as ctx
from corral.server.admission import LIVE_STATES
from corral.server.caller import caller_of
from corral.server.compat._wire import flat_errors, unsupported
from corral.server.compat.tensorlake_model import Body, Text, items, refuse
from corral.server.compat.tensorlake_process import (
    Process,
    ProcessTable,
    StreamLines,
    exit_json,
    sse,
)
from corral.server.compat.tensorlake_scope import NS_PREFIX, namespace, resolve
from corral.server.streaming import NDJSONResponse, start_events
from corral.server.wire import body_pieces, file_response, read_body, read_json

SERVICE = "Tensorlake"
# Output kept per stream of one command (the agent stops sending past it); background
# processes keep theirs in the daemon's memory until their sandbox is gone.
OUTPUT_CAP_BYTES = 64 << 20
EVENT_STREAM = "text/event-stream"
MAX_ARGS = 4096  # arguments of one command


def _engine(request: Request) -> Engine:
    return request.app.state.engine


def processes(request: Request) -> "ProcessTable":
    return request.app.state.tensorlake_processes


def _sandbox_id(request: Request) -> str:
    """The sandbox an in-sandbox call is for (by id or Tensorlake name), in the
    call's namespace (see :mod:`.tensorlake_scope`)."""
    ref = request.headers.get("x-tensorlake-sandbox-id", "").strip()
    if not ref:
        host = request.headers.get("host", "")
        host = host.rsplit(":", 1)[0] if host.count(":") == 1 else host
        if host.endswith(".local"):
            ref = host[: -len(".local")]
    if not ref:
        raise InvalidArgument(
            "an in-sandbox call must name its sandbox: send 'Host: <sandbox_id>.local' or "
            "'X-Tensorlake-Sandbox-Id: <sandbox_id>' (Tensorlake's client does this itself)"
        )
    return resolve(_engine(request), ref, namespace(request), caller_of(request)).id


# ---------------------------------------------------------------- the stream


def _as_event_stream(response: NDJSONResponse, body: AsyncIterator[bytes]) -> NDJSONResponse:
    """Serve ``body`` as server-sent events through ``response``, keeping what it adds
    to a plain stream: the producer stops (and a command is killed) when the client
    hangs up, and its cleanup runs even if the body never started."""
    response.body_iterator = body
    response.headers["content-type"] = EVENT_STREAM
    response.headers["cache-control"] = "no-cache"
    return response


# ------------------------------------------------------------------ commands


class _CommandRequest(Body):
    command: Text = Field(min_length=1)
    args: list[Text] = Field(default_factory=list, max_length=MAX_ARGS)
    env: dict[Text, Text] | None = items()
    working_dir: Text | None = None
    timeout: float | None = Field(None, gt=0, le=MAX_TIMEOUT_S)
    user: Any = None
    stdin_mode: Text | None = None
    stdout_mode: Text | None = None
    stderr_mode: Text | None = None
    name: Text | None = None
    restart: Any = None
    health_check: Any = None

    @property
    def argv(self) -> list[str]:
        return [self.command, *self.args]


def _check_command(req: _CommandRequest) -> None:
    if req.user is not None:
        raise refuse(
            "running as another user",
            "commands run as the sandbox's unprivileged user; leave out user",
        )
    if req.stdin_mode not in (None, "closed", "pipe"):
        raise InvalidArgument(
            f"stdin_mode must be 'closed' or 'pipe', got {req.stdin_mode!r}",
            details={"field": "stdin_mode"},
        )
    if req.name is not None or req.restart is not None or req.health_check is not None:
        raise refuse("managed processes (name, restart, health_check)", "start it unmanaged")


async def _command(request: Request) -> _CommandRequest:
    raw = await read_json(request, "process request")
    req = validate_model(_CommandRequest, raw, "process request")
    _check_command(req)
    return req


async def run_process(request: Request) -> Response:
    sid = _sandbox_id(request)
    req = await _command(request)
    pid = processes(request).next_pid(sid)
    begun = asyncio.Event()
    started = await start_events(ctx.sandboxes(request).exec_stream(  # a bad command raises now
        sid, req.argv, timeout=req.timeout, env=req.env, cwd=req.working_dir,
        max_output=OUTPUT_CAP_BYTES, output_tail=0,  # the head, as Tensorlake's
        on_start=begun.set,
    ), begun)

    async def events_of_run() -> AsyncIterator[bytes]:
        yield sse({"pid": pid, "started_at": time.time()})
        lines = {"stdout": StreamLines(), "stderr": StreamLines()}
        try:
            async for event in started:
                if event.kind in lines:
                    for line in lines[event.kind].feed(event.data):
                        yield sse({"line": line, "stream": event.kind, "timestamp": time.time()})
                elif event.kind == "exit" and event.result is not None:
                    for name, splitter in lines.items():
                        if (rest := splitter.flush()) is not None:
                            yield sse({"line": rest, "stream": name, "timestamp": time.time()})
                    yield sse(exit_json(dataclasses.asdict(event.result)))
                    return
        except CorralError as exc:  # no exit event follows: the client reports it broken
            yield sse({"error": exc.to_dict()})
        finally:
            await started.aclose()

    body = events_of_run()
    return _as_event_stream(NDJSONResponse(body, cleanup=started.aclose), body)


# ------------------------------------------------------- background processes


async def start_process(request: Request) -> Response:
    sid, table = _sandbox_id(request), processes(request)
    req = await _command(request)
    discard = frozenset(
        s for s, mode in (("stdout", req.stdout_mode), ("stderr", req.stderr_mode))
        if mode == "discard"
    )
    # the daemon's bookkeeping: every owner's live sandboxes keep their processes
    table.prune({i.id for i in _engine(request).list(state=LIVE_STATES, owner=None)})
    engine_proc = await ctx.sandboxes(request).spawn(  # FileError now for a command that cannot start
        sid, req.argv, env=req.env, cwd=req.working_dir, timeout=req.timeout,
    )
    if req.stdin_mode != "pipe":
        await engine_proc.close_stdin()
    proc = Process(
        table.next_pid(sid), req.argv, discard, engine_proc, stdin_open=req.stdin_mode == "pipe",
        budget=_engine(request).output_budget, tenant=ctx.owner(request),  # its kept lines
    )
    table.start(ctx.sandboxes(request), sid, proc)
    return JSONResponse(proc.info())


def _process(request: Request) -> Process:
    return processes(request).get(_sandbox_id(request), request.path_params["process"])


async def list_processes(request: Request) -> Response:
    procs = processes(request).list(_sandbox_id(request))
    return JSONResponse({"processes": [p.info() for p in procs]})


async def get_process(request: Request) -> Response:
    return JSONResponse(_process(request).info())


async def kill_process(request: Request) -> Response:
    await processes(request).kill(_process(request))
    return JSONResponse({})


class _SignalRequest(Body):
    signal: int


async def send_signal(request: Request) -> Response:
    proc = _process(request)
    raw = await read_json(request, "signal request")
    body = validate_model(_SignalRequest, raw, "signal request")
    if body.signal == signal.SIGKILL:
        return JSONResponse({"success": await processes(request).kill(proc)})
    try:
        sent = proc.engine_proc.signal(body.signal)  # to its process group
    except InvalidArgument:
        raise InvalidArgument(
            f"no signal {body.signal}: send a signal number, e.g. 15 (SIGTERM)",
            details={"field": "signal"},
        ) from None
    return JSONResponse({"success": sent})


async def write_stdin(request: Request) -> Response:
    proc = _process(request)
    data = await read_body(request, request.app.state.settings.max_upload_bytes, "stdin")
    if not proc.stdin_open or proc.done:
        raise InvalidState(
            f"process {proc.pid}'s stdin is closed: start it with stdin_mode='pipe' to "
            "write to it",
            details={"process": proc.pid},
        )
    await proc.engine_proc.write(data)
    return JSONResponse({})


async def close_stdin(request: Request) -> Response:
    proc = _process(request)
    if proc.stdin_open and not proc.done:
        proc.stdin_open = False
        with contextlib.suppress(CorralError):  # it exited meanwhile
            await proc.engine_proc.close_stdin()
    return JSONResponse({})


_STREAMS = {"stdout": ("stdout",), "stderr": ("stderr",), "output": ("stdout", "stderr")}


def _stream_of(request: Request) -> str:
    """Which output a route reads: the path segment after the process."""
    return request.url.path.rstrip("/").removesuffix("/follow").rsplit("/", 1)[1]


async def get_output(request: Request) -> Response:
    streams = _STREAMS[_stream_of(request)]
    return JSONResponse(_process(request).output(streams))


async def follow_output(request: Request) -> Response:
    stream = _process(request).follow(_STREAMS[_stream_of(request)])
    return _as_event_stream(NDJSONResponse(stream), stream)


# ---------------------------------------------------------------------- files


def _path(request: Request, sid: str) -> str:
    raw = request.query_params.get("path")
    if not raw:
        raise InvalidArgument("missing query parameter 'path', e.g. ?path=/workspace/x")
    return resolve_path(ctx.sandboxes(request).get(sid).spec.workdir, raw)


async def read_file(request: Request) -> Response:
    sid = _sandbox_id(request)
    limit = request.app.state.settings.max_upload_bytes
    return file_response(await ctx.sandboxes(request).open_read(
        sid, _path(request, sid), max_bytes=limit))


async def write_file(request: Request) -> Response:
    sid = _sandbox_id(request)
    pieces = body_pieces(request, request.app.state.settings.max_upload_bytes, "upload")
    await ctx.write_whole(request, sid, _path(request, sid), pieces)
    return JSONResponse({})


async def delete_file(request: Request) -> Response:
    sid = _sandbox_id(request)
    await ctx.sandboxes(request).remove(sid, _path(request, sid))
    return JSONResponse({})


def _entry_json(entry: FileInfo) -> dict[str, Any]:
    """An entry as Tensorlake's ``DirectoryEntry``. A name that is not UTF-8 (any bytes
    may name a file) is sent with U+FFFD for its bad bytes, plus ``name_b64`` with the
    exact bytes, as the native API does (the client ignores the extra field)."""
    name, exact = safe_text(entry.name)
    body: dict[str, Any] = {
        "name": name, "is_dir": entry.is_dir, "size": entry.size, "modified_at": entry.mtime,
    }
    if exact is not None:
        body["name_b64"] = exact
    return body


async def list_directory(request: Request) -> Response:
    sid = _sandbox_id(request)
    path = _path(request, sid)
    entries = await ctx.sandboxes(request).list_dir(sid, path)
    return JSONResponse({"path": path, "entries": [_entry_json(e) for e in entries]})


# --------------------------------------------------------------------- daemon


async def health(request: Request) -> Response:
    state = ctx.sandboxes(request).get(_sandbox_id(request)).state
    return JSONResponse({"healthy": state.value == "running"})


async def info(request: Request) -> Response:
    sandbox = ctx.sandboxes(request).get(_sandbox_id(request))
    procs = processes(request).list(sandbox.id)
    return JSONResponse(
        {
            "version": __version__,
            "uptime_secs": int(time.time() - (sandbox.started_at or sandbox.created_at)),
            "running_processes": sum(not p.done for p in procs),
            "total_processes": len(procs),
        }
    )


_P = "/api/v1/processes/{process}"
ENDPOINTS = (
    ("POST", "/api/v1/processes/run", run_process),
    ("POST", "/api/v1/processes", start_process),
    ("GET", "/api/v1/processes", list_processes),
    ("GET", _P, get_process),
    ("DELETE", _P, kill_process),
    ("POST", _P + "/signal", send_signal),
    ("POST", _P + "/stdin", write_stdin),
    ("POST", _P + "/stdin/close", close_stdin),
    *(("GET", f"{_P}/{stream}", get_output) for stream in _STREAMS),
    *(("GET", f"{_P}/{stream}/follow", follow_output) for stream in _STREAMS),
    ("GET", "/api/v1/files", read_file),
    ("PUT", "/api/v1/files", write_file),
    ("DELETE", "/api/v1/files", delete_file),
    ("GET", "/api/v1/files/list", list_directory),
    ("GET", "/api/v1/health", health),
    ("GET", "/api/v1/info", info),
)


def routes() -> list[Route]:
    """The in-sandbox routes, namespaced and flat, then 501 for the rest of ``/api/v1``
    (PTYs, tunnels, ...)."""
    out = [
        Route(prefix + path, flat_errors(handler), methods=[m])
        for prefix in (NS_PREFIX, "")
        for m, path, handler in ENDPOINTS
    ]
    out.append(
        Route(
            "/api/v1/{rest:path}", unsupported(SERVICE),
            methods=["GET", "POST", "PUT", "PATCH", "DELETE"],
        )
    )
    return out

