"""Tensorlake's background processes: engine processes whose output is kept as lines.

A Tensorlake client starts a process, then lists it, reads its output (again and
again), follows it, writes its stdin and signals it. Each is one of the engine's
interactive processes (:meth:`corral.runtime.engine.Engine.spawn`); this module keeps
what Tensorlake's API shows and the engine does not keep: the output as lines (up to
:data:`PROCESS_OUTPUT_CAP_BYTES`), a ``pid`` numbered per sandbox from
:data:`FIRST_PID` (a handle, not the process id inside the sandbox), and how it ended.
"""

from __future__ import annotations

import asyncio
import codecs
import contextlib
import dataclasses
import itertools
import json
import signal
import time
from collections.abc import AsyncIterator, Collection
from dataclasses import dataclass, field
from typing import Any

from corral.errors import CorralError, NotFound
from corral.runtime.output_budget import OutputBudget
from corral.runtime.processes import Process as EngineProcess
from corral.server.sandbox_verbs import SandboxVerbs

PROCESS_OUTPUT_CAP_BYTES = 16 << 20  # the lines kept per process
LINE_COST = 128  # what a kept line holds beyond its text (its object, str and time)
MAX_LINE_CHARS = 1 << 20  # a line without its newline yet, held at most
FIRST_PID = 100
KILLED = {"exit_code": None, "signal": 9, "oom_killed": False, "reason": "signaled"}


class LineSplitter:
    """Text arriving in chunks, handed on as whole lines (without their newline); a
    line longer than :data:`MAX_LINE_CHARS` is handed on in pieces of that size, so
    output without newlines holds no more than that here."""

    def __init__(self) -> None:
        self._rest = ""

    def feed(self, text: str) -> list[str]:
        *lines, self._rest = (self._rest + text).split("\n")
        while len(self._rest) > MAX_LINE_CHARS:
            lines.append(self._rest[:MAX_LINE_CHARS])
            self._rest = self._rest[MAX_LINE_CHARS:]
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


def sse(data: dict[str, Any]) -> bytes:
    """One server-sent event."""
    return b"data: " + json.dumps(data, separators=(",", ":")).encode() + b"\n\n"


@dataclass
class _Line:
    stream: str
    text: str
    at: float


@dataclass
class Process:
    """One background process: an engine process (:meth:`Engine.spawn`) whose output
    is kept here as lines, so Tensorlake's clients can read it again and follow it."""

    pid: int
    argv: list[str]
    discard: frozenset[str]
    engine_proc: EngineProcess
    stdin_open: bool = False
    started_at: float = field(default_factory=time.time)
    lines: list[_Line] = field(default_factory=list)
    kept_bytes: int = 0
    exit: dict[str, Any] | None = None
    ended_at: float | None = None
    task: asyncio.Task[None] | None = None
    changed: asyncio.Event = field(default_factory=asyncio.Event)
    # the output budget the kept lines count against (runtime/output_budget.py), and whose
    budget: OutputBudget | None = None
    tenant: str | None = None

    @property
    def done(self) -> bool:
        return self.ended_at is not None

    def notify(self) -> None:
        """Wake followers; they wait on the event they saw, so none misses a line."""
        event, self.changed = self.changed, asyncio.Event()
        event.set()

    def keep(self, stream: str, text: str) -> None:
        """A line of output, unless its stream is discarded or the cap is reached."""
        if stream in self.discard or self.kept_bytes >= PROCESS_OUTPUT_CAP_BYTES:
            return
        cost = len(text) + LINE_COST  # an empty line is not free
        if self.budget is not None and (got := self.budget.take(self.tenant, cost)) < cost:
            self.budget.give(self.tenant, got)  # the budget is spent: not kept
            return
        self.kept_bytes += cost
        self.lines.append(_Line(stream, text, time.time()))
        self.notify()

    def release(self) -> None:
        """Give the kept lines' room in the output budget back (the record is dropped)."""
        budget, self.budget = self.budget, None
        if budget is not None:
            budget.give(self.tenant, self.kept_bytes)

    def info(self) -> dict[str, Any]:
        body: dict[str, Any] = {
            "pid": self.pid, "status": "running",
            "stdin_writable": self.stdin_open and not self.done,
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
                    yield sse({"line": line.text, "stream": line.stream, "timestamp": line.at})
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
        found = self._by_sandbox.get(sandbox_id, {}).get(int(ref)) if ref.isdecimal() else None
        if found is None:
            raise NotFound(
                f"no process {ref!r} in sandbox {sandbox_id}: list them with list_processes()",
                details={"sandbox_id": sandbox_id, "process": ref},
            )
        return found

    def start(self, engine: SandboxVerbs, sandbox_id: str, proc: Process) -> None:
        self._by_sandbox.setdefault(sandbox_id, {})[proc.pid] = proc
        proc.task = asyncio.create_task(
            self._pump(engine, sandbox_id, proc), name=f"tensorlake-{proc.pid}"
        )

    async def _pump(self, engine: SandboxVerbs, sandbox_id: str, proc: Process) -> None:
        splitters = {"stdout": StreamLines(), "stderr": StreamLines()}
        try:
            async for event in proc.engine_proc.output():
                if proc.kept_bytes >= PROCESS_OUTPUT_CAP_BYTES and event.kind != "exit":
                    continue  # full: read on (so the process never blocks), keep nothing
                if event.kind in splitters:
                    for line in splitters[event.kind].feed(event.data):
                        proc.keep(event.kind, line)
                elif event.kind == "exit" and event.result is not None:
                    for name, splitter in splitters.items():
                        if (rest := splitter.flush()) is not None:
                            proc.keep(name, rest)
                    proc.exit = exit_json(dataclasses.asdict(event.result))
        except asyncio.CancelledError:
            proc.engine_proc.signal(signal.SIGKILL)  # its sandbox is being deleted
        except CorralError:
            pass  # the sandbox went away: reported as killed below
        finally:
            proc.exit = proc.exit or KILLED
            proc.ended_at = time.time()
            proc.notify()
            with contextlib.suppress(CorralError):  # its record is kept here
                engine.forget_process(sandbox_id, proc.engine_proc.id)

    async def kill(self, proc: Process) -> bool:
        """Kill a running process (its whole process group); False if it had ended."""
        if proc.task is None or proc.task.done():
            return False
        proc.engine_proc.signal(signal.SIGKILL)
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
            proc.release()


class StreamLines:
    """Bytes of one stream as whole lines of text (a character split across chunks is
    decoded once whole; undecodable bytes become U+FFFD)."""

    def __init__(self) -> None:
        self._decoder = codecs.getincrementaldecoder("utf-8")("replace")
        self._lines = LineSplitter()

    def feed(self, data: bytes) -> list[str]:
        return self._lines.feed(self._decoder.decode(data))

    def flush(self) -> str | None:
        tail = self._decoder.decode(b"", final=True)
        if tail:
            self._lines.feed(tail)
        return self._lines.flush()
