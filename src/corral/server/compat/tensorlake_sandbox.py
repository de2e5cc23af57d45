"""Tensorlake's in-sandbox API (``/api/v1/...``): commands, background processes, files.

Tensorlake's client sends these to the sandbox's ``sandbox_url``: this daemon, under
``/v1/namespaces/{ns}`` when the sandbox was reached through a namespaced path (a call
sees that namespace's sandboxes only; the flat ``/api/v1/...`` sees ``default``'s).
It says which sandbox with ``Host: <sandbox_id>.local`` (when that URL is
``localhost`` / ``127.0.0.1``) or ``X-Tensorlake-Sandbox-Id`` (elsewhere); both are
honoured.

- ``POST /api/v1/processes/run`` runs a command to completion and streams it as
  server-sent events: ``{pid, started_at}``, then ``{line, stream, timestamp}`` per
  output line, then ``{exit_code, signal, oom_killed, reason}``. It rides on the native
  streamed exec (:func:`corral.server.streaming.start_stream`): errors that happen at
  once get their own status, and a client that hangs up kills the command.
- ``POST /api/v1/processes`` starts a background process on the same stream, kept
  in a per-daemon :class:`ProcessTable`: list it, read or follow its output, kill it.
  Its ``pid`` is a handle the front-end numbers, not the process id inside the sandbox.
  Any of SIGHUP, SIGINT, SIGQUIT, SIGKILL, SIGTERM kills the process group (as SIGKILL);
  other signals, stdin pipes (write_stdin), managed processes (name, restart,
  health_check) and ``user`` are refused with 501 until the engine gains interactive
  processes.
- ``GET/PUT/DELETE /api/v1/files?path=`` and ``GET /api/v1/files/list?path=``.
"""

from __future__ import annotations

import asyncio
import base64
import itertools
import json
import signal
import time
from collections.abc import AsyncIterator, Collection
from dataclasses import dataclass, field
from typing import Any

from pydantic import Field
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

from corral._version import __version__
from corral.errors import CorralError, InvalidArgument, NotFound
from corral.runtime.engine import Engine
from corral.runtime.pathutil import resolve_path
from corral.schema import MAX_TIMEOUT_S, FileInfo, validate_model
from corral.server.admission import LIVE_STATES
from corral.server.compat._wire import flat_errors, unsupported
from corral.server.compat.tensorlake_model import Body, Text, items, refuse
from corral.server.compat.tensorlake_scope import NS_PREFIX, namespace, resolve
from corral.server.context import remove_partial
from corral.server.models import safe_text
from corral.server.streaming import NDJSONResponse, start_stream
from corral.server.wire import read_body, read_json

SERVICE = "Tensorlake"
# Output kept per stream of one command (the agent stops sending past it); background
# processes keep theirs in the daemon's memory until their sandbox is gone.
OUTPUT_CAP_BYTES = 64 << 20
PROCESS_OUTPUT_CAP_BYTES = 16 << 20
FIRST_PID = 100
KILLING_SIGNALS = {signal.SIGHUP, signal.SIGINT, signal.SIGQUIT, signal.SIGKILL, signal.SIGTERM}
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
    return resolve(_engine(request), ref, namespace(request)).id


# ---------------------------------------------------------------- the stream


class LineSplitter:
    """Text arriving in chunks, handed on as whole lines (without their newline)."""

    def __init__(self) -> None:
        self._rest = ""

    def feed(self, text: str) -> list[str]:
        *lines, self._rest = (self._rest + text).split("\n")
        return lines

    def flush(self) -> str | None:
        """The last line if it had no newline, else None."""
        rest, self._rest = self._rest, ""
        return rest or None


def exit_json(result: dict[str, Any]) -> dict[str, Any]:
    """A native exec result as Tensorlake's exit event (``exit_code`` null when a signal
    ended the command; a timeout is reported as ``timed_out``, killed by SIGKILL)."""
    code, oom = result["returncode"], bool(result.get("oom_killed"))
    if result.get("timed_out"):
        reason = "timed_out"
    elif oom:
        reason = "oom_killed"
    else:
        reason = "signaled" if code < 0 else "exited"
    return {
        "exit_code": code if code >= 0 else None,
        "signal": -code if code < 0 else None,
        "oom_killed": oom,
        "reason": reason,
    }


KILLED = {"exit_code": None, "signal": 9, "oom_killed": False, "reason": "signaled"}


