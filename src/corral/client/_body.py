"""Request bodies sent in bounded pieces, so an upload costs the same per byte at any size.

httpcore's blocking socket write sends a buffer with ``while buf: n = sock.send(buf);
buf = buf[n:]``: each partial send copies the unsent rest, so one 200 MB body cost
about (200 MB)² / (2 × the socket buffer) bytes of copying (131 s). Handing the
transport pieces of :data:`CHUNK_BYTES` bounds that copy per piece, whatever the
total size. The asyncio transport gets the same pieces (and one code path).

- :func:`bounded` swaps the whole-buffer body of a built request for :class:`Chunks`;
  :meth:`corral.AsyncClient.send` applies it to every request (JSON bodies too).
- :class:`SyncFileBody` / :class:`AsyncFileBody` stream a local file without reading
  it into memory.
"""

from __future__ import annotations

import asyncio
import os
from collections.abc import AsyncIterator, Callable, Iterator
from pathlib import Path
from typing import BinaryIO

import httpx

from corral.errors import FileError

CHUNK_BYTES = 256 << 10
"""The largest piece of a request body handed to the HTTP transport at once."""


class Chunks(httpx.ByteStream):
    """A body held in memory, yielded in pieces of at most ``CHUNK_BYTES`` (views, no
    copies); iterable again, so a request that never left can be sent again."""

    def __init__(self, data: bytes) -> None:
        super().__init__(data)
        self._view = memoryview(data).cast("B")

    def _pieces(self) -> Iterator[bytes]:
        view = self._view
        for start in range(0, len(view), CHUNK_BYTES):
            yield view[start:start + CHUNK_BYTES]  # type: ignore[misc]  # bytes-like

    def __iter__(self) -> Iterator[bytes]:
        yield from self._pieces()

    async def __aiter__(self) -> AsyncIterator[bytes]:
        for piece in self._pieces():
            yield piece


def bounded(request: httpx.Request) -> httpx.Request:
    """``request`` with its in-memory body (if over one piece) sent in pieces."""
    stream = request.stream
    if type(stream) is httpx.ByteStream and len(request.content) > CHUNK_BYTES:
        request.stream = Chunks(request.content)
    return request


class _FileBody:
    """A local file's bytes, read in pieces as they are sent (``Content-Length`` is
    ``size``, taken when the upload began). A file that changes size while it is sent
    raises :class:`~corral.errors.FileError` rather than sending a torn copy.

    Two kinds, because httpx tells a blocking body from an asyncio one by the
    iteration it offers: :class:`SyncFileBody` and :class:`AsyncFileBody`."""

    def __init__(self, path: str | os.PathLike[str]) -> None:
        self.path = Path(path)
        self.size = self.path.stat().st_size
        # called with the bytes read so far, after each piece (upload progress)
        self.progress: Callable[[int], object] | None = None

    @property
    def headers(self) -> dict[str, str]:
        return {"Content-Length": str(self.size)}

    def _changed(self, sent: int) -> FileError:
        return FileError(
            f"{self.path} changed size while it was uploaded ({self.size} bytes when the "
            f"upload began, {sent} read): upload it again once nothing writes to it",
            details={"path": str(self.path)},
        )

    def _piece(self, f: BinaryIO, sent: int) -> bytes:
        piece = f.read(min(CHUNK_BYTES, self.size - sent))
        if not piece:
            raise self._changed(sent)
        return piece

    def _check_end(self, f: BinaryIO) -> None:
        if f.read(1):
            raise self._changed(self.size + 1)


class SyncFileBody(_FileBody):
    """A local file, sent in pieces by the blocking client."""

    def __iter__(self) -> Iterator[bytes]:
        with open(self.path, "rb") as f:
            sent = 0
            while sent < self.size:
                piece = self._piece(f, sent)
                sent += len(piece)
                yield piece
                if self.progress is not None:
                    self.progress(sent)
            self._check_end(f)


class AsyncFileBody(_FileBody):
    """A local file, sent in pieces by the asyncio client (read on a worker thread)."""

    async def __aiter__(self) -> AsyncIterator[bytes]:
        f = await asyncio.to_thread(open, self.path, "rb")
        try:
            sent = 0
            while sent < self.size:
                piece = await asyncio.to_thread(self._piece, f, sent)
                sent += len(piece)
                yield piece
                if self.progress is not None:
                    self.progress(sent)
            await asyncio.to_thread(self._check_end, f)
        finally:
            f.close()
