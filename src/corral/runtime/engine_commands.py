"""The engine's commands: run to completion, streamed, or interactive processes.

Mixed into :class:`~corral.runtime.engine.Engine`. A command is one EXEC request to
the sandbox's agent (fields built by :meth:`CommandOps.command_fields`); its events are
checked and its timeout and output cap enforced from outside by
:mod:`corral.runtime.agentconn`; interactive processes are in
:mod:`corral.runtime.processes`.
"""

from __future__ import annotations

import asyncio
import signal
from collections.abc import AsyncGenerator, Callable, Coroutine, Generator, Sequence
from contextlib import aclosing
from typing import TYPE_CHECKING, Any

from corral.api.process_models import DEFAULT_MAX_BUFFER
from corral.errors import CorralError, InvalidArgument, SandboxLost
from corral.runtime import process_start, processes, sweep, users
from corral.runtime.agentconn import (
    Deadline,
    command_argv,
    command_events,
    limit_fields,
    output_tail_for,
)
from corral.runtime.channel import ExecStream
from corral.runtime.cmdtap import CommandTap
from corral.runtime.cpus import CpuPicker, thread_env
from corral.runtime.events import Events
from corral.runtime.output_budget import OutputBudget, OutputHold
from corral.runtime.output_room import OutputRoom
from corral.runtime.ownership import UNSET, OwnerArg, Owners
from corral.runtime.pathutil import resolve_path
from corral.runtime.protocol import Field, Tag
from corral.runtime.terminal import TerminalSize
from corral.runtime.uids import SANDBOX_HOME
from corral.schema import (
    DEFAULT_EXEC_TIMEOUT_S,
    DEFAULT_MAX_OUTPUT,
    ExecEvent,
    ExecResult,
)

if TYPE_CHECKING:
    from corral.runtime.events import Events
    from corral.runtime.live import Live

BASE_PATH = (
    f"{SANDBOX_HOME}/.local/bin:/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin"
)


