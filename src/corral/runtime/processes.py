"""Interactive processes: started once in a sandbox, then fed and read while they run.

:meth:`Engine.exec <corral.runtime.engine.Engine.exec>` runs a command whose standard
input is known up front. Some work needs a conversation instead: an RL environment
server answers one step at a time, a REPL one expression at a time. A :class:`Process`
keeps the command's stdin open (the agent's ``STDIN_OPEN``) and its output flowing for
as long as it runs::

    proc = await engine.spawn(sandbox_id, ["python3", "-u", "server.py"])
    await proc.write(b'{"op": "reset"}\\n')
    async for event in proc.output():          # ExecEvent: stdout, stderr, then exit
        ...
    await proc.close_stdin()
    result = await proc.wait()                 # ExecResult

What the engine guarantees:

- A process dies with its sandbox (the agent is the sandbox's pid 1); :meth:`wait` and
  :meth:`output` then raise :class:`~corral.errors.SandboxLost` (or
  :class:`~corral.errors.SandboxProtocolError` if the sandbox ended by its own doing).
- A ``timeout`` holds even if the agent does not enforce it: past it (plus
  :data:`~corral.runtime.agentconn.EXEC_GRACE_S`) the engine kills the sandbox's
  processes itself and the process exits ``timed_out`` (:mod:`corral.runtime.agentconn`).
- The engine keeps at most ``max_buffer`` bytes of each stream's output nobody has read
  yet; output written while that much is unread is dropped and the result says
  ``stdout_truncated``/``stderr_truncated``. A reader that keeps up never loses any.
- One reader at a time: a new :meth:`output` or :meth:`readline` takes the output over
  and the previous one ends with :class:`~corral.errors.InvalidState` (a client that
  reconnects gets the rest of the output instead of a refusal).
- :meth:`readline` serves request/reply servers: write a request, read the reply line,
  with no stream kept open (the daemon's ``exchange`` endpoints are built on it).
- While a process runs, its sandbox is busy: an ``idle_timeout`` does not end it.
- Exited processes are remembered (for their result) until their sandbox ends,
  at most :data:`MAX_EXITED_KEPT` per sandbox, the oldest forgotten first. When the
  sandbox ends, output nobody is reading is dropped and the engine gives the memory
  back to the system (:func:`release`).
- With ``terminal=TerminalSize(rows, cols)`` the process runs on a pseudo-terminal
  (:mod:`corral.runtime.terminal`): one output stream, :meth:`Process.resize`, and
  closing stdin types Ctrl-D.
"""

from __future__ import annotations

import asyncio
import dataclasses
import secrets
import signal as signals
import time
from collections import deque
from collections.abc import AsyncIterator, Sequence
from enum import Enum
from typing import TYPE_CHECKING, Any, Protocol

from corral.errors import (
    CorralError,
    ExecTimeout,
    InvalidArgument,
    InvalidState,
    NotFound,
    SandboxLost,
    SandboxProtocolError,
)
from corral.runtime.agentconn import (
    Deadline,
    exit_result,
)
from corral.runtime.cmdtap import CommandTap
from corral.runtime.protocol import Field, Msg
from corral.runtime.terminal import TerminalSize, terminal_size
from corral.schema import ExecEvent, ExecResult, OutputStream

if TYPE_CHECKING:
    from corral.runtime.channel import ExecStream
    from corral.runtime.events import Events
    from corral.runtime.live import Live as _Live
    from corral.runtime.output_budget import OutputBudget, OutputHold

MAX_EXITED_KEPT = 64
COALESCE_BYTES = 64 << 10  # unread output is kept in chunks of up to this many bytes
# What a chunk of unread output holds beyond its bytes (its object, a bytes object, a
# slot of the deque: ~60 bytes), counted in the output budget with them: writes that
# alternate stdout and stderr make a chunk of each byte
CHUNK_COST = 128
STDIN_CHUNK = 1 << 20  # bytes per STDIN frame (the agent appends them in order)
# A process's output cap for the agent is UNLIMITED_OUTPUT: it forwards everything (no
# head, no tail: output_tail does not apply), and the engine bounds what is unread
# (max_buffer).


class ProcessEngine(Protocol):
    """What a process needs of the engine (its :class:`~corral.runtime.engine_commands.CommandOps`,
    which imports this module)."""

    _tasks: set[asyncio.Task[Any]]
    events: Events
    output_budget: OutputBudget

    def _running(self, sandbox_id: str) -> _Live: ...
    def command_fields(
        self,
        live: _Live,
        cmd: str | Sequence[str],
        env: dict[str, str] | None,
        cwd: str | None,
        stdin: bytes | str | None,
        limits: list[Field],
        user: str | int | None = None,
    ) -> list[Field]: ...


