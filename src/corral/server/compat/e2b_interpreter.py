"""E2B's Code Interpreter (``e2b-code-interpreter``'s ``run_code``) on a kernel
process inside the sandbox.

The SDK sends these to ``E2B_SANDBOX_URL`` with ``E2b-Sandbox-Port: 49999``:

- ``POST /execute`` ``{"code", "context_id", "language", "env_vars"}``: the reply
  streams one JSON object a line (``stdout`` / ``stderr`` with a ``timestamp``,
  ``result`` with the last expression's ``text``, ``error`` with ``name``, ``value``,
  ``traceback``, ``number_of_executions``); state is kept between calls of a context;
- ``POST /contexts`` (``cwd``, ``language``), ``GET /contexts``, ``DELETE
  /contexts/{id}``, ``POST /contexts/{id}/restart``.

A context is one Python process (:mod:`corral.guest.e2b_kernel`, standard library only, so any
image with ``python3`` serves) started through :meth:`Engine.spawn` as the sandbox's
user; the default context is made on the first ``/execute`` that names none. One
execution runs at a time per context. If the client leaves mid-execution (its
``timeout``), the kernel is killed and its context forgotten: nothing keeps running.
Every line the kernel writes is validated and bounded here (it runs the code being
judged): a result carries only checked formats (:mod:`.e2b_results`), one execution's
results are bounded (:class:`~.e2b_results.Budget`); the execution count and the end
are the daemon's. Only Python is served (no R, JavaScript, Java or Bash contexts).
Rich display: matplotlib figures come back as results with ``png`` and e2b's ``chart``,
other values with every format their ``_repr_*_`` methods give (``html``, ``markdown``,
``svg``, ``png``, ``jpeg``, ``pdf``, ``latex``, ``json``, ``javascript``; other MIME
types of ``_repr_mimebundle_`` in ``extra``); ``display(obj)`` adds a result.
"""

from __future__ import annotations

import asyncio
import json
import secrets
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Any

from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse
from starlette.routing import Route

from corral.errors import CorralError, InvalidArgument, NotFound
from corral.guest import program
from corral.runtime.processes import Process, ProcessState
from corral.server import context as ctx
from corral.server.compat import e2b_results
from corral.server.compat.e2b_connect import ConnectError, caught, sandbox_id
from corral.server.limits import parse_json
from corral.server.wire import read_json

PORT = "49999"
LANGUAGES = (None, "python", "python3")
MAX_LINE = 4 << 20  # a line the kernel writes, at most
MAX_TEXT = 1 << 20  # characters of one message's text passed on
MAX_CONTEXTS = 16  # per sandbox
KINDS = ("stdout", "stderr", "result", "error", "end")


@dataclass
class Kernel:
    id: str
    proc: Process
    cwd: str
    count: int = 0
    lock: asyncio.Lock = field(default_factory=asyncio.Lock)
    dropped: bool = False  # killed and forgotten (a run waiting for it needs another)

    def json(self) -> dict[str, Any]:
        return {"id": self.id, "language": "python", "cwd": self.cwd}


class Contexts:
    """The code contexts of every sandbox, by sandbox id, then context id."""

    def __init__(self) -> None:
        self.by_sandbox: dict[str, dict[str, Kernel]] = {}
        self.source = program("e2b_kernel")

    def forget(self, sandbox_id: str) -> None:
        """Its sandbox ended (and its kernels with it)."""
        self.by_sandbox.pop(sandbox_id, None)

    def of(self, sid: str) -> dict[str, Kernel]:
        """Sandbox ``sid``'s contexts (the same dict every time), the ended ones
        forgotten first."""
        kernels = self.by_sandbox.setdefault(sid, {})
        for ident in [k for k, v in kernels.items() if v.proc.state != ProcessState.RUNNING]:
            del kernels[ident]
        return kernels

    async def start(self, request: Request, sid: str, cwd: str | None) -> Kernel:
        mine = self.of(sid)
        if len(mine) >= MAX_CONTEXTS:
            raise InvalidArgument(f"sandbox {sid} has {MAX_CONTEXTS} code contexts already: "
                                  "remove one first")
        engine = ctx.sandboxes(request)
        proc = await engine.spawn(sid, ["python3", "-u", "-c", self.source], cwd=cwd,
                                  env={"PYTHONUNBUFFERED": "1"})
        where = cwd or engine.get(sid).spec.workdir
        kernel = Kernel(id=secrets.token_hex(8), proc=proc, cwd=where)
        mine[kernel.id] = kernel
        return kernel

    async def drop(self, sid: str, kernel: Kernel) -> None:
        kernel.dropped = True
        self.by_sandbox.get(sid, {}).pop(kernel.id, None)
        if kernel.proc.state == ProcessState.RUNNING:
            await kernel.proc.kill()