class CommandOps:
    """``exec``, ``exec_stream``, ``spawn`` and its process table, ``kill_processes``."""

    if TYPE_CHECKING:
        _live: dict[str, Live]
        events: Events
        _tasks: set[asyncio.Task[Any]]
        cpu_picker: CpuPicker
        owners: Owners
        output_budget: OutputBudget

        def _owned(self, sandbox_id: str, owner: OwnerArg) -> None: ...
        def _running(self, sandbox_id: str) -> Live: ...
        def _get_live(self, sandbox_id: str) -> Live: ...

    async def exec(
        self,
        sandbox_id: str,
        cmd: str | Sequence[str],
        *,
        timeout: float | None = DEFAULT_EXEC_TIMEOUT_S,
        env: dict[str, str] | None = None,
        cwd: str | None = None,
        stdin: bytes | str | None = None,
        max_output: int = DEFAULT_MAX_OUTPUT,
        output_tail: int | None = None,
        user: str | int | None = None,
        owner: OwnerArg = UNSET,
        output_hold: OutputHold | None = None,
    ) -> ExecResult:
        """Run a command to completion; a timeout or OOM kill is a result, not an error.
        Each stream keeps ``max_output`` bytes at most: past that, its head and its last
        ``output_tail`` bytes (``None``: half, at most 8 MiB; :mod:`corral.runtime.outputcap`).
        The output counts against the output budget (:mod:`corral.runtime.output_budget`)
        by the bytes held, until the result is returned, or, with ``output_hold`` (the
        caller's :meth:`reserve_output`), until the caller releases it; when the budget
        is spent the streams' cap is lowered there (``output_limited_to``: their head
        and their last bytes, :mod:`corral.runtime.output_room`)."""
        return await self.start_exec(
            sandbox_id, cmd, timeout=timeout, env=env, cwd=cwd, stdin=stdin,
            max_output=max_output, output_tail=output_tail, user=user, owner=owner,
            output_hold=output_hold)

    def start_exec(
        self,
        sandbox_id: str,
        cmd: str | Sequence[str],
        *,
        timeout: float | None = DEFAULT_EXEC_TIMEOUT_S,
        env: dict[str, str] | None = None,
        cwd: str | None = None,
        stdin: bytes | str | None = None,
        max_output: int = DEFAULT_MAX_OUTPUT,
        output_tail: int | None = None,
        user: str | int | None = None,
        owner: OwnerArg = UNSET,
        output_hold: OutputHold | None = None,
    ) -> StartedExec:
        """:meth:`exec`, its command started before this returns: the EXEC frame is on
        its way and the command's deadline armed (a loop timer, which holds whatever
        task awaits the result, or none). Await the returned object for the result; or
        ``close()`` it unawaited, which kills the command. A handler that starts the
        command itself and awaits its end in a task of its own gets it to the agent a
        turn of the loop sooner; nothing here awaits, so no deadline of the caller's
        task is entered."""
        return StartedExec(self._open_command(
            sandbox_id, cmd, timeout=timeout, env=env, cwd=cwd, stdin=stdin,
            max_output=max_output, output_tail=output_tail, user=user, owner=owner,
            output_hold=output_hold, on_start=None, keep_output=True))

    def reserve_output(self, sandbox_id: str, max_output: int, *,
                       owner: OwnerArg = UNSET) -> OutputHold:
        """Take a command's floor in its caller's output budget (it grows by the bytes
        the command's output holds); :class:`~corral.errors.OutputBudgetExceeded` if not
        even the floor is left. The caller releases it."""
        return self.output_budget.reserve(self.owners.of(owner), max_output, sandbox_id)

    async def exec_stream(
        self,
        sandbox_id: str,
        cmd: str | Sequence[str],
        *,
        timeout: float | None = DEFAULT_EXEC_TIMEOUT_S,
        env: dict[str, str] | None = None,
        cwd: str | None = None,
        stdin: bytes | str | None = None,
        max_output: int = DEFAULT_MAX_OUTPUT,
        output_tail: int | None = None,
        user: str | int | None = None,
        owner: OwnerArg = UNSET,
        output_hold: OutputHold | None = None,
        on_start: Callable[[], None] | None = None,
        keep_output: bool = False,
    ) -> AsyncGenerator[ExecEvent, None]:
        """Run a command and yield its output as it happens, then its exit.

        Closing the iterator early (or cancelling the task) kills the command's
        process group. The engine caps the output and enforces the timeout itself,
        whatever the agent says (:mod:`corral.runtime.agentconn`). A stream that went
        over its cap shows its gap as an event with ``dropped`` set, then its tail.
        Events not yet read count against the output budget (their bytes, given back as
        they are read; ``keep_output``: the caller keeps them all, as :meth:`exec`):
        when it has no room for more, what comes is dropped and shown as a gap, and the
        result's ``output_limited_to`` says so (:mod:`corral.runtime.output_room`).
        ``on_start`` is called once the command has started: before that, it may still
        fail to (a bad ``cwd``).
        """
        run = self._open_command(
            sandbox_id, cmd, timeout=timeout, env=env, cwd=cwd, stdin=stdin,
            max_output=max_output, output_tail=output_tail, user=user, owner=owner,
            output_hold=output_hold, on_start=on_start, keep_output=keep_output)
        async with aclosing(run.events()) as events:
            async for ev in events:
                yield ev

    def _open_command(
        self, sandbox_id: str, cmd: str | Sequence[str], *, timeout: float | None,
        env: dict[str, str] | None, cwd: str | None, stdin: bytes | str | None,
        max_output: int, output_tail: int | None, user: str | int | None, owner: OwnerArg,
        output_hold: OutputHold | None, on_start: Callable[[], None] | None,
        keep_output: bool,
    ) -> RunningCommand:
        """A command started, synchronously: checked, its EXEC frame sent, its deadline
        armed at once (:class:`~corral.runtime.agentconn.Deadline`), its sandbox busy."""
        self._owned(sandbox_id, owner)
        live = self._running(sandbox_id)
        tail = output_tail_for(max_output, output_tail)
        hold = output_hold or self.reserve_output(sandbox_id, max_output, owner=owner)
        own = hold if output_hold is None else None
        try:
            fields = self.command_fields(live, cmd, env, cwd, stdin,
                                         limit_fields(timeout, max_output, tail), user)
            assert live.channel is not None
            oom_before = live.cgroup.oom_kills()
            # nobody waits for the command's start: the agent says nothing until output
            stream = live.channel.open_exec(fields, max_output=max_output, output_tail=tail,
                                            quiet_start=on_start is None)
        except BaseException:
            if own is not None:
                own.release()
            raise
        limit = Deadline(live, stream, timeout)  # (no frame can come before this returns)
        stream.room = OutputRoom(hold, tail, keep=keep_output)
        return RunningCommand(live, stream, limit, cwd, oom_before, on_start, own,
                              CommandTap(self.events, live.id, command_argv(cmd)))

    def command_fields(
        self,
        live: Live,
        cmd: str | Sequence[str],
        env: dict[str, str] | None,
        cwd: str | None,
        stdin: bytes | str | None,
        limits: list[Field],
        user: str | int | None = None,
    ) -> list[Field]:
        """A command's EXEC fields (``limits``: :func:`~corral.runtime.agentconn.limit_fields`;
        ``user``: root or the sandbox user, :mod:`corral.runtime.users`; ``None``: the
        image's ``USER``, else the sandbox user)."""
        argv = command_argv(cmd)
        uid = live.user if user is None else users.resolve(user, live.image_layers)
        full_env = {
            "PATH": BASE_PATH, "HOME": SANDBOX_HOME, "USER": "sandbox", "LOGNAME": "sandbox",
            **(users.user_env(uid) if uid is not None else {}),
            "LANG": "C.UTF-8", "SHELL": "/bin/sh", "PWD": cwd or live.spec.workdir,
            **thread_env(live.spec.cpus, len(self.cpu_picker.cpus)),  # the spec's env wins
            **live.spec.env, **live.spec.secret_env(), **(env or {}),
        }
        for k, v in full_env.items():
            if not isinstance(k, str) or not isinstance(v, str) or "=" in k or "\0" in k + v:
                raise InvalidArgument(f"invalid environment variable {k!r}")
        fields: list[Field] = [(Tag.ARGV, a) for a in argv]
        fields += [(Tag.ENV, f"{k}={v}") for k, v in full_env.items()]
        fields.append((Tag.CWD, resolve_path(live.spec.workdir, cwd or live.spec.workdir)))
        if uid is not None:
            fields.append((Tag.UID, uid))
        fields += limits
        if stdin:
            fields.append((Tag.STDIN, stdin.encode() if isinstance(stdin, str) else stdin))
        return fields

    async def spawn(
        self,
        sandbox_id: str,
        cmd: str | Sequence[str],
        *,
        env: dict[str, str] | None = None,
        cwd: str | None = None,
        timeout: float | None = None,
        max_buffer: int = DEFAULT_MAX_BUFFER,
        terminal: TerminalSize | None = None,
        user: str | int | None = None,
        owner: OwnerArg = UNSET,
    ) -> processes.Process:
        """Start an interactive process: stdin stays open, output is read as it comes.

        Returns a :class:`~corral.runtime.processes.Process` (``write``, ``close_stdin``,
        ``signal``, ``kill``, ``output()``, ``wait``); it dies with its sandbox.
        ``timeout`` (seconds, ``None``: none) kills it like an exec's; ``max_buffer``
        bounds the output kept unread (per stream); ``terminal`` (rows, cols): on a
        pseudo-terminal (:mod:`corral.runtime.terminal`)."""
        self._owned(sandbox_id, owner)
        return await process_start.spawn(self, self._running(sandbox_id), cmd, env=env, cwd=cwd,
                                     timeout=timeout, max_buffer=max_buffer, terminal=terminal,
                                     user=user)

    def get_process(self, sandbox_id: str, process_id: str, *,
                    owner: OwnerArg = UNSET) -> processes.Process:
        """A process of a live sandbox by id; :class:`~corral.errors.NotFound` if none."""
        self._owned(sandbox_id, owner)
        return processes.find(self._get_live(sandbox_id), process_id)

    def list_processes(self, sandbox_id: str, *, owner: OwnerArg = UNSET) -> list[processes.Process]:
        """The processes of a live sandbox (running, and recently exited), oldest first."""
        self._owned(sandbox_id, owner)
        return processes.kept(self._get_live(sandbox_id))

    def forget_process(self, sandbox_id: str, process_id: str, *,
                       owner: OwnerArg = UNSET) -> None:
        """Drop an exited process's record (a running one is killed first by the caller)."""
        owner = self.owners.of(owner)
        live = self._live.get(sandbox_id)
        if live is not None and self.owners.sees(live.spec, owner):
            processes.forget(live, process_id)

    async def kill_processes(self, sandbox_id: str, *, owner: OwnerArg = UNSET) -> int:
        """SIGKILL every process the sandbox's code started (the agent stays; running
        commands end killed); how many there were. See :mod:`corral.runtime.sweep`."""
        self._owned(sandbox_id, owner)
        live = self._running(sandbox_id)
        assert live.proc is not None
        return await asyncio.to_thread(sweep.kill_sandbox_code, live.cgroup, live.proc.pid)


