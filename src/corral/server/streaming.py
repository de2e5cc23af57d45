"""Streamed command output as NDJSON, with the command killed if the client goes away.

Each line is one :class:`~corral.api.models.StreamEvent`. Output chunks are sent as
text (``data``) when they are UTF-8; a multi-byte character split between two chunks
is held back until it is complete, so UTF-8 output always arrives as text. Bytes that
are not UTF-8 arrive as ``data_b64``. A stream over its cap has one line with
``dropped`` (the bytes left out, ``data`` empty) between its head and its tail.
"""

from __future__ import annotations

import asyncio
import base64
import contextlib
import json
import logging
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

import anyio
from starlette.responses import StreamingResponse
from starlette.types import Receive, Scope, Send

from corral.api.models import exec_response
from corral.errors import CorralError, InternalError
from corral.schema import ExecEvent

logger = logging.getLogger("corral.server")

# How long the first event is awaited before the reply starts: errors the engine
# raises up front (unknown sandbox, bad arguments) then get their own HTTP status.
FIRST_EVENT_WAIT_S = 0.05
# With a ``started`` event (a new command's: the agent says it started, or that it could
# not, a bad working directory say), the reply waits for that instead, however long a
# loaded host takes, up to this (only against a hang: the agent always answers one way).
START_WAIT_S = 300.0
MAX_HELD_BYTES = 3  # the longest incomplete UTF-8 sequence


class Utf8Chunker:
    """Splits a byte stream into JSON-ready pieces without breaking characters."""

    def __init__(self) -> None:
        self._held = b""

    def feed(self, data: bytes) -> dict[str, str]:
        """``{"data": text}``, ``{"data_b64": ...}``, or ``{}`` if all is held back."""
        data, self._held = self._held + data, b""
        try:
            return {"data": data.decode()} if data else {}
        except UnicodeDecodeError as exc:
            tail = data[exc.start :]
            if exc.reason == "unexpected end of data" and len(tail) <= MAX_HELD_BYTES:
                self._held = tail
                head = data[: exc.start]
                return {"data": head.decode()} if head else {}
            return {"data_b64": base64.b64encode(data).decode()}

    def flush(self) -> dict[str, str]:
        """Whatever is held back (an incomplete character at the very end), as base64."""
        held, self._held = self._held, b""
        return {"data_b64": base64.b64encode(held).decode()} if held else {}


def _line(event: dict[str, Any]) -> bytes:
    return json.dumps(event, ensure_ascii=False, separators=(",", ":")).encode() + b"\n"


class StartedStream:
    """An engine's event stream whose first step did not fail at once.

    Iterate it for the :class:`ExecEvent` s (each front-end encodes them its own way:
    NDJSON here, server-sent events for Tensorlake); :meth:`aclose` ends the engine's
    stream, which kills the command if it is cut short. Safe to close twice.
    """

    def __init__(self, first: asyncio.Future[ExecEvent], events: AsyncIterator[ExecEvent]):
        self._first: asyncio.Future[ExecEvent] | None = first
        self._pending = first
        self._events = events

    def __aiter__(self) -> AsyncIterator[ExecEvent]:
        return self._iterate()

    async def _iterate(self) -> AsyncIterator[ExecEvent]:
        if self._first is not None:
            first, self._first = self._first, None
            yield await first
        async for event in self._events:
            yield event

    async def aclose(self) -> None:
        await _close(self._pending, self._events)


async def start_events(events: AsyncIterator[ExecEvent],
                       started: asyncio.Event | None = None) -> StartedStream:
    """Begin a streamed command; raise its error now if it fails to start.

    The engine validates a command when its stream is first advanced, so the first
    event is awaited: an immediate failure becomes a normal error reply. Given
    ``started`` (set by the engine's ``on_start``), until the command started or its
    stream ended or failed, however slow the host; else briefly.
    """
    first = asyncio.ensure_future(anext(events))
    waiting: set[asyncio.Future[Any]] = {first}
    if started is not None:
        waiting.add(asyncio.ensure_future(started.wait()))
    try:
        await asyncio.wait(waiting, return_when=asyncio.FIRST_COMPLETED,
                           timeout=FIRST_EVENT_WAIT_S if started is None else START_WAIT_S)
    except asyncio.CancelledError:
        await _close(first, events)
        raise
    finally:
        for each in waiting - {first}:
            each.cancel()
    if first.done() and first.exception() is not None:
        await _close(first, events)
        first.result()  # raises the error
    return StartedStream(first, events)