def _contexts(request: Request) -> Contexts:
    return request.app.state.e2b_contexts


def _error(status: int, message: str) -> Response:
    return JSONResponse({"code": status, "message": message}, status_code=status)


def _language(value: Any) -> None:
    if value not in LANGUAGES:
        raise InvalidArgument(f"language {value!r}: corral's Code Interpreter runs Python "
                              "only; run other languages with sandbox.commands.run()")


def _line(raw: bytes) -> dict[str, Any] | None:
    """A validated message of the kernel, or None for anything else."""
    try:  # written by code in the sandbox: bounded like a request body
        msg = parse_json(raw, "kernel message")
    except CorralError:
        return None
    if not isinstance(msg, dict) or msg.get("type") not in KINDS:
        return None
    clean: dict[str, Any] = {"type": msg["type"]}
    if msg["type"] == "result":
        return e2b_results.result(msg)
    for key in ("text", "name", "value", "traceback", "id"):
        if isinstance(msg.get(key), str):
            clean[key] = msg[key][:MAX_TEXT]
    return clean


def _ndjson(msg: dict[str, Any]) -> bytes:
    return json.dumps(msg).encode() + b"\n"


async def _default(request: Request, sid: str) -> Kernel:
    """Sandbox ``sid``'s default context, started if it has none (or it was dropped)."""
    contexts = _contexts(request)
    mine = contexts.of(sid)
    kernel = mine.get("default") or await contexts.start(request, sid, None)
    if kernel.id != "default":
        mine.pop(kernel.id, None)
        kernel.id = "default"
        mine["default"] = kernel
    return kernel


async def _locked(request: Request, sid: str, kernel: Kernel, default: bool) -> Kernel:
    """``kernel``, locked for one run; for the default context, a new one if it was
    dropped while this run waited (the last run's client left: its kernel is killed)."""
    await kernel.lock.acquire()
    while kernel.dropped and default:
        kernel.lock.release()
        kernel = await _default(request, sid)
        await kernel.lock.acquire()
    return kernel


