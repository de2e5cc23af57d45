"""What the engine makes of its agent's replies: command results and their timeouts.

The agent inside a sandbox enforces a command's timeout and output cap, but it runs
among the code it supervises, so the engine does not depend on it (docs/api.md,
"Sandbox faults"):

- Output caps: each stream keeps at most ``max_output`` bytes: all of it, or its head
  and its last ``output_tail`` bytes (default: half of ``max_output``, at most 8 MiB:
  :func:`~corral.schema.default_output_tail`), with the bytes dropped in between
  counted (``stdout_dropped``). The engine checks what arrives itself
  (:mod:`corral.runtime.outputcap`); the agent's own truncated flags are not read.
- Timeouts: a command with a timeout has an engine deadline of ``timeout`` +
  :data:`EXEC_GRACE_S`. If the agent has not reported the exit by then, the engine
  kills every process of the sandbox through its cgroup and returns ``timed_out=True``;
  the sandbox ends as ``failed`` with a ``"sandbox fault: ..."`` reason: an agent that
  does not report a kill it was due to make is stuck or hijacked, and nothing it says
  afterwards could be believed.
  The deadline is a timer: it holds whether or not anyone reads the command's events.
  A sandbox the engine froze (paused, or being snapshotted) is not blamed: while it is
  frozen, and for one grace after the thaw, the deadline moves on.
- Pause: a timeout keeps running while its sandbox is paused. At the deadline of a
  command in a *paused* sandbox the caller gets ``timed_out=True`` (returncode -9) at
  once, and the command is killed when the sandbox resumes (a frozen process cannot
  die before): the agent's own clock ran out too, and a SIGKILL for it is queued. The
  sandbox stays paused and is not blamed. A snapshot's short freeze only moves the
  deadline on, as above.
- The result's ``duration`` is the agent's, but never more than the engine saw pass.
"""

from __future__ import annotations

import asyncio
import errno
import signal
from typing import Any, AsyncGenerator, Callable, Protocol, Sequence

from corral.errors import (
    CorralError,
    FileError,
    FileNotFound,
    InvalidArgument,
    InvalidState,
    SandboxProtocolError,
    is_sandbox_fault,
)
from corral.runtime.cgroups import Cgroup
from corral.runtime.channel import ExecStream
from corral.runtime.protocol import Field, Fields, Msg, Tag
from corral.schema import (
    ExecEvent,
    ExecResult,
    OutputStream,
    SandboxInfo,
    SandboxState,
    default_output_tail,
)


class _Live(Protocol):
    """What this module reads of a sandbox's record (:class:`corral.runtime.live.Live`,
    which it does not import: ``live`` → ``processes`` → this module)."""

    @property
    def id(self) -> str: ...
    @property
    def state(self) -> SandboxState: ...
    @property
    def cgroup(self) -> Cgroup: ...

EXEC_GRACE_S = 2.0
"""How long past a command's timeout the engine waits for the agent to report its end."""
LOOK_AGAIN_S = 0.05
"""At the deadline, with bytes from the agent not yet parsed: how soon to look again
(the read loop's turn comes first), up to one more :data:`EXEC_GRACE_S` in all."""
UNLIMITED_OUTPUT = (1 << 63) - 1


def command_argv(cmd: str | Sequence[str]) -> list[str]:
    """A command's argv: a shell string runs under ``/bin/sh -c``; checked."""
    if isinstance(cmd, str):
        if not cmd.strip():
            raise InvalidArgument("empty command: pass a shell string or an argv list")
        return ["/bin/sh", "-c", cmd]
    argv = list(cmd)
    if not argv or not all(isinstance(a, str) for a in argv):
        raise InvalidArgument("cmd must be a non-empty list of strings or a shell string")
    if any("\0" in a for a in argv):
        raise InvalidArgument("command arguments may not contain NUL bytes")
    return argv


def output_tail_for(max_output: int, output_tail: int | None) -> int:
    """The checked tail of a command's streams (``None``: :func:`default_output_tail`)."""
    if max_output < 0:
        raise InvalidArgument("max_output must be >= 0 bytes")
    if output_tail is None:
        return default_output_tail(max_output)
    if not 0 <= output_tail <= max_output:
        raise InvalidArgument(
            f"output_tail must be between 0 and max_output ({max_output}) bytes, got {output_tail}"
        )
    return output_tail


