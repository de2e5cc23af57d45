"""A command's output as it happens: ``exec_stream``'s iterator."""

from __future__ import annotations

import contextlib
import dataclasses
import json
from collections.abc import AsyncGenerator, AsyncIterator
from typing import Any

import httpx

from corral.client._async._client import AsyncClient
from corral.client._config import exec_http_timeout
from corral.client._models import (
    Command,
    CommandResult,
    OutputChunk,
    parse_exec,
    parse_stream_item,
)
from corral.errors import InvalidState, SandboxLost


class AsyncExecStream:
    """Iterate to get :class:`~corral.OutputChunk` items in the order the command wrote
    them; once the iteration ends, :attr:`result` holds how the command ended.

    The request starts with the iteration. Leaving the ``async with`` block (or
    calling :meth:`aclose`) before the end kills the command.

    Example::

        async with sb.exec_stream("pip list", timeout=30) as stream:
            async for chunk in stream:
                print(chunk.stream, chunk.text, end="")
        print(stream.result.returncode)
    """

    def __init__(
        self,
        client: AsyncClient,
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
        self._chunks: AsyncGenerator[OutputChunk, None] | None = None

    @property
    def result(self) -> CommandResult:
        """How the command ended; available once the iteration is over."""
        if self._result is None:
            raise InvalidState(
                f"sandbox {self._sandbox_id}: the command has not finished: iterate the "
                "stream to its end (or call wait()) before reading result"
            )
        return self._result

    async def wait(self) -> CommandResult:
        """Read (and drop) the remaining output; return how the command ended."""
        async for _ in self:
            pass
        return self.result

    def __aiter__(self) -> AsyncExecStream:
        return self

    async def __anext__(self) -> OutputChunk:
        if self._chunks is None:
            self._chunks = self._run()
        return await self._chunks.__anext__()

    async def _run(self) -> AsyncGenerator[OutputChunk, None]:
        timeout = self._body.get("timeout")
        response = await self._client.call(
            "exec_stream", {"sandbox_id": self._sandbox_id}, json=self._body,
            timeout=exec_http_timeout(timeout), stream=True,
        )
        try:
            async for chunk in self._items(response):
                yield chunk
        finally:
            await response.aclose()

    async def _items(self, response: httpx.Response) -> AsyncIterator[OutputChunk]:
        output: dict[str, list[bytes]] = {"stdout": [], "stderr": []}
        with self._client._errors():
            lines = response.aiter_lines()
            async for line in lines:
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
                        async for _ in lines:
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

    async def aclose(self) -> None:
        """Stop reading; a command still running is killed."""
        if self._chunks is not None:
            await self._chunks.aclose()

    async def __aenter__(self) -> AsyncExecStream:
        return self

    async def __aexit__(self, *exc_info: object) -> None:
        await self.aclose()