async def start_stream(events: AsyncIterator[ExecEvent],
                       started: asyncio.Event | None = None) -> "NDJSONResponse":
    """:func:`start_events`, replied as NDJSON lines (the native API's streams)."""
    started_stream = await start_events(events, started)
    return NDJSONResponse(ndjson_lines(started_stream), cleanup=started_stream.aclose)


async def ndjson_lines(stream: StartedStream) -> AsyncIterator[bytes]:
    """The native encoding: one :class:`~corral.api.models.StreamEvent` per line,
    ending with the exit, or an ``error`` line if the stream broke off."""
    chunkers = {"stdout": Utf8Chunker(), "stderr": Utf8Chunker()}
    try:
        async for event in stream:
            if event.kind == "exit":
                for kind, chunker in chunkers.items():
                    if rest := chunker.flush():
                        yield _line({"type": kind, **rest})
                assert event.result is not None
                yield _line({"type": "exit", "result": exec_response(event.result)})
                return
            if event.dropped:  # the gap after a stream's head: what is held back first
                if rest := chunkers[event.kind].flush():
                    yield _line({"type": event.kind, **rest})
                yield _line({"type": event.kind, "data": "", "dropped": event.dropped})
            elif piece := chunkers[event.kind].feed(event.data):
                yield _line({"type": event.kind, **piece})
        error: CorralError = InternalError("the command's stream ended without an exit status")
    except CorralError as exc:
        error = exc
    except Exception as exc:  # the reply has started: report in-band, never crash
        logger.exception("exec stream failed")
        error = InternalError(f"the command's stream failed: {type(exc).__name__}")
    finally:
        await stream.aclose()
    yield _line({"type": "error", "error": error.to_dict()})


async def _close(first: asyncio.Future[ExecEvent], events: AsyncIterator[ExecEvent]) -> None:
    """End the engine's stream; if it is cut short, that kills the command's process group."""
    if not first.done():
        # The stream is still advancing inside `first`: cancel that before closing.
        first.cancel()
        with contextlib.suppress(asyncio.CancelledError, Exception):
            await first
    aclose = getattr(events, "aclose", None)
    if aclose is not None:
        await aclose()


class NDJSONResponse(StreamingResponse):
    """A streamed reply that stops its producer as soon as the client disconnects.

    Starlette only watches for disconnects on older ASGI spec versions; this always
    does, so a client that hangs up stops (and kills) the command it was watching.
    """

    media_type = "application/x-ndjson"

    def __init__(
        self,
        content: AsyncIterator[bytes],
        cleanup: Callable[[], Awaitable[None]] | None = None,
    ) -> None:
        super().__init__(content, media_type=self.media_type)
        self._cleanup = cleanup

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        stream = asyncio.ensure_future(self.stream_response(send))
        watch = asyncio.ensure_future(self.listen_for_disconnect(receive))
        try:
            await asyncio.wait({stream, watch}, return_when=asyncio.FIRST_COMPLETED)
        finally:
            # shielded: a revoke cancels the request's scope (Door.calls), which would
            # cancel each await here too, and the producer would run on (a build in its
            # sandbox, its places in the build gate never given back)
            with anyio.CancelScope(shield=True):
                for task in (stream, watch):
                    task.cancel()
                await asyncio.gather(stream, watch, return_exceptions=True)
                body = self.body_iterator
                if hasattr(body, "aclose"):
                    await body.aclose()
                if self._cleanup is not None:  # also if the body never started
                    await self._cleanup()
        if stream.done() and not stream.cancelled() and stream.exception() is not None:
            if not isinstance(stream.exception(), OSError):  # OSError: the client left
                raise stream.exception()  # type: ignore[misc]
