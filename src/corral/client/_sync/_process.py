# Generated from _async/_process.py by scripts/gen_sync.py: edit that file, not this one.
# ruff: noqa: I001  (the imports keep the source's order, sorted for _async)
"""A process that runs in a sandbox and is talked to while it runs: ``sb.spawn``."""

from __future__ import annotations

import base64
import contextlib
import dataclasses
import json
import time
from collections.abc import Generator, Iterator, Sequence
from typing import Any

from corral.client import _validate
from corral.client._sync._client import Client
from corral.client._backends import SyncBackend, Puller
from corral.client._config import exec_http_timeout
from corral.client._models import (
    Command,
    CommandResult,
    OutputChunk,
    parse_exec,
    parse_stream_item,
)
from corral.errors import (
    ExecTimeout,
    InvalidArgument,
    InvalidState,
    NotFound,
    SandboxLost,
    error_from_dict,
)
from corral.schema import DEFAULT_EXEC_TIMEOUT_S

STDERR_KEPT = 1 << 20
"""Bytes of a process's stderr the SDK keeps (the last ones) for :attr:`Process.stderr`."""
DRAIN_S = 0.5
"""Seconds the SDK waits, after a process's exit, for the end of its output's reply
(sent right after the exit line) before closing that connection instead of reusing it."""
DEFAULT_READ_TIMEOUT_S = DEFAULT_EXEC_TIMEOUT_S
"""Seconds :meth:`Process.readline`, :meth:`~Process.exchange` and
:meth:`~Process.wait` wait unless given ``timeout=`` (``None``: no limit)."""