class ProcessState(str, Enum):
    RUNNING = "running"
    EXITED = "exited"
    LOST = "lost"  # its sandbox ended (or the engine closed) before it exited


def parse_signal(value: int | str) -> int:
    """A signal number from ``15``, ``"15"``, ``"TERM"`` or ``"SIGTERM"``."""
    if isinstance(value, str):
        name = value.strip().upper()
        if name.isdigit():
            value = int(name)
        else:
            try:
                return int(signals.Signals[name if name.startswith("SIG") else "SIG" + name])
            except KeyError:
                raise InvalidArgument(
                    f"unknown signal {value!r}: use a name like SIGTERM or a number"
                ) from None
    if isinstance(value, bool) or not isinstance(value, int) or not 1 <= value <= 64:
        raise InvalidArgument(f"signal must be a number from 1 to 64 or a name, got {value!r}")
    return value


@dataclasses.dataclass(slots=True)
class _Chunk:
    """Unread output of one stream; a bytearray while small writes join it."""

    kind: OutputStream
    data: bytes | bytearray


class Process:
    """A command running in a sandbox with its stdin open. Made by :func:`spawn`."""

    def __init__(
        self,
        engine: ProcessEngine,
        live: _Live,
        stream: ExecStream,
        argv: list[str],
        *,
        pid: int,
        max_buffer: int,
        oom_before: int,
        deadline: Deadline,
        terminal: TerminalSize | None = None,
    ) -> None:
        self.id = "proc-" + secrets.token_hex(6)
        self.sandbox_id = live.id
        self.argv = argv
        self.pid = pid  # as seen inside the sandbox
        self.started_at = time.time()
        self.ended_at: float | None = None
        self.state = ProcessState.RUNNING
        self.result: ExecResult | None = None
        self.error: CorralError | None = None
        self.max_buffer = max_buffer
        self.stdin_open = True
        self.terminal = terminal  # its size now, on a pseudo-terminal; else None
        self._engine = engine
        self._live = live
        self._stream = stream
        self._oom_before = oom_before
        self._deadline = deadline  # the engine's own enforcement of the spawn's timeout
        self._events: deque[_Chunk] = deque()
        self._unread = {"stdout": 0, "stderr": 0}
        self._chunks_counted = 0  # chunks whose CHUNK_COST the output budget holds
        self._dropped = {"stdout": False, "stderr": False}
        self._wake = asyncio.Event()
        self._done = asyncio.Event()
        self._reader = 0  # generation of the current reader (output() or readline())
        self._reading = False
        self._orphaned = False  # forgotten while a reader held it (discard_output)
        # its sandbox's log and the exec metrics hear of it when it ends (CommandEnded)
        self._tap = CommandTap(engine.events, live.id, argv)
        self._budget = engine.output_budget  # unread output held (runtime/output_budget.py)
        self._tenant = live.spec.tenant

    # ----------------------------------------------------------- properties

    @property
    def returncode(self) -> int | None:
        return self.result.returncode if self.result is not None else None

    @property
    def unread_bytes(self) -> int:
        return self._unread["stdout"] + self._unread["stderr"]

    def info(self) -> dict[str, Any]:
        """What the HTTP API reports about the process."""
        return {
            "id": self.id,
            "sandbox_id": self.sandbox_id,
            "pid": self.pid,
            "cmd": list(self.argv),
            "state": self.state.value,
            "stdin_open": self.stdin_open and self.state == ProcessState.RUNNING,
            "pty": self.terminal is not None,
            "rows": self.terminal.rows if self.terminal else None,
            "cols": self.terminal.cols if self.terminal else None,
            "started_at": self.started_at,
            "ended_at": self.ended_at,
            "unread_bytes": self.unread_bytes,
            "result": self.result,
            "error": self.error,
        }

    # --------------------------------------------------------------- input

    def _check_input(self, what: str) -> None:
        if self.state != ProcessState.RUNNING:
            raise self._ended(f"cannot {what}")
        self._engine._running(self.sandbox_id)  # paused or ending: InvalidState
        if not self.stdin_open:
            raise InvalidState(
                f"cannot {what} process {self.id} in sandbox {self.sandbox_id}: its stdin "
                "was closed (spawn a new process to send more input)",
                details=self._details(),
            )

    async def write(self, data: bytes | str) -> None:
        """Send bytes to the process's stdin (a ``str`` is UTF-8). Returns once they
        are on their way to the agent, which delivers them in order."""
        if isinstance(data, str):
            data = data.encode()
        self._check_input("write to")
        view = memoryview(data)
        for start in range(0, len(view), STDIN_CHUNK):
            self._stream.send_stdin(view[start : start + STDIN_CHUNK])
        await self._stream.channel.drain()  # the sandbox's channel (live.channel)
        self._live.touch()

    async def close_stdin(self) -> None:
        """Close the process's stdin (it reads EOF once what was written is consumed).
        Idempotent; a no-op once the process has ended."""
        if not self.stdin_open or self.state != ProcessState.RUNNING:
            self.stdin_open = False
            return
        self._check_input("close the stdin of")
        self.stdin_open = False
        self._stream.close_stdin()
        await self._stream.channel.drain()

    def signal(self, signum: int | str) -> bool:
        """Send a signal to the process's group; False if it has already ended."""
        sig = parse_signal(signum)
        if self.state != ProcessState.RUNNING:
            return False
        try:
            self._stream.signal(sig)
        except CorralError:  # its sandbox has ended
            return False
        return True

    def resize(self, rows: int, cols: int) -> None:
        """Set the size of the process's terminal (its foreground job gets SIGWINCH).
        :class:`InvalidState` if it has no terminal or has exited."""
        size = terminal_size(rows, cols)
        if self.terminal is None:
            raise InvalidState(
                f"cannot resize process {self.id} in sandbox {self.sandbox_id}: it was not "
                "started on a terminal (spawn it with pty=True)",
                details=self._details(),
            )
        if self.state != ProcessState.RUNNING:
            raise self._ended("cannot resize")
        self._stream.resize(size.rows, size.cols)  # in order with its input
        self.terminal = size

    async def kill(self) -> ExecResult:
        """SIGKILL the process's group and wait for its exit; its result. Idempotent."""
        self.signal(signals.SIGKILL)
        return await self.wait()

    # -------------------------------------------------------------- output

    async def output(self) -> AsyncIterator[ExecEvent]:
        """The output not read yet, as it comes (``stdout``/``stderr`` events), then
        one ``exit`` event. Takes the output over from a reader already attached."""
        me = self._take_reader()
        try:
            while True:
                self._check_reader(me)
                if self._events:
                    event = self._events.popleft()
                    self._consumed(event.kind, len(event.data))
                    yield ExecEvent(event.kind, bytes(event.data))
                    continue
                if self.state == ProcessState.EXITED:
                    yield ExecEvent("exit", result=self.result)
                    return
                await self._next_event()
        finally:
            self._drop_reader(me)

    def __aiter__(self) -> AsyncIterator[ExecEvent]:
        """``async for event in proc``: the same as :meth:`output`."""
        return self.output()

    async def readline(self, limit: int | None = None) -> bytes:
        """The next line of stdout, with its ``\n``; the last one may lack it, and
        ``b""`` means the process has exited and all its stdout was read. Takes the
        output over like :meth:`output`; stderr stays queued for the next reader.

        At most ``limit`` bytes (default ``max_buffer``): a longer line comes back in
        pieces. Nothing is consumed until the line is complete, so a reader cancelled
        while it waits (a timeout) loses nothing.
        """
        limit = max(1, self.max_buffer) if limit is None else limit
        if limit < 1:
            raise InvalidArgument(f"readline needs limit >= 1 byte, got {limit}")
        me = self._take_reader()
        try:
            while True:
                self._check_reader(me)
                size = 0
                for event in self._events:
                    if event.kind != "stdout":
                        continue
                    newline = event.data.find(b"\n", 0, limit - size)
                    if newline >= 0:
                        return self._take_stdout(size + newline + 1)
                    size += len(event.data)
                    if size >= limit:
                        return self._take_stdout(limit)
                if self.state == ProcessState.EXITED:
                    return self._take_stdout(size)
                await self._next_event()
        finally:
            self._drop_reader(me)

    def _take_stdout(self, size: int) -> bytes:
        """Remove the first ``size`` bytes of queued stdout, leaving stderr in place."""
        parts: list[bytes | bytearray] = []
        kept: deque[_Chunk] = deque()
        want = size
        while self._events:
            event = self._events.popleft()
            if event.kind != "stdout" or want == 0:
                kept.append(event)
                continue
            head, tail = event.data[:want], event.data[want:]
            parts.append(head)
            want -= len(head)
            if tail:
                kept.append(_Chunk("stdout", tail))
        self._events = kept
        self._consumed("stdout", size)
        return b"".join(parts)

    def _take_reader(self) -> int:
        self._reader += 1
        self._reading = True
        self._wake.set()  # a previous reader wakes up and sees it was replaced
        return self._reader

    def _check_reader(self, me: int) -> None:
        if self._reader != me:
            raise InvalidState(
                f"process {self.id} in sandbox {self.sandbox_id}: another reader took "
                "its output over",
                details=self._details(),
            )

    def _drop_reader(self, me: int) -> None:
        if self._reader == me:
            self._reading = False
            if self._orphaned:
                self.discard_output()

    async def _next_event(self) -> None:
        """Wait for more output, the exit, or another reader; raise if the sandbox ended."""
        if self.state == ProcessState.LOST:
            assert self.error is not None
            raise self.error
        self._wake.clear()
        await self._wake.wait()

    async def wait(self, timeout: float | None = None) -> ExecResult:
        """Wait for the process to exit and return its result.

        The result's ``stdout``/``stderr`` hold the output nobody had read (taken now),
        unless a reader is attached (it gets the output). :class:`ExecTimeout` if it
        still runs after ``timeout`` seconds (it is not killed); :class:`SandboxLost`
        if its sandbox ended first.
        """
        try:
            await asyncio.wait_for(asyncio.shield(self._done.wait()), timeout)
        except asyncio.TimeoutError:
            raise ExecTimeout(
                f"process {self.id} in sandbox {self.sandbox_id} still runs after "
                f"{timeout:g} s: kill() it or wait longer",
                details={**self._details(), "timeout": timeout},
            ) from None
        if self.error is not None:
            raise self.error
        assert self.result is not None
        if self._reading:
            return self.result
        out: list[bytes | bytearray] = []
        err: list[bytes | bytearray] = []
        while self._events:
            event = self._events.popleft()
            (out if event.kind == "stdout" else err).append(event.data)
        self._consumed_all()
        return dataclasses.replace(self.result, stdout=b"".join(out), stderr=b"".join(err))

    # --------------------------------------------------------------- pump

    async def _pump(self) -> None:
        """Move the agent's frames for this process into its bounded output buffer."""
        live = self._live
        limit = self._deadline
        try:
            while True:
                try:
                    reply = await self._stream.next()
                except SandboxProtocolError:
                    if limit.enforced is None:
                        raise
                    # The agent did not enforce the timeout: the engine did.
                    self._end(ProcessState.EXITED, result=await limit.enforced)
                    return
                if reply.msg in (Msg.STDOUT, Msg.STDERR):
                    kind: OutputStream = "stdout" if reply.msg == Msg.STDOUT else "stderr"
                    self._push(kind, reply.data)
                    self._tap.see(ExecEvent(kind, reply.data))
                    live.touch()
                elif reply.msg == Msg.EXIT:
                    result = exit_result(
                        live.cgroup, reply.fields, self._stream, self._oom_before, limit.started
                    )
                    result.stdout_truncated |= self._dropped["stdout"]
                    result.stderr_truncated |= self._dropped["stderr"]
                    self._end(ProcessState.EXITED, result=result)
                    return
        except CorralError as exc:
            self._end(ProcessState.LOST, error=exc)
        except asyncio.CancelledError:
            self._end(
                ProcessState.LOST,
                error=SandboxLost(
                    f"process {self.id}: the engine of sandbox {self.sandbox_id} closed",
                    details=self._details(),
                ),
            )
            raise
        finally:
            if self.state == ProcessState.RUNNING:  # an unexpected error: never hang waiters
                self._end(ProcessState.LOST, error=SandboxLost(
                    f"process {self.id}: lost its output stream", details=self._details()
                ))
            live.busy -= 1
            live.touch()
            limit.cancel()
            self._stream.close()
            _forget_old(live)

    def _push(self, kind: OutputStream, data: bytes) -> None:
        # A budget per stream: stderr nobody reads must not starve stdout (a server
        # answered line by line with readline() while it logs to stderr).
        room = self.max_buffer - self._unread[kind]
        if len(data) > room:
            self._dropped[kind] = True
            data = data[: max(room, 0)]
        # Small writes join the last unread chunk of their stream (up to
        # COALESCE_BYTES): a process writing a byte at a time must not cost the daemon
        # an event object per byte, nor readline() a scan over millions of them.
        last = self._events[-1] if self._events else None
        joins = last is not None and last.kind == kind and len(last.data) < COALESCE_BYTES
        cost = 0 if joins else CHUNK_COST
        want = len(data) + cost
        if data and (granted := self._budget.take(self._tenant, want)) < want:
            self._dropped[kind] = True  # the output budget is spent: dropped as past the cap
            if granted <= cost:
                self._budget.give(self._tenant, granted)
                granted = cost = 0
            data = data[:granted - cost]
        if data:
            self._chunks_counted += cost // CHUNK_COST
            if joins:
                assert last is not None
                if not isinstance(last.data, bytearray):
                    last = self._events[-1] = _Chunk(kind, bytearray(last.data))
                last.data += data
            else:
                self._events.append(_Chunk(kind, data))
            self._unread[kind] += len(data)
            self._wake.set()

    def _end(
        self, state: ProcessState, *, result: ExecResult | None = None,
        error: CorralError | None = None,
    ) -> None:
        self.state, self.result, self.error = state, result, error
        self.ended_at = time.time()
        if result is not None:
            self._tap.see(ExecEvent("exit", result=result))
        self._tap.end()  # once; LOST (its sandbox ended first): outcome "killed"
        self.stdin_open = False
        self._done.set()
        self._wake.set()

    def discard_output(self) -> int:
        """Drop the output nobody reads (its sandbox ended and no reader is attached);
        the bytes dropped."""
        if self._reading:
            # a reader drains it; what it leaves (it stopped reading, its client hung
            # up) is dropped as it lets go: never counted once nobody can read it
            self._orphaned = True
            return 0
        dropped = self.unread_bytes
        self._events.clear()
        self._consumed_all()
        return dropped

    def _consumed(self, kind: OutputStream, n: int) -> None:
        """``n`` bytes of ``kind`` were read: their room goes back to the budget (and
        that of the chunks gone with them)."""
        self._unread[kind] -= n
        gone = max(0, self._chunks_counted - len(self._events))
        self._chunks_counted -= gone
        self._budget.give(self._tenant, n + gone * CHUNK_COST)

    def reply_hold(self) -> OutputHold:
        """Room in the budget for a reply carrying output just read (its room as unread
        output went back as it was read), held until the reply is written
        (:class:`~corral.server.wire.HeldResponse` sizes it)."""
        return self._budget.hold(self._tenant)

    def _consumed_all(self) -> None:
        self._budget.give(self._tenant, self.unread_bytes + self._chunks_counted * CHUNK_COST)
        self._unread = {"stdout": 0, "stderr": 0}
        self._chunks_counted = 0

    # ------------------------------------------------------------ helpers

    def _details(self) -> dict[str, Any]:
        return {"sandbox_id": self.sandbox_id, "process_id": self.id}

    def _ended(self, what: str) -> CorralError:
        if self.state == ProcessState.LOST and self.error is not None:
            return self.error
        return InvalidState(
            f"{what} process {self.id} in sandbox {self.sandbox_id}: it has exited "
            f"(returncode {self.returncode})",
            details={**self._details(), "returncode": self.returncode},
        )

    def __repr__(self) -> str:
        return f"<Process {self.id} pid={self.pid} {self.state.value} in {self.sandbox_id}>"