def limit_fields(timeout: float | None, max_output: int, output_tail: int) -> list[Field]:
    """A command's timeout and output cap, checked, as the agent's fields."""
    if timeout is not None and not (0 < timeout <= 86400 * 30):
        raise InvalidArgument(f"timeout must be > 0 seconds (or None), got {timeout}")
    fields: list[Field] = []
    if timeout is not None:
        fields.append((Tag.TIMEOUT_MS, max(1, int(timeout * 1000))))
    fields.append((Tag.MAX_OUTPUT, min(max_output, UNLIMITED_OUTPUT)))
    if output_tail:
        fields.append((Tag.OUTPUT_TAIL, output_tail))
    return fields


def exit_result(
    cgroup: Cgroup, f: Fields, stream: ExecStream, oom_before: int, started: float
) -> ExecResult:
    """The result of a command from its (validated) EXIT frame and the engine's counts."""
    code = f.i64(Tag.CODE)
    timed_out = bool(f.u64(Tag.TIMED_OUT))
    oom = False
    # Killed by SIGKILL, or a shell reporting a child killed so (128 + 9): the verdict
    # must not depend on how the command was written (`sh -c "...; python3 big.py"`).
    if code in (-signal.SIGKILL, 128 + signal.SIGKILL) and not timed_out:
        try:
            oom = cgroup.oom_kills() > oom_before
        except (OSError, CorralError):
            pass
    elapsed = asyncio.get_running_loop().time() - started
    return ExecResult(
        returncode=code,
        timed_out=timed_out,
        oom_killed=oom,
        **_output_counts(stream),
        duration=min(f.u64(Tag.DURATION_US) / 1e6, max(elapsed, 0.0)),
    )


def _output_counts(stream: ExecStream) -> dict[str, Any]:
    out, err = stream.stdout, stream.stderr
    return {
        "stdout_truncated": out.truncated, "stderr_truncated": err.truncated,
        "stdout_dropped": out.dropped, "stderr_dropped": err.dropped, "output_tail": out.tail,
    }


def frozen(live: _Live) -> bool:
    """Whether the engine has the sandbox frozen (paused, or a snapshot being taken):
    then its agent cannot answer, and that is not its fault."""
    if live.state == SandboxState.PAUSED:
        return True
    try:
        return bool(live.cgroup.frozen())
    except (OSError, CorralError):
        return False


class Deadline:
    """Enforces a command's timeout from the host, whether or not anyone reads its
    events: at ``timeout`` + :data:`EXEC_GRACE_S` after now, if the agent has not
    reported the command's end, :func:`enforce_timeout` ends the sandbox and the
    processes are killed (``enforced``: the task that does it, its result ``timed_out``).

    While the engine has the sandbox frozen, and for one more grace after it sees the
    thaw (the agent catches up), the deadline moves on instead.
    """

    def __init__(self, live: _Live, stream: ExecStream, timeout: float | None) -> None:
        self.live, self.stream, self.timeout = live, stream, timeout
        loop = asyncio.get_running_loop()
        self.started = loop.time()
        self.enforced: asyncio.Task[ExecResult] | None = None
        self._was_frozen = False
        self._look_end: float | None = None  # the last look at unread bytes (set on the first)
        self._timer = None if timeout is None else loop.call_at(
            self.started + timeout + EXEC_GRACE_S, self._fire
        )

    def cancel(self) -> None:
        if self._timer is not None:
            self._timer.cancel()

    def _fire(self) -> None:
        channel, loop = self.stream.channel, asyncio.get_running_loop()
        if channel.error is not None or channel.streams.get(self.stream.request_id) is not self.stream:
            return  # its end came (and is queued), or the sandbox's did
        if channel.unread():
            # The agent said something not parsed yet (perhaps this command's end, sent
            # in time while the engine's loop stalled): the read loop goes first. Bounded,
            # so an agent that keeps talking cannot stretch the timeout.
            if self._look_end is None:
                self._look_end = loop.time() + EXEC_GRACE_S
            if loop.time() < self._look_end:
                self._timer = loop.call_at(loop.time() + LOOK_AGAIN_S, self._fire)
                return
        if self.live.state == SandboxState.PAUSED:  # paused by its user: time is up
            self.enforced = loop.create_task(_paused_out(self.stream, self.started))
            # Ends this stream only, never surfaces: its reader returns ``enforced``.
            self.stream._put(SandboxProtocolError("paused past a command's timeout"))
            return
        now_frozen = frozen(self.live)
        if now_frozen or self._was_frozen:
            self._was_frozen = now_frozen
            self._timer = loop.call_at(loop.time() + EXEC_GRACE_S, self._fire)
            return
        assert self.timeout is not None
        # Both in this callback: no exit frame can be read in between.
        enforce_timeout(self.stream, self.timeout)
        self.enforced = loop.create_task(_kill(self.live, self.stream, self.started))