class Process:
    """A command running in a sandbox with its stdin open, made by
    :meth:`Sandbox.spawn`: write to it, read its output line by line as it comes,
    signal it, wait for it. It dies with its sandbox.

    Two ways to talk to it:

    - streamed: :meth:`write`, then :meth:`readline` / ``for line in proc`` /
      :meth:`chunks`. The output reaches the SDK over one streamed request, opened at
      the first read and kept for the process's life; each write is one small request,
      acknowledged while the process works on it, so a write-then-readline round trip
      is the quickest there is for one process (~0.7 ms on one host).
    - request/reply, for a server that answers each line with one line:
      :meth:`exchange` writes and returns the reply line in one request, with no
      stream open; :meth:`exchange_all` does it for many processes, in many sandboxes,
      in one request (what a vector of environments needs). Once the output is
      streamed (a :meth:`readline`, :meth:`chunks` or :meth:`wait` came first),
      :meth:`exchange` is a :meth:`write` and a :meth:`readline`: the same reply.

    :meth:`readline`, :meth:`exchange` and :meth:`wait` give up after ``timeout``
    seconds (60 unless given; ``None``: no limit) with
    :class:`~corral.errors.ExecTimeout` (a :class:`TimeoutError`). The process keeps
    running and nothing it wrote is lost: the next call reads on from there.

    Read what the process writes: the daemon keeps only ``max_buffer`` bytes of each
    stream's unread output (16 MiB unless set) and drops the rest (the result then
    says ``stdout_truncated``/``stderr_truncated``).

    Leaving the ``with`` block (or :meth:`close`) kills the process if it still
    runs. Example::

        with sb.spawn(["python3", "-u", "-c", ECHO_UPPER]) as proc:
            proc.write("hello\\n")
            print(proc.readline())            # 'HELLO\\n'
            proc.close_stdin()
            result = proc.wait()              # CommandResult
    """

    def __init__(
        self, info: dict[str, Any], *, client: Client, args: Command, text: bool = True
    ) -> None:
        self._info = info
        self._client = client
        self._args = args
        self._text = text
        self._ids = {"sandbox_id": info["sandbox_id"], "process_id": info["id"]}
        self._stdout = bytearray()  # read from the daemon, not yet handed out
        self._stderr = bytearray()
        self._stderr_dropped = False
        self._items: Puller[OutputChunk | dict[str, Any]] | None = None
        self._result: CommandResult | None = None

    # ------------------------------------------------------------ properties

    @property
    def id(self) -> str:
        """The process's id on the daemon (``proc-...``)."""
        return str(self._info["id"])

    @property
    def pid(self) -> int:
        """Its process id inside the sandbox."""
        return int(self._info["pid"])

    @property
    def sandbox_id(self) -> str:
        return str(self._info["sandbox_id"])

    @property
    def pty(self) -> bool:
        """Whether it runs on a pseudo-terminal (``spawn(..., pty=True)``)."""
        return bool(self._info.get("pty"))

    @property
    def args(self) -> Command:
        return self._args

    @property
    def returncode(self) -> int | None:
        """The exit status once the SDK has seen the exit (``None`` before)."""
        return self._result.returncode if self._result is not None else None

    @property
    def result(self) -> CommandResult | None:
        """How it ended, once the SDK has read its exit (``None`` before)."""
        return self._result

    @property
    def stderr(self) -> str:
        """What the process wrote to stderr and the SDK has read so far (its last MiB)."""
        return self._stderr.decode(errors="replace")

    # ----------------------------------------------------------------- input

    def write(self, data: bytes | str) -> None:
        """Send ``data`` to the process's stdin (``str`` is UTF-8); they arrive in order.
        :class:`~corral.errors.InvalidState` once it has exited or its stdin is closed."""
        content = _validate.content("data", data)
        self._client.call("write_stdin", self._ids, content=content)

    def close_stdin(self) -> None:
        """Close the process's stdin: it reads EOF after what was written. Idempotent."""
        self._client.call("write_stdin", self._ids, params={"close": "true"})

    def signal(self, signum: int | str) -> None:
        """Send a signal (``15``, ``"SIGTERM"``) to the process's group; nothing
        happens if it has already ended."""
        if isinstance(signum, bool) or not isinstance(signum, (int, str)):
            raise _validate.invalid(
                "signum", f"expected a signal number or name, got {type(signum).__name__}"
            )
        sig = int(signum) if not isinstance(signum, str) else signum
        self._client.call("signal_process", self._ids, json={"signal": sig})

    def resize(self, rows: int, cols: int) -> None:
        """Set the size of the process's terminal (``pty=True`` only); its foreground
        job gets ``SIGWINCH``. Input written after this call sees the new size."""
        body = {
            "rows": _validate.integer("rows", rows, minimum=1),
            "cols": _validate.integer("cols", cols, minimum=1),
        }
        self._client.call("resize_process", self._ids, json=body)

    def kill(self) -> CommandResult:
        """SIGKILL the process (if it still runs) and return how it ended."""
        if self._result is None:
            self.signal("SIGKILL")
        return self.wait(timeout=None)

    # ---------------------------------------------------------- request/reply

    def exchange(
        self, data: bytes | str, *, timeout: float | None = DEFAULT_READ_TIMEOUT_S
    ) -> Any:
        """Write ``data`` to stdin and return the next line of stdout (``""`` if the
        process exits first), in one request. :class:`~corral.errors.ExecTimeout` if no
        line comes within ``timeout`` seconds (default 60; ``None``: no limit; what was
        written stays written: its reply is the next line read). stderr is kept for
        :meth:`wait` / :meth:`chunks`. After a streamed read it is :meth:`write` then
        :meth:`readline`.

        >>> proc.exchange('{"op": "step", "action": 1}\n')
        """
        content = _validate.content("data", data)
        timeout = _validate.timeout("timeout", timeout)
        if self._streamed:
            self.write(content)
            return self.readline(timeout=timeout)
        params = {} if timeout is None else {"timeout": repr(timeout)}
        response = self._client.call(
            "exchange", self._ids, content=content, params=params,
            timeout=exec_http_timeout(timeout),
        )
        line = response.content
        return line.decode(errors="replace") if self._text else line

    @staticmethod
    def exchange_all(
        pairs: Sequence[tuple[Process, bytes | str]], *,
        timeout: float | None = DEFAULT_READ_TIMEOUT_S,
    ) -> list[Any]:
        """:meth:`exchange` with many processes (one item per process, in any of the
        client's sandboxes) in one request: every ``data`` is written first, then every
        reply line awaited at once (``timeout``: default 60 s, ``None``: no limit). The
        lines, in order; the first failure (a process gone, a ``timeout``) is raised
        once all were answered. A process whose output is streamed already (see
        :meth:`exchange`) raises :class:`~corral.errors.InvalidState`: use
        :meth:`exchange` on it.
        """
        timeout = _validate.timeout("timeout", timeout)
        if not pairs:
            return []
        client = pairs[0][0]._client
        items = []
        for proc, data in pairs:
            if proc._client is not client:
                raise InvalidArgument("exchange_all: every process must use the same client")
            proc._check_exchange()
            item: dict[str, Any] = {"sandbox_id": proc.sandbox_id, "process_id": proc.id}
            raw = _validate.content("data", data)
            try:
                item["data"] = raw.decode()
            except UnicodeDecodeError:
                item["data_b64"] = base64.b64encode(raw).decode()
            items.append(item)
        response = client.call(
            "exchange_many", json={"items": items, "timeout": timeout},
            timeout=exec_http_timeout(timeout),
        )
        lines: list[Any] = []
        for (proc, _), result in zip(pairs, response.json()["results"], strict=True):
            if result.get("error") is not None:
                raise error_from_dict(result["error"])
            line = (
                base64.b64decode(result["data_b64"]) if result.get("data_b64") is not None
                else (result.get("data") or "").encode()
            )
            lines.append(line.decode(errors="replace") if proc._text else line)
        return lines

    def consume(
        self, data: bytes | str, *, timeout: float | None = DEFAULT_READ_TIMEOUT_S,
        exit_timeout: float = 5.0, delete_first: bool = True,
    ) -> tuple[Any, CommandResult]:
        """The last exchange with a process that answers one request and exits (a
        pre-started judge), in one request: write ``data``, read the next line of stdout,
        wait up to ``exit_timeout`` seconds for the exit, and **delete the sandbox**.
        Returns the line (``""``: it exited first; ``None``: no line within ``timeout``
        seconds, and it was killed) and how it ended (its exit, the output it left).
        The sandbox is deleted whatever happened, before the reply, even if this client
        hangs up; ``delete_first=False``: the reply comes as soon as the line and the
        exit are known and the deletion goes on after it (the sandbox is gone moments
        later: a batch's next completion does not wait for it).
        :class:`~corral.errors.InvalidState` once the output is streamed.

        >>> line, ended = proc.consume(request + "\n", timeout=10)
        """
        content = _validate.content("data", data)
        timeout = _validate.timeout("timeout", timeout)
        wait = _validate.timeout("exit_timeout", exit_timeout, optional=False)
        if self._streamed:
            raise InvalidState(
                f"process {self.id}: its output is being streamed (readline, chunks or "
                "wait was used): consume reads it on the daemon; use it before any read"
            )
        params = {"exit_timeout": repr(wait)}
        if not _validate.flag("delete_first", delete_first):
            params["delete"] = "after"
        if timeout is not None:
            params["timeout"] = repr(timeout)
        response = self._client.call(
            "consume", self._ids, content=content, params=params,
            timeout=exec_http_timeout(None if timeout is None else timeout + wait),
        )
        body = response.json()
        self._result = parse_exec(body["result"], args=self.args, sandbox_id=self.sandbox_id,
                                  timeout=None)
        if body.get("data_b64") is not None:
            line: bytes | None = base64.b64decode(body["data_b64"])
        elif body.get("data") is not None:
            line = body["data"].encode()
        else:
            line = None
        if line is None or not self._text:
            return line, self._result
        return line.decode(errors="replace"), self._result

    @property
    def _streamed(self) -> bool:
        """Whether its output is read from the stream (a streamed read came first)."""
        return self._items is not None or self._result is not None or bool(self._stdout)

    def _check_exchange(self) -> None:
        if self._streamed:
            raise InvalidState(
                f"process {self.id}: its output is being streamed (readline, chunks or "
                "wait was used): exchange_all cannot batch it; use proc.exchange()"
            )

    # ---------------------------------------------------------------- output

    def readline(self, *, timeout: float | None = DEFAULT_READ_TIMEOUT_S) -> Any:
        """The next line of stdout, with its ``\\n``; ``""`` (``b""`` with
        ``text=False``) once the process has exited and everything was read.
        :class:`~corral.errors.ExecTimeout` if no whole line comes within ``timeout``
        seconds (default 60; ``None``: no limit); the process runs on, and what it
        wrote so far is returned by the next call."""
        timeout = _validate.timeout("timeout", timeout)
        deadline = None if timeout is None else time.monotonic() + timeout
        while True:
            end = self._stdout.find(b"\n")
            if end >= 0 or self._result is not None:
                size = end + 1 if end >= 0 else len(self._stdout)
                line = bytes(self._stdout[:size])
                del self._stdout[:size]
                return line.decode(errors="replace") if self._text else line
            chunk = self._next_chunk(deadline, "a line of output")
            if chunk is not None and chunk.stream == "stdout":
                self._stdout += chunk.data

    def __iter__(self) -> Iterator[Any]:
        """The lines of stdout (see :meth:`readline`) until the process exits, each
        waited for without a time limit."""
        return self._lines()

    def _lines(self) -> Iterator[Any]:
        while line := self.readline(timeout=None):  # as long as the process lives
            yield line

    def chunks(self) -> Iterator[OutputChunk]:
        """The output as the process writes it (stdout and stderr, in order), until it
        exits; starts with stdout already read but not yet returned by :meth:`readline`."""
        if self._stdout:
            data = bytes(self._stdout)
            self._stdout.clear()
            yield OutputChunk("stdout", data)
        while True:
            chunk = self._next_chunk()
            if chunk is None:
                return
            yield chunk

    def wait(self, *, timeout: float | None = DEFAULT_READ_TIMEOUT_S) -> CommandResult:
        """Wait for the process to exit; its :class:`~corral.CommandResult`, whose
        ``stdout`` is the output not read yet and ``stderr`` what :attr:`stderr` holds.
        :class:`~corral.errors.ExecTimeout` if it still runs after ``timeout`` seconds
        (default 60; ``None``: no limit): it is not killed (:meth:`kill` does that)."""
        timeout = _validate.timeout("timeout", timeout)
        deadline = None if timeout is None else time.monotonic() + timeout
        while self._result is None:
            chunk = self._next_chunk(deadline, "its exit")
            if chunk is not None and chunk.stream == "stdout":
                self._stdout += chunk.data
        assert self._result is not None
        if self._stdout:
            self._result = dataclasses.replace(self._result, stdout_bytes=bytes(self._stdout))
            self._stdout.clear()
        return self._result

    def refresh(self) -> dict[str, Any]:
        """The daemon's record of the process (``state``, ``unread_bytes``, ``result``...)."""
        self._info = (self._client.call("get_process", self._ids)).json()
        return self._info

    def _next_chunk(
        self, deadline: float | None = None, what: str = "output"
    ) -> OutputChunk | None:
        """The next output chunk (stderr is kept in :attr:`stderr` too), or ``None``
        once the exit has been read; :class:`ExecTimeout` past ``deadline``
        (``time.monotonic()``), with nothing lost."""
        if self._result is not None:
            return None
        if self._items is None:
            self._items = SyncBackend.puller(self._read_output())
        left = None if deadline is None else max(0.0, deadline - time.monotonic())
        try:
            item = self._items.next(left)
        except TimeoutError:
            raise ExecTimeout(
                f"process {self.id} in sandbox {self.sandbox_id}: no {what} within the "
                "timeout; it still runs, and what it writes is read by the next call "
                "(pass timeout=None to wait without a limit)",
                details={"sandbox_id": self.sandbox_id, "process_id": self.id},
            ) from None
        if isinstance(item, dict):  # the exit: stderr read before it is kept by now
            self._finish(item)
            self._drain()
            return None
        if item is not None and item.stream == "stderr":
            self._keep_stderr(item.data)
        return item

    def _read_output(self) -> Generator[OutputChunk | dict[str, Any], None]:
        """The output chunks, then the exit result (a dict), as the daemon streams them."""
        response = self._client.call("read_output", self._ids, timeout=None, stream=True)
        try:
            with self._client._errors():
                lines = response.iter_lines()
                for line in lines:
                    if not line.strip():
                        continue
                    item = parse_stream_item(json.loads(line))
                    if isinstance(item, OutputChunk):
                        yield item
                    elif item is not None:
                        yield item
                        # the exit is the last line: read the reply's end (a few bytes)
                        # so its connection goes back to the pool, not closed
                        for _ in lines:
                            pass
                        return
        finally:
            response.close()
        raise SandboxLost(
            f"process {self.id} in sandbox {self.sandbox_id}: its output stream ended "
            "without an exit status (the daemon may have stopped)",
            details={"sandbox_id": self.sandbox_id, "process_id": self.id},
        )

    def _drain(self) -> None:
        """After the exit: let the reader read the end of the output's reply, so the
        next call reuses its connection instead of opening one (~1 ms). Bounded: a
        daemon that keeps the reply open past :data:`DRAIN_S` only costs the connection."""
        items, self._items = self._items, None
        if items is None:
            return
        try:
            with contextlib.suppress(Exception):  # the exit is read: nothing more matters
                items.next(DRAIN_S)
        finally:
            items.close()

    def _keep_stderr(self, data: bytes) -> None:
        self._stderr += data
        if len(self._stderr) > STDERR_KEPT:
            del self._stderr[: len(self._stderr) - STDERR_KEPT]
            self._stderr_dropped = True

    def _finish(self, exit_result: dict[str, Any]) -> None:
        result = parse_exec(exit_result, args=self._args, sandbox_id=self.sandbox_id, timeout=None)
        self._result = dataclasses.replace(
            result,
            stderr_bytes=bytes(self._stderr),
            stderr_truncated=result.stderr_truncated or self._stderr_dropped,
        )

    # ------------------------------------------------------------- lifecycle

    def close(self) -> None:
        """Kill the process if it still runs and stop reading its output."""
        try:
            if self._result is None:
                self._client.call("kill_process", self._ids)
        except NotFound:
            pass  # its sandbox is gone already, and the process with it
        finally:
            if self._items is not None:
                self._items.close()
                self._items = None

    def __enter__(self) -> Process:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()

    def __repr__(self) -> str:
        state = "running" if self._result is None else f"exited {self._result.returncode}"
        return f"<{type(self).__name__} {self.id} pid={self.pid} {state} in {self.sandbox_id}>"

