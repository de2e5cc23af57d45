"""A ``multipart/form-data`` body read as it arrives: each part's data streams out in
pieces, so an upload of any size is never held whole (E2B's ``files.write`` sends one).

:func:`file_parts` yields ``(filename, data)`` per part; ``data`` must be read to its
end (or the part is skipped) before the next part is asked for. What is held at any
time is one arriving piece plus the delimiter's length. Malformed bodies raise
:class:`~corral.errors.InvalidArgument`.
"""

from __future__ import annotations

import re
from collections.abc import AsyncIterable, AsyncIterator

from corral.errors import InvalidArgument

__all__ = ["MAX_HEADER_BYTES", "boundary_of", "file_parts"]

MAX_HEADER_BYTES = 16 << 10  # one part's headers
_BOUNDARY = re.compile(r'boundary="?([^";]{1,200})"?')
_FILENAME = re.compile(rb'filename="([^"]*)"')


def boundary_of(content_type: str) -> bytes:
    """The boundary a ``multipart/form-data`` Content-Type names."""
    found = _BOUNDARY.search(content_type)
    if found is None:
        raise InvalidArgument("multipart upload without a boundary")
    return found.group(1).encode()


class _Reader:
    def __init__(self, pieces: AsyncIterable[bytes], boundary: bytes) -> None:
        self._pieces = aiter(pieces)
        # A CRLF before the first delimiter makes every delimiter look the same.
        self._buf = bytearray(b"\r\n")
        self._delim = b"\r\n--" + boundary

    async def _more(self) -> None:
        try:
            self._buf += await anext(self._pieces)
        except StopAsyncIteration:
            raise InvalidArgument("malformed multipart body: it ends inside a part") from None

    async def data(self) -> AsyncIterator[bytes]:
        """The bytes up to the next delimiter (consumed with it)."""
        keep = len(self._delim) - 1
        while True:
            at = self._buf.find(self._delim)
            if at >= 0:
                if at:
                    yield bytes(self._buf[:at])
                del self._buf[: at + len(self._delim)]
                return
            if len(self._buf) > keep:  # all but what could start a delimiter
                out = bytes(self._buf[:-keep])
                del self._buf[:-keep]
                yield out
            await self._more()

    async def head(self) -> bytes | None:
        """After a delimiter: a part's headers, or None at the closing ``--``."""
        while len(self._buf) < 2:
            await self._more()
        if self._buf[:2] == b"--":
            return None
        while (end := self._buf.find(b"\r\n\r\n")) < 0:
            if len(self._buf) > MAX_HEADER_BYTES:
                raise InvalidArgument(f"a multipart part's headers are over {MAX_HEADER_BYTES} bytes")
            await self._more()
        head = bytes(self._buf[2:end])
        del self._buf[: end + 4]
        return head


async def file_parts(
    pieces: AsyncIterable[bytes], boundary: bytes, *, max_parts: int
) -> AsyncIterator[tuple[str | None, AsyncIterator[bytes]]]:
    """``(filename or None, data)`` for each part of the body, in order."""
    reader = _Reader(pieces, boundary)
    async for _ in reader.data():  # the preamble
        pass
    parts = 0
    while (head := await reader.head()) is not None:
        parts += 1
        if parts > max_parts:
            raise InvalidArgument(f"at most {max_parts} files in one upload")
        name = _FILENAME.search(head)
        data = reader.data()
        yield (name.group(1).decode("utf-8", "replace") if name else None), data
        async for _ in data:  # what the consumer left unread
            pass