async def _events(body: AsyncIterator[bytes]) -> AsyncIterator[tuple[str, Any, Any]]:
    """The native NDJSON stream as ``("line", stream, text)``, ``("exit", json, None)``
    and ``("error", error_dict, None)``; closing this closes (and kills) the command."""
    splitters = {"stdout": LineSplitter(), "stderr": LineSplitter()}
    try:
        async for raw in body:
            event = json.loads(raw)
            kind = event["type"]
            if kind in splitters:
                if "data" in event:
                    text = event["data"]
                else:
                    text = base64.b64decode(event["data_b64"]).decode("utf-8", "replace")
                for line in splitters[kind].feed(text):
                    yield "line", kind, line
            elif kind == "exit":
                for name, splitter in splitters.items():
                    if (rest := splitter.flush()) is not None:
                        yield "line", name, rest
                yield "exit", exit_json(event["result"]), None
            else:
                yield "error", event["error"], None
    finally:
        aclose = getattr(body, "aclose", None)
        if aclose is not None:
            await aclose()


def _sse(data: dict[str, Any]) -> bytes:
    return b"data: " + json.dumps(data, separators=(",", ":")).encode() + b"\n\n"


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
    if req.stdin_mode not in (None, "closed"):
        raise refuse("stdin pipes (stdin_mode='pipe')", "pass input in a file or as arguments")
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
    events = _engine(request).exec_stream(
        sid, req.argv, timeout=req.timeout, env=req.env, cwd=req.working_dir,
        max_output=OUTPUT_CAP_BYTES, output_tail=0,  # the head, as Tensorlake's
    )
    response = await start_stream(events)  # raises at once for a bad command
    native = response.body_iterator

    async def sse() -> AsyncIterator[bytes]:
        yield _sse({"pid": pid, "started_at": time.time()})
        async for kind, a, b in _events(native):
            if kind == "line":
                yield _sse({"line": b, "stream": a, "timestamp": time.time()})
            elif kind == "exit":
                yield _sse(a)
            else:  # no exit event follows: the client reports the stream as broken
                yield _sse({"error": a})

    return _as_event_stream(response, sse())


# ------------------------------------------------------- background processes


@dataclass
class _Line:
    stream: str
    text: str
    at: float


@dataclass
class Process:
    """One background process: its output so far and how it ended."""

    pid: int
    argv: list[str]
    discard: frozenset[str]
    started_at: float = field(default_factory=time.time)
    lines: list[_Line] = field(default_factory=list)
    exit: dict[str, Any] | None = None
    ended_at: float | None = None
    task: asyncio.Task[None] | None = None
    changed: asyncio.Event = field(default_factory=asyncio.Event)

    @property
    def done(self) -> bool:
        return self.ended_at is not None

    def notify(self) -> None:
        """Wake followers; they wait on the event they saw, so none misses a line."""
        event, self.changed = self.changed, asyncio.Event()
        event.set()

    def info(self) -> dict[str, Any]:
        body: dict[str, Any] = {
            "pid": self.pid, "status": "running", "stdin_writable": False,
            "command": self.argv[0], "args": self.argv[1:], "started_at": self.started_at,
        }
        if self.exit is not None:
            reason = self.exit["reason"]
            body["status"] = reason if reason in ("exited", "oom_killed") else "signaled"
            body.update(exit_code=self.exit["exit_code"], signal=self.exit["signal"])
            body["ended_at"] = self.ended_at
        return body

    def output(self, streams: tuple[str, ...]) -> dict[str, Any]:
        lines = [line.text for line in self.lines if line.stream in streams]
        return {"pid": self.pid, "lines": lines, "line_count": len(lines)}

    async def follow(self, streams: tuple[str, ...]) -> AsyncIterator[bytes]:
        """Every line so far, then new ones as they come, until the process ends."""
        seen = 0
        while True:
            changed = self.changed
            for line in self.lines[seen:]:
                if line.stream in streams:
                    yield _sse({"line": line.text, "stream": line.stream, "timestamp": line.at})
            seen = len(self.lines)
            if self.done:
                return
            await changed.wait()