class RunningCommand:
    """A command whose EXEC frame is sent and whose deadline is armed: :meth:`events`
    reads its events once (closing that early kills it); :meth:`abandon` ends one
    whose events will never be read. Either way its sandbox is busy until then, its
    end is announced (:class:`~corral.runtime.cmdtap.CommandTap`) and an output hold
    it owns is released."""

    __slots__ = ("_live", "_stream", "_limit", "_cwd", "_oom_before", "_on_start", "_hold",
                 "_tap", "_activity", "_read")

    def __init__(self, live: Live, stream: ExecStream, limit: Deadline, cwd: str | None,
                 oom_before: int, on_start: Callable[[], None] | None,
                 hold: OutputHold | None, tap: CommandTap) -> None:
        self._live, self._stream, self._limit, self._cwd = live, stream, limit, cwd
        self._oom_before, self._on_start, self._hold, self._tap = oom_before, on_start, hold, tap
        self._activity = live.activity()
        self._activity.__enter__()
        self._read = False

    async def events(self) -> AsyncGenerator[ExecEvent, None]:
        if self._read:
            raise RuntimeError("a command's events are read once")
        self._read = True
        tap, room = self._tap, self._stream.room
        assert room is not None
        try:
            async with aclosing(command_events(
                self._live, self._stream, self._limit.timeout, self._cwd, self._oom_before,
                self._on_start, limit=self._limit,
            )) as events:
                try:
                    async for ev in events:
                        tap.see(ev)
                        if ev.result is not None:
                            room.finish(ev.result)
                            tap.end()  # announced before the caller sees the exit
                        yield ev
                finally:
                    tap.end()  # CommandEnded: the sandbox's log and metrics hear of it
        finally:
            self._done()

    def abandon(self) -> None:
        """Its events will never be read: kill it, as a reader that stops early does
        (its deadline stays armed for an agent that never reports the end)."""
        if self._read:
            return
        self._read = True
        try:
            self._stream.signal(signal.SIGKILL)
        except CorralError:
            pass
        self._stream.close()
        self._tap.end()
        self._done()

    def _done(self) -> None:
        self._activity.__exit__(None, None, None)
        if self._hold is not None:
            self._hold.release()


