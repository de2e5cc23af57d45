"""Commands for the cwsandbox front-end: ``StreamExec`` (what the client uses) and ``Exec``.

The client opens a bidirectional stream: ``init`` (sandbox, argv, env), then, if it
wants to feed stdin, waits for ``ready`` before sending ``stdin`` chunks and a
``close``; without stdin it half-closes right after ``init``. The server answers
``ready``, then ``output`` chunks (stdout / stderr), then one ``exit`` (or a terminal
``error``). The client's exec timeout is only the call's deadline: when it passes, or
the client cancels, the call is cancelled here and the command's process group killed.

The command is one of the engine's interactive processes (:meth:`Engine.spawn`), so
stdin is streamed as it arrives and a command can answer before its input ends.

A command that cannot start (no such program, not executable) is answered like a
shell would: a message on stderr and exit status 127 (126 if not executable).
"""

from __future__ import annotations

import asyncio
import contextlib
import errno
import signal
import time
from typing import Any

import grpc
import grpc.aio
from cwsandbox._proto import sandbox_pb2

from corral.errors import CorralError, FileError, InvalidArgument
from corral.schema import ExecResult, SandboxState
from corral.server.compat import cwsandbox_wire as wire
from corral.server.sandbox_verbs import SandboxVerbs
from corral.server.settings import ServerSettings

ENGINE_TIMEOUT_SLACK_S = 1.0  # the engine's timer only backs up the client's deadline
DEFAULT_EXEC_OUTPUT = 1 << 20  # unary Exec without max_output_bytes
MAX_EXEC_OUTPUT = 25 << 20  # unary Exec: both streams must fit one reply
_OUT = sandbox_pb2.ExecStreamOutput
Context = grpc.aio.ServicerContext


async def stream_exec(engine: SandboxVerbs, settings: ServerSettings, context: Context) -> None:
    """Serve one ``StreamExec`` call from its first message to the command's exit."""
    first = await context.read()
    if first is grpc.aio.EOF or first.WhichOneof("message") != "init":
        raise wire.invalid("the first message of StreamExec must be init", "init")
    init = first.init
    if init.tty:
        raise wire.unsupported("TTY sessions (Sandbox.shell)")
    wire.check_command(init.command, init.env)
    argv, sid, env = command_argv(init.command), init.sandbox_id, dict(init.env)
    check_container(init.container)
    info = wire.reachable(engine.get(sid))
    if info.state != SandboxState.RUNNING:
        raise wire.RpcFailure(
            grpc.StatusCode.FAILED_PRECONDITION,
            f"sandbox {sid} is {info.state.value}, not running",
        )
    await _interactive(engine, settings, context, sid, argv, env)


def _engine_timeout(context: Context) -> float | None:
    remaining = context.time_remaining()
    return None if remaining is None else remaining + ENGINE_TIMEOUT_SLACK_S


async def _interactive(
    engine: SandboxVerbs, settings: ServerSettings, context: Context, sid: str, argv: list[str],
    env: dict[str, str],
) -> None:
    spawning = asyncio.ensure_future(engine.spawn(
        sid, argv, env=env, timeout=_engine_timeout(context), max_buffer=settings.max_upload_bytes,
    ))
    try:
        proc = await asyncio.shield(spawning)
    except asyncio.CancelledError:  # the client left while it started: it must not live on
        while not spawning.done():  # however often the call is cancelled meanwhile (a
            with contextlib.suppress(asyncio.CancelledError):  # revoke, then the client)
                await asyncio.wait({spawning})
        if not spawning.cancelled() and spawning.exception() is None:
            spawning.result().signal(signal.SIGKILL)
            engine.forget_process(sid, spawning.result().id)
        raise
    except FileError as exc:
        await context.write(_ready())
        await _cannot_run(context, exc)
        return
    feeder = asyncio.ensure_future(_feed(context, proc))
    try:
        await context.write(_ready())
        async for event in proc.output():
            if event.kind != "exit":
                await context.write(_output(event.kind, event.data))
                continue
            assert event.result is not None
            if event.result.truncated:  # the client read slower than the command wrote
                await context.write(_error(
                    "STREAM_BACKPRESSURE",
                    f"over {settings.max_upload_bytes} bytes of output were waiting to be "
                    "read, so some was dropped",
                ))
            else:
                await context.write(_exit(event.result))
            return
    finally:
        feeder.cancel()
        await asyncio.wait({feeder})
        proc.signal(signal.SIGKILL)  # no-op once it exited; kills it if the call was cancelled
        engine.forget_process(sid, proc.id)


