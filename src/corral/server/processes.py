"""Interactive processes over HTTP: start one, feed its stdin, stream its output.

The endpoints (declared in :mod:`corral.api.operations`, described in
``docs/api.md``) map onto :mod:`corral.runtime.processes`. Two ways to talk to a
long-lived process, both one small request per exchange:

- push: keep one ``GET .../output`` stream open for the process's whole life and send
  each input with ``POST .../stdin`` (a raw body, no JSON or base64 around it). Closing
  the stream only detaches the reader: unlike ``exec/stream``, the process keeps
  running.
- request/reply, for servers that answer each input line with one output line (an RL
  environment): ``POST .../exchange`` writes the body and replies with the next line of
  stdout; ``POST /v1/processes/exchange`` does that for many processes, in many
  sandboxes, in one request: writes first, then every line awaited at once, so a
  vector of environments steps concurrently for the price of one round trip.
- once, for a process that answers one request and exits (a pre-started judge):
  ``POST .../consume`` writes the body, reads the line, waits for the exit and deletes
  the sandbox, all in one request: the reply holds the line and the exit, and the
  sandbox is gone whatever happened (a client that hangs up ends the waits for the line
  and for the exit, whatever their timeouts: the process is killed, nothing is left).

A process spawned with ``"pty": true`` runs on a pseudo-terminal (an interactive
shell: ``corral shell``). It is driven the push way: its output (one stream, stdout)
on ``GET .../output``, keystrokes on ``POST .../stdin`` (Ctrl-C is byte 0x03; closing
stdin types Ctrl-D), and ``POST .../resize`` when the user's window changes.
"""

from __future__ import annotations

import asyncio
from typing import Any

from starlette.requests import ClientDisconnect, Request
from starlette.responses import JSONResponse, Response

from corral.api.models import exec_response, text_and_b64
from corral.api.operation import RAW
from corral.api.process_models import (  # the wire models, shared with the SDK
    ExchangeRequest,
    ResizeRequest,
    SignalRequest,
    SpawnRequest,
)
from corral.errors import CorralError, ExecTimeout, InvalidArgument
from corral.runtime.processes import Process, ProcessState, parse_signal
from corral.runtime.terminal import DEFAULT_COLS, DEFAULT_ROWS, TerminalSize
from corral.schema import ExecResult
from corral.server import context as ctx
from corral.server.caller import caller_of
from corral.server.context import unless_disconnected
from corral.server.streaming import start_stream
from corral.server.wire import HeldJSONResponse, HeldResponse, read_body

KILL_WAIT_S = 5.0  # how long DELETE waits for a killed process to be reaped
CONSUME_EXIT_WAIT_S = 5.0
"""How long ``consume`` waits, by default, for a process to exit after its line."""


def _terminal(body: SpawnRequest) -> TerminalSize | None:
    """The terminal a spawn asks for (``pty``), at its size or the default one."""
    if not body.pty:
        return None
    return TerminalSize(body.rows or DEFAULT_ROWS, body.cols or DEFAULT_COLS)


def process_json(proc: Process) -> dict[str, Any]:
    info = proc.info()
    if info["result"] is not None:
        info["result"] = exec_response(info["result"])
    if info["error"] is not None:
        info["error"] = info["error"].to_dict()
    return info


def _process(request: Request) -> Process:
    params = request.path_params
    return ctx.sandboxes(request).get_process(params["sandbox_id"], params["process_id"])


async def spawn_process(request: Request, body: SpawnRequest) -> Response:
    proc = await ctx.sandboxes(request).spawn(
        request.path_params["sandbox_id"], body.cmd, env=body.env, cwd=body.cwd,
        timeout=body.timeout, max_buffer=body.max_buffer, terminal=_terminal(body),
        user=body.user,
    )
    return JSONResponse(process_json(proc), status_code=201)


async def list_processes(request: Request) -> Response:
    found = ctx.sandboxes(request).list_processes(request.path_params["sandbox_id"])
    return JSONResponse({"processes": [process_json(p) for p in found]})


async def get_process(request: Request) -> Response:
    return JSONResponse(process_json(_process(request)))


async def write_stdin(request: Request) -> Response:
    proc = _process(request)
    close = request.query_params.get("close", "false").lower() in ("1", "true", "yes")
    data = await read_body(request, request.app.state.settings.max_upload_bytes, "stdin")
    if data:
        await proc.write(bytes(data))
    if close:
        await proc.close_stdin()
    return Response(status_code=204)


async def read_output(request: Request) -> Response:
    return await start_stream(_process(request).output())


def _timeout(request: Request, name: str = "timeout") -> float | None:
    value = request.query_params.get(name)
    if value is None:
        return None
    try:
        seconds = float(value)
    except ValueError:
        seconds = -1.0
    if not 0 < seconds <= 30 * 86400:
        raise InvalidArgument(f"{name} must be a number of seconds > 0, got {value!r}")
    return seconds


async def _reply_line(proc: Process, timeout: float | None) -> bytes:
    try:
        return await asyncio.wait_for(proc.readline(), timeout)
    except asyncio.TimeoutError:
        raise ExecTimeout(
            f"process {proc.id} in sandbox {proc.sandbox_id} wrote no line within "
            f"{timeout:g} s (what was sent stays sent: its line, when it comes, is the "
            "next one read)",
            details={"sandbox_id": proc.sandbox_id, "process_id": proc.id, "timeout": timeout},
        ) from None


async def exchange(request: Request) -> Response:
    """Write the body to the process's stdin, reply with its next line of stdout."""
    proc, timeout = _process(request), _timeout(request)
    data = await read_body(request, request.app.state.settings.max_upload_bytes, "stdin")
    if data:
        await proc.write(bytes(data))
    line = await unless_disconnected(request, _reply_line(proc, timeout))
    return HeldResponse(line, proc.reply_hold(), media_type=RAW)  # held until written