class ProcessTable:
    """The background processes of every sandbox, in the daemon's memory."""

    def __init__(self) -> None:
        self._by_sandbox: dict[str, dict[int, Process]] = {}
        self._pids: dict[str, itertools.count[int]] = {}

    def next_pid(self, sandbox_id: str) -> int:
        return next(self._pids.setdefault(sandbox_id, itertools.count(FIRST_PID)))

    def list(self, sandbox_id: str) -> list[Process]:
        return list(self._by_sandbox.get(sandbox_id, {}).values())

    def get(self, sandbox_id: str, ref: str) -> Process:
        found = self._by_sandbox.get(sandbox_id, {}).get(int(ref)) if ref.isdigit() else None
        if found is None:
            raise NotFound(
                f"no process {ref!r} in sandbox {sandbox_id}: list them with list_processes()",
                details={"sandbox_id": sandbox_id, "process": ref},
            )
        return found

    async def start(self, sandbox_id: str, body: AsyncIterator[bytes], proc: Process) -> None:
        self._by_sandbox.setdefault(sandbox_id, {})[proc.pid] = proc
        proc.task = asyncio.create_task(self._pump(proc, body), name=f"tensorlake-{proc.pid}")
        await asyncio.sleep(0)  # the pump is now inside the stream: a kill always ends it

    async def _pump(self, proc: Process, body: AsyncIterator[bytes]) -> None:
        try:
            async for kind, a, b in _events(body):
                if kind == "line":
                    if a not in proc.discard:
                        proc.lines.append(_Line(a, b, time.time()))
                        proc.notify()
                elif kind == "exit":
                    proc.exit = a
        except asyncio.CancelledError:
            pass  # killed: the stream's cleanup has killed the process group
        except CorralError:
            pass  # the sandbox went away: reported as killed below
        finally:
            proc.exit = proc.exit or KILLED
            proc.ended_at = time.time()
            proc.notify()

    async def kill(self, proc: Process) -> bool:
        """Kill a running process (its whole process group); False if it had ended."""
        if proc.task is None or proc.task.done():
            return False
        proc.task.cancel()
        await asyncio.wait({proc.task})
        return True

    def prune(self, live_ids: Collection[str]) -> None:
        """Forget the processes of sandboxes that are no longer alive."""
        for sid in [s for s in self._by_sandbox if s not in live_ids]:
            self.drop(sid)

    def drop(self, sandbox_id: str) -> None:
        """Forget a deleted sandbox's processes (and kill any still running)."""
        self._pids.pop(sandbox_id, None)
        for proc in self._by_sandbox.pop(sandbox_id, {}).values():
            if proc.task is not None:
                proc.task.cancel()


async def start_process(request: Request) -> Response:
    sid, table = _sandbox_id(request), processes(request)
    req = await _command(request)
    discard = frozenset(
        s for s, mode in (("stdout", req.stdout_mode), ("stderr", req.stderr_mode))
        if mode == "discard"
    )
    engine = _engine(request)
    table.prune({i.id for i in engine.list(state=LIVE_STATES)})
    events = engine.exec_stream(
        sid, req.argv, timeout=req.timeout, env=req.env, cwd=req.working_dir,
        max_output=PROCESS_OUTPUT_CAP_BYTES, output_tail=0,
    )
    response = await start_stream(events)  # raises at once for a bad command
    proc = Process(table.next_pid(sid), req.argv, discard)
    await table.start(sid, response.body_iterator, proc)
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
    if body.signal not in KILLING_SIGNALS:
        raise refuse(
            f"signal {body.signal}",
            "only SIGHUP, SIGINT, SIGQUIT, SIGKILL and SIGTERM, which kill the process group",
        )
    return JSONResponse({"success": await processes(request).kill(proc)})


async def write_stdin(request: Request) -> Response:
    _process(request)
    raise refuse("writing to a process's stdin", "pass input in a file or as arguments")


async def close_stdin(request: Request) -> Response:
    _process(request)  # stdin is always closed: nothing to do
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
    return resolve_path(_engine(request).get(sid).spec.workdir, raw)


async def read_file(request: Request) -> Response:
    sid = _sandbox_id(request)
    limit = request.app.state.settings.max_upload_bytes
    data = await _engine(request).read_file(sid, _path(request, sid), max_bytes=limit)
    return Response(data, media_type="application/octet-stream")


async def write_file(request: Request) -> Response:
    sid = _sandbox_id(request)
    engine, path = _engine(request), _path(request, sid)
    data = await read_body(request, request.app.state.settings.max_upload_bytes, "upload")
    try:
        await engine.write_file(sid, path, data, mode=0o644)
    except CorralError:
        await remove_partial(engine, sid, path)
        raise
    return JSONResponse({})


async def delete_file(request: Request) -> Response:
    sid = _sandbox_id(request)
    await _engine(request).remove(sid, _path(request, sid))
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
    entries = await _engine(request).list_dir(sid, path)
    return JSONResponse({"path": path, "entries": [_entry_json(e) for e in entries]})


# --------------------------------------------------------------------- daemon


async def health(request: Request) -> Response:
    state = _engine(request).get(_sandbox_id(request)).state
    return JSONResponse({"healthy": state.value == "running"})


async def info(request: Request) -> Response:
    sandbox = _engine(request).get(_sandbox_id(request))
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

