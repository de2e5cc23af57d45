"""envd's process service (``process.Process``) on corral's interactive processes.

What the ``e2b`` SDK's ``sandbox.commands`` (and ``sandbox.pty``) call, in Connect
(:mod:`.e2b_connect`):

- ``Start`` (server stream) spawns ``cmd args...`` (the SDK sends ``/bin/bash -l -c
  CMD``) with its ``envs`` and ``cwd`` through :meth:`Engine.spawn`; its stream is a
  ``start`` event with the pid, ``data`` events (stdout / stderr, or ``pty``), an
  ``end`` event with the exit code. The call's deadline (the SDK's command
  ``timeout``) is the process's timeout: past it the process is killed, so a timed
  out command leaves nothing running. ``stdin=False`` closes its stdin at once.
- ``Connect`` streams a running process's output again (it takes the output over).
- ``List``, ``SendInput``, ``CloseStdin``, ``SendSignal`` (SIGKILL / SIGTERM),
  ``Update`` (a terminal's size) act on a process by pid (the pid inside the
  sandbox) or by the tag given at start.
- ``StreamInput`` (client streaming) is ``unimplemented``.
"""

from __future__ import annotations

import base64
import binascii
from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import Any

from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

from corral.errors import CorralError
from corral.runtime.processes import Process, ProcessState
from corral.runtime.terminal import TerminalSize
from corral.schema import ExecResult
from corral.server import context as ctx
from corral.server.compat.e2b_connect import (
    ConnectError,
    caught,
    check_user,
    deadline,
    end_stream,
    envelope,
    sandbox_id,
    stream_message,
    stream_reply,
    unary_message,
)

SERVICE = "/process.Process/"
SIGNALS = {"SIGNAL_SIGKILL": 9, "SIGNAL_SIGTERM": 15, 9: 9, 15: 15}
MAX_TAG = 256


@dataclass(frozen=True)
class Started:
    """What a process was started with, for ``List``."""

    cmd: str
    args: list[str]
    envs: dict[str, str]
    cwd: str | None
    tag: str | None


class ProcessTable:
    """The E2B view of the processes the front-end started: their start config, by
    sandbox and corral process id (forgotten once the engine forgets the process, and
    with their sandbox: :meth:`forget` is subscribed to its end)."""

    def __init__(self) -> None:
        self.started: dict[str, dict[str, Started]] = {}

    def forget(self, sandbox_id: str) -> None:
        self.started.pop(sandbox_id, None)

    def prune(self, request: Request, sid: str) -> list[Process]:
        procs = ctx.sandboxes(request).list_processes(sid)
        mine = self.started.setdefault(sid, {})
        for gone in mine.keys() - {p.id for p in procs}:
            del mine[gone]
        return procs

    def config(self, sid: str, proc: Process) -> Started | None:
        return self.started.get(sid, {}).get(proc.id)


def _table(request: Request) -> ProcessTable:
    return request.app.state.e2b_processes


def _text(value: Any, what: str) -> str:
    if not isinstance(value, str):
        raise ConnectError("invalid_argument", f"{what} must be a string")
    return value


def _config(msg: dict[str, Any]) -> Started:
    proc = msg.get("process")
    if not isinstance(proc, dict):
        raise ConnectError("invalid_argument", "Start: process is required")
    args = proc.get("args") or []
    envs = proc.get("envs") or {}
    if not isinstance(args, list) or not isinstance(envs, dict):
        raise ConnectError("invalid_argument", "Start: args must be a list, envs a map")
    tag = msg.get("tag")
    if tag is not None and (not isinstance(tag, str) or len(tag) > MAX_TAG):
        raise ConnectError("invalid_argument", f"Start: tag must be a string of up to {MAX_TAG}")
    cwd = proc.get("cwd")
    return Started(
        cmd=_text(proc.get("cmd"), "process.cmd"),
        args=[_text(a, "process.args[]") for a in args],
        envs={_text(k, "envs key"): _text(v, "envs value") for k, v in envs.items()},
        cwd=None if cwd in (None, "") else _text(cwd, "process.cwd"),
        tag=tag,
    )


def _terminal(msg: dict[str, Any]) -> TerminalSize | None:
    pty = msg.get("pty")
    if pty is None:
        return None
    size = pty.get("size") if isinstance(pty, dict) else None
    if not isinstance(size, dict):
        raise ConnectError("invalid_argument", "Start: pty.size is required")
    return TerminalSize(size.get("rows", 24), size.get("cols", 80))


def _find(request: Request, sid: str, msg: dict[str, Any]) -> Process:
    """The running process a ``ProcessSelector`` (pid or tag) names."""
    selector = msg.get("process")
    if not isinstance(selector, dict) or not ({"pid", "tag"} & selector.keys()):
        raise ConnectError("invalid_argument", "process: give a pid or a tag")
    if not isinstance(selector.get("pid", 0), int) or not isinstance(selector.get("tag", ""), str):
        raise ConnectError("invalid_argument", "process: pid must be a number, tag a string")
    table = _table(request)
    for proc in table.prune(request, sid):
        if proc.state != ProcessState.RUNNING:
            continue
        started = table.config(sid, proc)
        if ("pid" in selector and selector["pid"] == proc.pid) or (
            "tag" in selector and started is not None and started.tag == selector["tag"]
        ):
            return proc
    what = f"pid {selector['pid']}" if "pid" in selector else f"tag {selector.get('tag')!r}"
    raise ConnectError("not_found", f"process with {what} not found in sandbox {sid}")