async def _feed(context: Context, proc: Any) -> None:
    """Pass the client's stdin to the process as it comes; close it at ``close`` or EOF."""
    try:
        while True:
            request = await context.read()
            kind = None if request is grpc.aio.EOF else request.WhichOneof("message")
            if kind in (None, "close"):
                await proc.close_stdin()
                return
            if kind == "stdin":
                await proc.write(request.stdin)
    except CorralError:
        return  # the process ended: its exit is on the way to the client


async def unary_exec(engine: SandboxVerbs, request: Any, context: Context) -> Any:
    """``Exec``: run to completion, reply with the output (capped) and exit code."""
    wire.check_command(request.command, request.env)
    argv = command_argv(request.command)
    check_container(request.container)
    max_output = min(request.max_output_bytes or DEFAULT_EXEC_OUTPUT, MAX_EXEC_OUTPUT)
    wire.reachable(engine.get(request.sandbox_id))
    # The output's room in the budget is held until the call has ended, not only while
    # the command runs: the reply waits in gRPC for a client that may not read it.
    hold = engine.reserve_output(request.sandbox_id, max_output)
    context.add_done_callback(lambda _: hold.release())
    try:
        result = await engine.exec(
            request.sandbox_id, argv, env=dict(request.env), max_output=max_output,
            output_tail=0, timeout=_engine_timeout(context),  # the head, as CoreWeave's
            output_hold=hold,
        )
    except FileError as exc:
        message = _cannot_run_message(exc)
        return sandbox_pb2.ExecResponse(
            stderr=message, exit_code=cannot_run_status(exc), stderr_bytes_produced=len(message)
        )
    return sandbox_pb2.ExecResponse(
        stdout=result.stdout, stderr=result.stderr, exit_code=wire.exit_status(result.returncode),
        stdout_truncated=result.stdout_truncated, stderr_truncated=result.stderr_truncated,
        stdout_bytes_produced=len(result.stdout), stderr_bytes_produced=len(result.stderr),
    )


# ------------------------------------------------------------------ helpers


def command_argv(command: Any) -> list[str]:
    argv = list(command)
    if not argv or not argv[0]:
        raise wire.invalid("the command is empty: send the program and its arguments", "command")
    return argv


def check_container(name: str) -> None:
    if name and name != wire.MAIN_CONTAINER:
        raise InvalidArgument(
            f"no container {name!r}: corral sandboxes have one container, "
            f"{wire.MAIN_CONTAINER!r} (leave container unset)"
        )


def cannot_run_status(exc: FileError) -> int:
    return 126 if exc.details.get("errno") in (errno.EACCES, errno.ENOEXEC) else 127


def _cannot_run_message(exc: FileError) -> bytes:
    return f"corral: {exc.message}\n".encode()


async def _cannot_run(context: Context, exc: FileError) -> None:
    await context.write(_output("stderr", _cannot_run_message(exc)))
    await context.write(_exit_status(cannot_run_status(exc)))


def _ready() -> Any:
    now = wire.timestamp(time.time())
    return sandbox_pb2.ExecStreamResponse(ready=sandbox_pb2.ExecStreamReady(ready_time=now))


def _output(kind: str, data: bytes) -> Any:
    stream = _OUT.STREAM_STDOUT if kind == "stdout" else _OUT.STREAM_STDERR
    return sandbox_pb2.ExecStreamResponse(output=_OUT(stream=stream, data=data))


def _exit(result: ExecResult) -> Any:
    return _exit_status(wire.exit_status(result.returncode))


def _exit_status(code: int) -> Any:
    now = wire.timestamp(time.time())
    return sandbox_pb2.ExecStreamResponse(
        exit=sandbox_pb2.ExecStreamExit(exit_code=code, completed_time=now)
    )


def _error(code: str, message: str) -> Any:
    return sandbox_pb2.ExecStreamResponse(
        error=sandbox_pb2.ExecStreamError(message=message, code=code)
    )
