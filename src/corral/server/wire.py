"""Reading request bodies and writing error replies, shared by every route."""

from __future__ import annotations

import asyncio
import weakref
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse

from corral.errors import (
    CorralError,
    FileTooLarge,
    InvalidArgument,
    RequestTimeout,
    StorageFull,
)
from corral.runtime.engine_files import FileReading
from corral.runtime.output_budget import OutputHold
from corral.runtime.storage import room_above_reserve
from corral.server.limits import BODY_IDLE_TIMEOUT_S, parse_json


def error_response(err: CorralError, headers: dict[str, str] | None = None) -> JSONResponse:
    """The reply for an error: its HTTP status and ``{"error": err.to_dict()}``."""
    return JSONResponse({"error": err.to_dict()}, status_code=err.status, headers=headers)


WHOLE_BODY_BYTES = 64 << 10
"""A body declared this small is read in one await, within one idle timeout for all of
it: the piece-by-piece path (three generators and a timer per piece) cost ~3× the CPU
of a small JSON request's read (docs/performance.md)."""


async def read_body(request: Request, limit: int, what: str) -> bytearray:
    """The whole request body, refused with 413 once it is known to exceed ``limit``."""
    pieces = body_pieces(request, limit, what)  # a declared length over it: refused now
    declared = request.headers.get("content-length")
    if declared is not None and int(declared) <= WHOLE_BODY_BYTES:
        try:
            async with asyncio.timeout(BODY_IDLE_TIMEOUT_S):
                return bytearray(await request.body())
        except TimeoutError:
            raise _stalled() from None
    body = bytearray()
    async for chunk in pieces:
        body += chunk
    return body


async def save_body(request: Request, path: Path, limit: int, what: str) -> int:
    """Write the request body to the new file ``path`` as it arrives (the daemon holds
    one piece at a time), refused with 413 past ``limit`` like :func:`read_body`, and
    with :class:`StorageFull` once it and what it unpacks to would take the disk below
    its reserve (concurrent uploads each count what they wrote); its size. The caller
    removes ``path`` (its work directory) whatever happens."""
    declared = request.headers.get("content-length")
    if declared is not None and declared.isdecimal():
        check_room(path.parent, int(declared), 0, what)  # refused before a byte is read
    size = 0
    with open(path, "xb") as f:
        async for chunk in body_pieces(request, limit, what):
            size += len(chunk)
            check_room(path.parent, size, size - len(chunk), what)  # statvfs: cheap
            await asyncio.to_thread(f.write, chunk)
    return size


def _room(where: Path) -> int:
    return room_above_reserve(where)


def check_room(where: Path, total: int, staged: int, what: str) -> None:
    """StorageFull unless the disk under ``where`` holds, above its reserve, the rest
    of a ``total``-byte body (``staged`` of it written already) and its unpacked tree."""
    room = _room(where)
    if 2 * total - staged > room:
        raise StorageFull(
            f"no room for a {total}-byte {what}: {max(0, room) >> 20} MiB are free above "
            "the disk's reserve, and the upload and what it unpacks to are held at once; "
            "send less, or free space on the daemon's disk (images, snapshots, volumes)",
            details={"received": total})


def body_pieces(request: Request, limit: int, what: str) -> AsyncIterator[bytes]:
    """The request body as it arrives (never held whole), refused with 413 once it is
    known to exceed ``limit``: at once for a declared Content-Length, else part-way."""

    def too_large(size: int | str) -> FileTooLarge:
        return FileTooLarge(
            f"the {what} is {size} bytes, over this daemon's limit of {limit} bytes "
            "(--max-upload-bytes); send less, or split it",
            details={"limit": limit},
        )

    declared = request.headers.get("content-length")
    if declared is not None:
        if not declared.isdecimal():
            raise InvalidArgument(f"invalid Content-Length header {declared!r}")
        if int(declared) > limit:
            raise too_large(int(declared))

    async def pieces() -> AsyncIterator[bytes]:
        seen = 0
        async for chunk in paced(request):
            seen += len(chunk)
            if seen > limit:
                raise too_large(f"more than {limit}")
            yield chunk

    return pieces()


class ReplyCut(Exception):
    """A streamed reply that could not be finished (its connection is cut short of
    its Content-Length): logged as a warning, not as an error of the daemon's."""


async def _cut_on_error(chunks: AsyncIterator[bytes]) -> AsyncIterator[bytes]:
    try:
        async for chunk in chunks:
            yield chunk
    except CorralError as exc:  # not Starlette's to answer: the reply has started
        raise ReplyCut(exc.message) from None


def file_response(reading: FileReading, media_type: str = "application/octet-stream") -> StreamingResponse:
    """A file read from a sandbox, sent as it is read (:meth:`Engine.open_read`): the
    daemon holds one chunk of it at a time. A read that fails part-way cuts the
    connection short of its Content-Length, so no client takes it for the whole file."""
    return StreamingResponse(_cut_on_error(reading.chunks), media_type=media_type,
                             headers={"content-length": str(reading.size)})


async def paced(request: Request) -> AsyncIterator[bytes]:
    """The pieces of the request body, cut (408) once none comes for a while."""
    pieces = request.stream()
    while True:
        try:  # asyncio.timeout, not wait_for: no task made per piece (a request's body)
            async with asyncio.timeout(BODY_IDLE_TIMEOUT_S):
                chunk = await anext(pieces)
        except StopAsyncIteration:
            return
        except TimeoutError:
            raise _stalled() from None
        yield chunk


def _stalled() -> RequestTimeout:
    return RequestTimeout(f"no part of the request body arrived for {BODY_IDLE_TIMEOUT_S:g} s")


async def read_json(request: Request, what: str, *, required: bool = True) -> dict[str, Any]:
    """The request body as a JSON object; an empty body is ``{}`` unless ``required``."""
    raw = await read_body(request, request.app.state.settings.max_upload_bytes, what)
    if not raw.strip():
        if required:
            raise InvalidArgument(f"missing request body: send the {what} as a JSON object")
        return {}
    data = parse_json(raw, what)
    if not isinstance(data, dict):
        raise InvalidArgument(f"the {what} must be a JSON object, not {type(data).__name__}")
    return data


HELD_PIECE = 64 << 10
"""A held reply is sent in pieces of this size (flow control between them)."""


class HeldResponse(Response):
    """A reply made of a command's output, holding as much of the output budget
    (:mod:`corral.runtime.output_budget`) as its body's size until it has been written
    or the client has gone; a reply never sent gives it back when collected."""

    def __init__(self, content: Any, hold: OutputHold, **kwargs: Any) -> None:
        super().__init__(content, **kwargs)
        hold.fit(len(self.body))  # its JSON may be larger than the output
        self._hold = hold
        if len(self.body) <= HELD_PIECE:  # one piece, written at once: nothing to hold
            hold.release()
        else:
            weakref.finalize(self, hold.release)

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        # In pieces: uvicorn waits for a paused transport before a send, never after
        # it, so one send of the whole body returned at once with all of it in the
        # transport's buffer (a client not reading) and the room given back.
        try:
            await send({"type": "http.response.start", "status": self.status_code,
                        "headers": self.raw_headers})
            body = memoryview(self.body)
            for at in range(0, max(len(body), 1), HELD_PIECE):
                await send({"type": "http.response.body", "body": bytes(body[at:at + HELD_PIECE]),
                            "more_body": at + HELD_PIECE < len(body)})
        finally:
            self._hold.release()


class HeldJSONResponse(HeldResponse, JSONResponse):
    """A command's result as JSON, held like :class:`HeldResponse`."""