class StartedExec:
    """:meth:`CommandOps.start_exec`'s command: await it for its
    :class:`~corral.schema.ExecResult` (once), or ``close()`` it unawaited to kill it."""

    __slots__ = ("_run", "_result")

    def __init__(self, run: RunningCommand) -> None:
        self._run = run
        self._result: Coroutine[Any, Any, ExecResult] | None = None

    def __await__(self) -> Generator[Any, None, ExecResult]:
        if self._result is None:
            self._result = self._collect()
        return self._result.__await__()

    def close(self) -> None:
        """Kill the command if nothing awaited it yet (else as a coroutine's close)."""
        if self._result is None:
            self._run.abandon()
            self._result = self._collect()
            self._result.close()  # (awaiting it now raises)
        else:
            self._result.close()

    async def _collect(self) -> ExecResult:
        # one buffer per stream, not a bytes object per frame (~40 bytes each beyond
        # its data, uncounted: a command printing a byte per write)
        out, err = bytearray(), bytearray()
        async with aclosing(self._run.events()) as events:
            async for ev in events:
                if ev.kind == "stdout":
                    out += ev.data
                elif ev.kind == "stderr":
                    err += ev.data
                else:
                    assert ev.result is not None
                    ev.result.stdout, ev.result.stderr = bytes(out), bytes(err)
                    return ev.result
        raise SandboxLost(f"sandbox {self._run._live.id}: the command's stream ended "
                          "without an exit")