async def consume(request: Request) -> Response:
    """Write the body, read the next line, wait for the exit, delete the sandbox; reply
    with the line and the exit. Shielded: a client that hangs up still gets its sandbox
    deleted (the work goes on without it). ``?delete=after``: the reply goes as soon as
    the line and the exit are known, and the deletion, already under way, goes on after
    it (the reply's ``deleted`` is then false; the sandbox is gone moments later)."""
    proc, timeout = _process(request), _timeout(request)
    exit_wait = _timeout(request, "exit_timeout") or CONSUME_EXIT_WAIT_S
    reply_first = _delete_order(request) == "after"
    data = await read_body(request, request.app.state.settings.max_upload_bytes, "stdin")
    service, caller = ctx.service(request), caller_of(request)

    async def talk() -> tuple[bytes | None, dict[str, Any]]:
        if data:
            await proc.write(bytes(data))
        try:  # a client that hangs up ends the wait (no ``timeout``: it could be forever)
            line: bytes | None = await unless_disconnected(
                request, asyncio.wait_for(proc.readline(), timeout))
        except (asyncio.TimeoutError, ClientDisconnect):
            line = None
        try:  # nor does it wait for the exit (``exit_timeout`` may be 30 days)
            ended = await unless_disconnected(request, _ended(proc, exit_wait if line else None))
        except ClientDisconnect:
            ended = await _ended(proc, None)
        return line, exec_response(ended)

    talked = asyncio.ensure_future(talk())

    async def work() -> tuple[bytes | None, dict[str, Any]]:
        try:
            return await talked
        finally:  # whatever happened, and whether or not the reply waits for it
            await service.delete(proc.sandbox_id, caller)

    task = asyncio.ensure_future(work())
    task.add_done_callback(_retrieved)  # a hung-up client's: its error is not lost noise
    line, result = await asyncio.shield(talked if reply_first else task)
    reply: dict[str, Any] = {"result": result, "deleted": not reply_first}  # a ConsumeResponse
    if line is not None:
        text, b64 = text_and_b64(line)
        reply.update({"data": text} if b64 is None else {"data_b64": b64})
    return HeldJSONResponse(reply, proc.reply_hold())


def _delete_order(request: Request) -> str:
    value = request.query_params.get("delete", "before")
    if value not in ("before", "after"):
        raise InvalidArgument(
            f"delete must be 'before' (the sandbox is gone when the reply comes) or 'after' "
            f"(the reply comes first, the deletion goes on), got {value!r}")
    return value


def _retrieved(task: asyncio.Future[Any]) -> None:
    if not task.cancelled():
        task.exception()


async def _ended(proc: Process, wait: float | None) -> ExecResult:
    """How ``proc`` ended: waited for ``wait`` seconds (``None``: not at all), then
    killed."""
    if wait is not None:
        try:
            return await proc.wait(wait)
        except ExecTimeout:
            pass
    proc.signal("SIGKILL")
    return await proc.wait(KILL_WAIT_S)


async def exchange_many(request: Request, body: ExchangeRequest) -> Response:
    """Write to every process (in order), then await all their lines at once."""
    engine = ctx.sandboxes(request)
    keys = [(item.sandbox_id, item.process_id) for item in body.items]
    if len(set(keys)) != len(keys):
        raise InvalidArgument(
            "a process appears twice in one exchange: its two lines could not be told "
            "apart; send one item per process"
        )
    started: list[Process | CorralError] = []
    for item in body.items:
        try:
            proc = engine.get_process(item.sandbox_id, item.process_id)
            data = item.payload()
            if data:
                await proc.write(data)
            started.append(proc)
        except CorralError as exc:
            started.append(exc)

    async def line(entry: Process | CorralError) -> dict[str, Any]:
        try:
            if isinstance(entry, CorralError):
                raise entry
            text, b64 = text_and_b64(await _reply_line(entry, body.timeout))
        except CorralError as exc:
            return {"error": exc.to_dict()}
        return {"data": text} if b64 is None else {"data_b64": b64}

    work = asyncio.gather(*(line(entry) for entry in started))
    results = await unless_disconnected(request, work)
    procs = [entry for entry in started if isinstance(entry, Process)]
    if not procs:
        return JSONResponse({"results": results})
    return HeldJSONResponse({"results": results}, procs[0].reply_hold())  # the caller's


async def signal_process(request: Request, body: SignalRequest) -> Response:
    signum = parse_signal(body.signal)
    _process(request).signal(signum)  # one that has ended: nothing to do
    return Response(status_code=204)


async def resize_process(request: Request, body: ResizeRequest) -> Response:
    _process(request).resize(body.rows, body.cols)
    return Response(status_code=204)


async def kill_process(request: Request) -> Response:
    """SIGKILL a running process, wait for it briefly, forget its record. Idempotent."""
    engine, params = ctx.sandboxes(request), request.path_params
    sid, pid = params["sandbox_id"], params["process_id"]
    try:
        proc = engine.get_process(sid, pid)
    except CorralError as exc:
        if exc.code in ("not_found", "invalid_state"):  # no such process, or its sandbox ended
            return Response(status_code=204)
        raise
    if proc.state == ProcessState.RUNNING:
        proc.signal("SIGKILL")
        try:
            await proc.wait(KILL_WAIT_S)
        except CorralError:
            pass  # lost with its sandbox, or not reaped yet: it is dying either way
    engine.forget_process(sid, pid)
    return Response(status_code=204)
