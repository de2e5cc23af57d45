# Generated from _async/_stream.py by scripts/gen_sync.py: edit that file, not this one.
# ruff: noqa: I001  (the imports keep the source's order, sorted for _async)
"""A command's output as it happens: ``exec_stream``'s iterator."""

from __future__ import annotations

import contextlib
import dataclasses
import json
from collections.abc import Generator, Iterator
from typing import Any

import httpx

from corral.client._sync._client import Client
from corral.client._config import exec_http_timeout
from corral.client._models import (
    Command,
    CommandResult,
    OutputChunk,
    parse_exec,
    parse_stream_item,
)
from corral.errors import InvalidState, SandboxLost


class ExecStream:
    """Iterate to get :class:`~corral.OutputChunk` items in the order the command wrote
    them; once the iteration ends, :attr:`result` holds how the command ended.

    The request starts with the iteration. Leaving the ``with`` block (or
    calling :meth:`close`) before the end kills the command.

    Example::

        with sb.exec_stream("pip list", timeout=30) as stream:
            for chunk in stream:
                print(chunk.stream, chunk.text, end="")
        print(stream.result.returncode)
    """

    def __init__(
        self,
        client: Client,
        body: dict[str, Any],
        *,
        args: Command,
        sandbox_id: str,
        check: bool,
    ) -> None:
        self._client = client
        self._body = body
        self._args = args
        self._sandbox_id = sandbox_id
        self._check = check
        self._result: CommandResult | None = None
        self._chunks: Generator[OutputChunk, None] | None = None

    @property
    def result(self) -> CommandResult:
        """How the command ended; available once the iteration is over."""
        if self._result is None:
            raise InvalidState(
                f"sandbox {self._sandbox_id}: the command has not finished: iterate the "
                "stream to its end (or call wait()) before reading result"
            )
        return self._result

    def wait(self) -> CommandResult:
        """Read (and drop) the remaining output; return how the command ended."""
        for _ in self:
            pass
        return self.result

    def __iter__(self) -> ExecStream:
        return self

    def __next__(self) -> OutputChunk:
        if self._chunks is None:
            self._chunks = self._run()
        return self._chunks.__next__()

    def _run(self) -> Generator[OutputChunk, None]:
        timeout = self._body.get("timeout")
        response = self._client.call(
            "exec_stream", {"sandbox_id": self._sandbox_id}, json=self._body,
            timeout=exec_http_timeout(timeout), stream=True,
        )
        try:
            for chunk in self._items(response):
                yield chunk
        finally:
            response.close()

    def _items(self, response: httpx.Response) -> Iterator[OutputChunk]:
        output: dict[str, list[bytes]] = {"stdout": [], "stderr": []}
        with self._client._errors():
            lines = response.iter_lines()
            for line in lines:
                if not line.strip():
                    continue
                item = parse_stream_item(json.loads(line))
                if isinstance(item, OutputChunk):
                    output[item.stream].append(item.data)
                    yield item
                elif item is not None:
                    # the exit is the last line: read the reply's end (a few bytes) so its
                    # connection goes back to the pool instead of being closed; the exit
                    # is known, so a failure there changes nothing
                    with contextlib.suppress(httpx.HTTPError):
                        for _ in lines:
                            pass
                    self._finish(item, output)
                    return
        raise SandboxLost(
            f"sandbox {self._sandbox_id}: the command's output stream ended without an "
            "exit status (the daemon may have stopped)",
            details={"sandbox_id": self._sandbox_id},
        )

    def _finish(self, exit_result: dict[str, Any], output: dict[str, list[bytes]]) -> None:
        result = parse_exec(
            exit_result,
            args=self._args,
            sandbox_id=self._sandbox_id,
            timeout=self._body.get("timeout"),
        )
        # The exit item carries no output of its own: it was streamed already.
        result = dataclasses.replace(
            result,
            stdout_bytes=result.stdout_bytes or b"".join(output["stdout"]),
            stderr_bytes=result.stderr_bytes or b"".join(output["stderr"]),
        )
        self._result = result
        if self._check:
            result.check_returncode()

    def close(self) -> None:
        """Stop reading; a command still running is killed."""
        if self._chunks is not None:
            self._chunks.close()

    def __enter__(self) -> ExecStream:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()