def find(live: _Live, process_id: str) -> Process:
    """A process of a live sandbox; :class:`NotFound` if it has none by that id."""
    proc = live.processes.get(process_id)
    if not isinstance(proc, Process):
        raise NotFound(
            f"no process {process_id!r} in sandbox {live.id}: it never existed, or it "
            "exited long ago and was forgotten (list the sandbox's processes)",
            details={"sandbox_id": live.id, "process_id": process_id},
        )
    return proc


def kept(live: _Live) -> list[Process]:
    """The sandbox's processes (running, and recently exited), oldest first."""
    return [p for p in live.processes.values() if isinstance(p, Process)]


def forget(live: _Live, process_id: str) -> None:
    proc = live.processes.pop(process_id, None)
    if isinstance(proc, Process):
        proc.discard_output()  # nobody can read it any more: its room goes back


def release(live: _Live) -> int:
    """Its sandbox ended: drop the processes' unread output and forget them (nobody can
    ask for them any more); the bytes of output dropped."""
    dropped = sum(p.discard_output() for p in kept(live))
    live.processes.clear()
    return dropped


def _forget_old(live: _Live) -> None:
    ended = [p for p in kept(live) if p.state != ProcessState.RUNNING]
    for proc in ended[: max(0, len(ended) - MAX_EXITED_KEPT)]:
        live.processes.pop(proc.id, None)
        proc.discard_output()