def _end(result: ExecResult) -> dict[str, Any]:
    code = result.returncode
    if result.timed_out:
        status = "signal: killed (timeout)"
    elif code < 0:
        status = f"signal: {-code}"
    else:
        status = f"exit status {code}"
    end: dict[str, Any] = {"exitCode": code if code >= 0 else -1, "exited": code >= 0,
                           "status": status}
    if result.oom_killed:
        end["error"] = "out of memory: the command was killed (raise the sandbox's memory)"
    return end


async def _events(proc: Process) -> AsyncIterator[bytes]:
    """A process's stream: start, its output as it comes, its end."""
    yield envelope({"event": {"start": {"pid": proc.pid}}})
    kind_of = ({"stdout": "pty", "stderr": "pty"} if proc.terminal is not None else
               {"stdout": "stdout", "stderr": "stderr"})
    try:
        async for ev in proc.output():
            if ev.kind in kind_of:
                data = base64.b64encode(ev.data).decode()
                yield envelope({"event": {"data": {kind_of[ev.kind]: data}}})
            elif ev.result is not None:
                yield envelope({"event": {"end": _end(ev.result)}})
    except CorralError as exc:  # its sandbox ended, or another reader took over
        yield end_stream(exc)
        return
    yield end_stream()


async def _only(chunk: bytes) -> AsyncIterator[bytes]:
    yield chunk


async def start(request: Request) -> Response:
    try:
        sid = sandbox_id(request)
        user = check_user(request)
        msg = await stream_message(request, "Start")
        cfg = _config(msg)
        terminal = _terminal(msg)
        proc = await ctx.sandboxes(request).spawn(
            sid, [cfg.cmd, *cfg.args], env=cfg.envs, cwd=cfg.cwd, timeout=deadline(request),
            terminal=terminal, user=user,
        )
    except (CorralError, ConnectError) as exc:
        return stream_reply(_only(end_stream(exc)))
    table = _table(request)
    table.prune(request, sid)
    table.started.setdefault(sid, {})[proc.id] = cfg
    if not msg.get("stdin", True) and terminal is None:
        try:
            await proc.close_stdin()
        except CorralError:
            pass  # it has ended already
    return stream_reply(_events(proc))


async def connect(request: Request) -> Response:
    try:
        sid = sandbox_id(request)
        proc = _find(request, sid, await stream_message(request, "Connect"))
    except (CorralError, ConnectError) as exc:
        return stream_reply(_only(end_stream(exc)))
    return stream_reply(_events(proc))


async def list_processes(request: Request) -> Response:
    sid = sandbox_id(request)
    await unary_message(request, "List")
    table = _table(request)
    out = []
    for proc in table.prune(request, sid):
        if proc.state != ProcessState.RUNNING:
            continue
        cfg = table.config(sid, proc)
        config: dict[str, Any] = {"cmd": proc.argv[0], "args": proc.argv[1:], "envs": {}}
        item: dict[str, Any] = {"pid": proc.pid}
        if cfg is not None:
            config = {"cmd": cfg.cmd, "args": cfg.args, "envs": cfg.envs}
            if cfg.cwd:
                config["cwd"] = cfg.cwd
            if cfg.tag is not None:
                item["tag"] = cfg.tag
        out.append({"config": config, **item})
    return JSONResponse({"processes": out})


async def send_input(request: Request) -> Response:
    sid = sandbox_id(request)
    msg = await unary_message(request, "SendInput")
    proc = _find(request, sid, msg)
    given = msg.get("input")
    if not isinstance(given, dict) or not ({"stdin", "pty"} & given.keys()):
        raise ConnectError("invalid_argument", "SendInput: input.stdin or input.pty is required")
    try:
        data = base64.b64decode(given.get("stdin", given.get("pty")) or "", validate=True)
    except (binascii.Error, TypeError, ValueError):
        raise ConnectError("invalid_argument", "SendInput: input is not base64") from None
    await proc.write(data)
    return JSONResponse({})


async def close_stdin(request: Request) -> Response:
    sid = sandbox_id(request)
    proc = _find(request, sid, await unary_message(request, "CloseStdin"))
    await proc.close_stdin()
    return JSONResponse({})


async def send_signal(request: Request) -> Response:
    sid = sandbox_id(request)
    msg = await unary_message(request, "SendSignal")
    proc = _find(request, sid, msg)
    given = msg.get("signal")
    signum = SIGNALS.get(given) if isinstance(given, (str, int)) else None
    if signum is None:
        raise ConnectError("invalid_argument", "SendSignal: signal must be SIGKILL or SIGTERM")
    proc.signal(signum)
    return JSONResponse({})


async def update(request: Request) -> Response:
    sid = sandbox_id(request)
    msg = await unary_message(request, "Update")
    proc = _find(request, sid, msg)
    size = _terminal(msg)
    if size is None:
        raise ConnectError("invalid_argument", "Update: pty.size is required")
    proc.resize(size.rows, size.cols)
    return JSONResponse({})


async def stream_input(request: Request) -> Response:
    raise ConnectError("unimplemented", "StreamInput is not served by corral's E2B "
                       "front-end: send input with commands.send_stdin()")


def routes() -> list[Route]:
    unary = {"List": list_processes, "SendInput": send_input, "CloseStdin": close_stdin,
             "SendSignal": send_signal, "Update": update, "StreamInput": stream_input}
    out = [Route(SERVICE + "Start", start, methods=["POST"]),
           Route(SERVICE + "Connect", connect, methods=["POST"])]
    out += [Route(SERVICE + name, caught(h), methods=["POST"]) for name, h in unary.items()]
    return out