async def _run(request: Request, sid: str, kernel: Kernel, code: str,
               env: dict[str, str], *, default: bool) -> AsyncIterator[bytes]:
    """One execution's reply lines; the kernel is killed if the client leaves first."""
    ident = secrets.token_hex(8)
    done = False
    budget = e2b_results.Budget()
    kernel = await _locked(request, sid, kernel, default)
    try:
        try:
            await kernel.proc.write(_ndjson({"code": code, "env": env, "id": ident}))
            kernel.count += 1
            yield _ndjson({"type": "number_of_executions", "execution_count": kernel.count})
            while True:
                raw = await kernel.proc.readline(MAX_LINE)
                if not raw:  # the kernel exited (the code ended it, or its sandbox)
                    await _contexts(request).drop(sid, kernel)
                    yield _ndjson({"type": "error", "name": "KernelDied",
                                   "value": "the code context's process exited; its state "
                                   "is lost (the next run_code starts a new one)",
                                   "traceback": ""})
                    done = True
                    return
                msg = _line(raw)
                if msg is None:
                    continue
                if msg["type"] == "end":
                    if msg.get("id") == ident:
                        done = True
                        return
                    continue
                if msg["type"] in ("stdout", "stderr"):
                    msg["timestamp"] = time.time_ns() // 1000
                    msg.setdefault("text", "")
                if msg["type"] == "error":
                    for key in ("name", "value", "traceback"):
                        msg.setdefault(key, "")
                if msg["type"] == "result":
                    kept = budget.admit(msg, len(raw))
                    note = budget.note()
                    if note is not None:
                        yield _ndjson({"type": "stderr", "text": note,
                                       "timestamp": time.time_ns() // 1000})
                    if kept is None:
                        continue
                    msg = kept
                yield _ndjson(msg)
        except CorralError as exc:
            yield _ndjson({"type": "error", "name": type(exc).__name__, "value": exc.message,
                           "traceback": ""})
            done = True
        finally:
            if not done:  # the client left (its timeout): stop the code, lose the context
                await asyncio.shield(_contexts(request).drop(sid, kernel))
    finally:
        kernel.lock.release()


class _ExecuteBody:
    def __init__(self, data: dict[str, Any]) -> None:
        code, env = data.get("code"), data.get("env_vars") or {}
        if not isinstance(code, str):
            raise InvalidArgument("code must be a string")
        if not isinstance(env, dict) or not all(
            isinstance(k, str) and isinstance(v, str) for k, v in env.items()
        ):
            raise InvalidArgument("env_vars must map names to strings")
        context_id = data.get("context_id")
        if context_id is not None and not isinstance(context_id, str):
            raise InvalidArgument("context_id must be a string")
        _language(data.get("language"))
        self.code, self.env, self.context_id = code, env, context_id


async def execute(request: Request) -> Response:
    sid = sandbox_id(request)
    body = _ExecuteBody(await read_json(request, "execute request"))
    contexts = _contexts(request)
    mine = contexts.of(sid)
    if body.context_id is not None:
        kernel = mine.get(body.context_id)
        if kernel is None:
            raise NotFound(f"no code context {body.context_id!r} in sandbox {sid}")
    else:
        kernel = await _default(request, sid)
    return StreamingResponse(_run(request, sid, kernel, body.code, body.env,
                                  default=body.context_id is None),
                             media_type="application/x-ndjson")


async def create_context(request: Request) -> Response:
    sid = sandbox_id(request)
    data = await read_json(request, "context request", required=False)
    _language(data.get("language"))
    cwd = data.get("cwd")
    if cwd is not None and not isinstance(cwd, str):
        raise InvalidArgument("cwd must be a string")
    kernel = await _contexts(request).start(request, sid, cwd)
    return JSONResponse(kernel.json())


async def list_contexts(request: Request) -> Response:
    sid = sandbox_id(request)
    return JSONResponse([k.json() for k in _contexts(request).of(sid).values()])


def _context(request: Request, sid: str) -> Kernel:
    ident = request.path_params["context_id"]
    kernel = _contexts(request).of(sid).get(ident)
    if kernel is None:
        raise NotFound(f"no code context {ident!r} in sandbox {sid}")
    return kernel


async def remove_context(request: Request) -> Response:
    sid = sandbox_id(request)
    await _contexts(request).drop(sid, _context(request, sid))
    return Response(status_code=204)


async def restart_context(request: Request) -> Response:
    sid = sandbox_id(request)
    old = _context(request, sid)
    contexts = _contexts(request)
    await contexts.drop(sid, old)
    new = await contexts.start(request, sid, old.cwd)
    contexts.of(sid).pop(new.id, None)
    new.id = old.id
    contexts.of(sid)[old.id] = new
    return Response(status_code=204)


async def health(request: Request) -> Response:
    sandbox_id(request)
    return Response(status_code=204)


def _http_error(exc: CorralError | ConnectError) -> Response:
    if isinstance(exc, ConnectError):  # its sandbox is gone (502: the SDK's timeout error)
        return _error(502 if exc.code == "unavailable" else 400, exc.message)
    return _error(exc.status, exc.message)


async def no_route(scope: Any, receive: Any, send: Any) -> None:
    await _error(404, f"{scope.get('path', '')} is not a Code Interpreter call corral "
                 "serves")(scope, receive, send)


def routes() -> list[Route]:
    table = [
        ("POST", "/execute", execute),
        ("POST", "/contexts", create_context),
        ("GET", "/contexts", list_contexts),
        ("DELETE", "/contexts/{context_id}", remove_context),
        ("POST", "/contexts/{context_id}/restart", restart_context),
        ("GET", "/health", health),
    ]
    return [Route(path, caught(h, _http_error), methods=[m]) for m, path, h in table]
