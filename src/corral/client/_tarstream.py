"""A volume's archive made as it is sent (``corral.Volume.create``): a directory as a tar
written on the fly, or a tarball read in pieces (gzip, bzip2 or xz decompressed as it
is read), never the whole archive in memory, so a dataset of many GB is sent like a
small one (the daemon stages it on disk: :mod:`corral.server.volume_stream`).

A directory's entries go in sorted order, as :meth:`tarfile.TarFile.add` would write
them (hard links kept as links; sockets and devices left out). A file that changes size
while it is read raises :class:`~corral.errors.FileError` rather than sending a torn copy.
"""

from __future__ import annotations

import asyncio
import bz2
import errno
import gzip
import io
import lzma
import os
import stat
import tarfile
from collections.abc import AsyncIterator, Generator, Iterator
from pathlib import Path
from typing import BinaryIO

from corral.errors import FileError, InvalidArgument

PIECE = 1 << 20
_OPENERS = ((b"\x1f\x8b", gzip.open), (b"BZh", bz2.open), (b"\xfd7zXZ\x00", lzma.open))


def _source(source: str | os.PathLike[str]) -> Path:
    path = Path(source)
    if not (path.is_dir() or path.is_file()):
        raise InvalidArgument(f"cannot read {path}: give a directory or a tar archive",
                              details={"path": str(path)})
    return path


def tar_pieces(source: Path) -> Generator[bytes, None, None]:
    """``source`` as a tar, in pieces of at most about :data:`PIECE` bytes."""
    if source.is_dir():
        yield from _dir_pieces(source)
        return
    with open(source, "rb") as raw:
        magic = raw.read(6)
    opener = next((o for m, o in _OPENERS if magic.startswith(m)), open)
    with opener(source, "rb") as f:
        while piece := f.read(PIECE):
            yield piece


def _walk(root: Path, rel: str) -> Iterator[tuple[Path, str]]:
    for entry in sorted(os.scandir(root), key=lambda e: e.name):
        path, name = Path(entry.path), f"{rel}{entry.name}"
        yield path, name
        if entry.is_dir(follow_symlinks=False):
            yield from _walk(path, name + "/")


def _dir_pieces(root: Path) -> Iterator[bytes]:
    # a TarFile that writes nothing: its gettarinfo keeps the inodes seen (hard links)
    maker = tarfile.open(fileobj=io.BytesIO(), mode="w")
    written = 0
    for path, name in _walk(root, ""):
        f = _open_regular(path)
        try:  # a file's header and bytes from the one inode opened (never a swapped-in link)
            info = maker.gettarinfo(str(path), arcname=name, fileobj=f)
            if info is None:  # a socket, a device: tar.add skips it too
                continue
            header = info.tobuf(maker.format, maker.encoding, maker.errors)
            written += len(header)
            yield header
            if info.isreg():
                if f is None:  # not a file when opened, one since
                    raise FileError(f"{path} changed while it was sent: send it again once "
                                    "nothing writes to it", details={"path": str(path)})
                for piece in _file_pieces(f, path, info.size):
                    written += len(piece)
                    yield piece
                pad = -info.size % tarfile.BLOCKSIZE
                written += pad
                yield b"\0" * pad
        finally:
            if f is not None:
                f.close()
    end = 2 * tarfile.BLOCKSIZE
    end += -(written + end) % tarfile.RECORDSIZE
    yield b"\0" * end


def _open_regular(path: Path) -> BinaryIO | None:
    """``path`` opened if it is a regular file (not through a link, never waiting on a
    FIFO); None for anything else (its header is made from the path, with no bytes)."""
    if not stat.S_ISREG(os.lstat(path).st_mode):
        return None
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC)
    except OSError as exc:
        if exc.errno in (errno.ELOOP, errno.ENXIO):  # replaced since by a link, a socket
            return None
        raise
    if not stat.S_ISREG(os.fstat(fd).st_mode):
        os.close(fd)
        return None
    os.set_blocking(fd, True)
    return os.fdopen(fd, "rb")


def _file_pieces(f: BinaryIO, path: Path, size: int) -> Iterator[bytes]:
    sent = 0
    while sent < size:
        piece = f.read(min(PIECE, size - sent))
        if not piece:
            break
        sent += len(piece)
        yield piece
    if sent != size or f.read(1):
        raise FileError(f"{path} changed size while it was sent ({size} bytes when it "
                        "began): send it again once nothing writes to it",
                        details={"path": str(path)})


class _TarBody:
    """httpx tells a blocking body from an asyncio one by the iteration it offers: two
    kinds, :class:`SyncTarBody` and :class:`AsyncTarBody`."""

    def __init__(self, source: str | os.PathLike[str]) -> None:
        self.source = _source(source)


class SyncTarBody(_TarBody):
    """The archive of ``source``, made as the blocking client sends it."""

    def __iter__(self) -> Iterator[bytes]:
        yield from tar_pieces(self.source)


class AsyncTarBody(_TarBody):
    """The archive of ``source``, made on a worker thread as the asyncio client sends it."""

    async def __aiter__(self) -> AsyncIterator[bytes]:
        pieces = tar_pieces(self.source)
        try:
            while (piece := await asyncio.to_thread(next, pieces, None)) is not None:
                yield piece
        finally:
            pieces.close()