def _killed(stream: ExecStream, started: float) -> ExecResult:
    """The result of a command the engine ended at its deadline."""
    return ExecResult(
        returncode=-signal.SIGKILL,
        timed_out=True,
        **_output_counts(stream),
        duration=asyncio.get_running_loop().time() - started,
    )


async def _paused_out(stream: ExecStream, started: float) -> ExecResult:
    """A command whose sandbox is paused past its timeout: ``timed_out`` now; the agent
    kills it once the sandbox resumes (its group's SIGKILL waits in the socket)."""
    try:
        stream.signal(signal.SIGKILL)
    except CorralError:
        pass  # the sandbox is ending: that kills it
    return _killed(stream, started)


def enforce_timeout(stream: ExecStream, timeout: float) -> None:
    """The agent did not report a command's end by its deadline: end the sandbox as
    its own fault now; :func:`_kill` then kills every process in it from the host."""
    # The fault first: the kill ends the agent too, and its hang-up must not read as
    # a kill from outside (infrastructure).
    stream.channel.fault(
        "agent_unresponsive",
        f"its agent did not report the end of a command within the command's "
        f"{timeout:g} s timeout (+{EXEC_GRACE_S:g} s): the engine killed every process "
        "of the sandbox",
    )


async def _kill(live: _Live, stream: ExecStream, started: float) -> ExecResult:
    """Kill every process of a sandbox whose agent missed a deadline: ``timed_out``."""
    try:
        await asyncio.to_thread(live.cgroup.kill_all)
    except (OSError, CorralError):
        pass  # the end of the sandbox removes the cgroup, killing what is left
    return _killed(stream, started)


async def command_events(
    live: _Live, stream: ExecStream, timeout: float | None, cwd: str | None, oom_before: int,
    on_start: Callable[[], None] | None = None, *, limit: Deadline | None = None,
) -> AsyncGenerator[ExecEvent, None]:
    """A command's output events, then its exit; closing early kills its group.
    ``on_start`` is called when the agent says the command started (after which it
    can no longer fail to start). ``limit``: its deadline, armed when the command was
    sent (by default, armed now for ``timeout``)."""
    if limit is None:
        limit = Deadline(live, stream, timeout)
    done = False
    try:
        while True:
            try:
                reply = await stream.next()
            except SandboxProtocolError:
                if limit.enforced is None:
                    raise
                done = True  # the engine enforced the timeout: a result, not an error
                yield ExecEvent("exit", result=await limit.enforced)
                return
            if reply.msg == Msg.STARTED:
                if on_start is not None:
                    on_start()
            elif reply.msg == Msg.STDOUT:
                yield ExecEvent("stdout", reply.data)
            elif reply.msg == Msg.STDERR:
                yield ExecEvent("stderr", reply.data)
            elif reply.msg == Msg.TAIL:  # the gap between a stream's head and its tail
                kind: OutputStream = "stdout" if reply.fields.u64(Tag.STREAM) == 1 else "stderr"
                yield ExecEvent(kind, dropped=reply.fields.u64(Tag.DROPPED))
            elif reply.msg == Msg.EXIT:
                done = True
                yield ExecEvent(
                    "exit",
                    result=exit_result(live.cgroup, reply.fields, stream, oom_before, limit.started),
                )
                return
            elif reply.msg == Msg.ERR:
                done = True
                raise exec_error(live.id, reply.fields, cwd)
    finally:
        if done:
            limit.cancel()  # (left armed, it still ends a sandbox whose agent never says)
        else:
            try:
                stream.signal(signal.SIGKILL)
            except CorralError:
                pass
        stream.close()


def exec_error(sandbox_id: str, f: Fields, cwd: str | None) -> CorralError:
    """The error of a command the agent could not start."""
    err = f.u64(Tag.ERRNO)
    msg = f.text(Tag.MESSAGE)
    details = {"sandbox_id": sandbox_id, "errno": err}
    if msg.startswith("working directory") and err == errno.ENOENT:
        return FileNotFound(
            f"the working directory {cwd} does not exist in sandbox {sandbox_id}", details=details
        )
    if err == errno.EAGAIN:
        return InvalidState(f"sandbox {sandbox_id}: {msg}", details=details)
    return FileError(f"sandbox {sandbox_id}: cannot run the command: {msg}", details=details)


def ended_error(info: SandboxInfo) -> CorralError:
    """The error for a call on a sandbox that has ended: its own fault, or a state."""
    what = f"sandbox {info.id} is {info.state.value}" + (f" ({info.reason})" if info.reason else "")
    details = {"sandbox_id": info.id, "state": info.state.value}
    if is_sandbox_fault(info.reason):
        return SandboxProtocolError(what, details={**details, "violation": "ended"})
    return InvalidState(what + ": create a new one", details=details)
