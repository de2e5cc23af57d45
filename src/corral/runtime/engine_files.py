"""The engine's file operations: a sandbox's files, read and written by its agent.

Mixed into :class:`~corral.runtime.engine.Engine`. Every operation is one request to
the sandbox's agent (a write or read of more than :data:`FILE_CHUNK` is several), runs
as the sandbox's user, and counts as activity; the agent's errors become
:class:`~corral.errors.FileNotFound` / :class:`~corral.errors.FileError` saying what
to do.
"""

from __future__ import annotations

import asyncio
import errno
import os
import stat as st
from collections.abc import AsyncIterable, AsyncIterator
from dataclasses import dataclass
from typing import TYPE_CHECKING

from corral.errors import (
    CorralError,
    FileError,
    FileNotFound,
    FileTooLarge,
    InvalidArgument,
    SandboxDiskFull,
    VolumeFull,
)
from corral.runtime.ownership import UNSET, OwnerArg
from corral.runtime.pathutil import resolve_path
from corral.runtime.protocol import Field, Fields, Msg, Tag, decode_entry
from corral.runtime.uids import SANDBOX_HOME
from corral.schema import FileInfo, SandboxInfo

if TYPE_CHECKING:
    from corral.runtime.kept_files import KeptFiles
    from corral.runtime.live import Live

FILE_CHUNK = 1 << 20
DEFAULT_MAX_READ = 64 << 20


@dataclass(frozen=True)
class FileReading:
    """A file being read (:meth:`FileOps.open_read`): its size, and its chunks to come."""

    size: int
    chunks: AsyncIterator[bytes]


async def _once(data: bytes | bytearray | memoryview) -> AsyncIterator[bytes | bytearray | memoryview]:
    yield data


class FileOps:
    """``write_file``, ``read_file``, ``list_dir``, ``stat``, ``remove``, ``mkdir``."""

    if TYPE_CHECKING:
        _live: dict[str, Live]
        kept: KeptFiles

        def _running(self, sandbox_id: str) -> Live: ...
        def _get_live(self, sandbox_id: str) -> Live: ...
        def get(self, sandbox_id: str, *, owner: OwnerArg = UNSET) -> SandboxInfo: ...
        def _owned(self, sandbox_id: str, owner: OwnerArg) -> None: ...

    def _kept_path(self, sandbox_id: str, path: str) -> str | None:
        """``path`` in a stopped sandbox's kept files; None if it is live or kept none
        (then the agent's error, or the sandbox's, is the answer)."""
        if sandbox_id in self._live or not self.kept.has(sandbox_id):
            return None
        return resolve_path(self.get(sandbox_id, owner=None).spec.workdir, path)

    async def _file_request(
        self, sandbox_id: str, msg: Msg, path: str, fields: list[Field]
    ) -> Fields:
        live = self._running(sandbox_id)
        assert live.channel is not None
        with live.activity():
            reply = await live.channel.request(  # validated; its data no more than asked
                msg, [(Tag.PATH, path), *fields], max_data=FILE_CHUNK if msg == Msg.FREAD else None
            )
        if reply.msg == Msg.ERR:
            raise _file_error(sandbox_id, path, reply.fields, live.volumes)
        return reply.fields

    def _path(self, sandbox_id: str, path: str) -> str:
        live = self._get_live(sandbox_id)
        return resolve_path(live.spec.workdir, path)

    async def write_file(
        self, sandbox_id: str, path: str, data: bytes | bytearray | memoryview | str, *, mode: int = 0o644,
        parents: bool = True, owner: OwnerArg = UNSET,
    ) -> None:
        """Write a file inside the sandbox (as its user), creating parent directories."""
        if isinstance(data, str):
            data = data.encode()
        await self.write_from(sandbox_id, path, _once(data), mode=mode, parents=parents,
                              owner=owner)

    async def write_from(
        self, sandbox_id: str, path: str, pieces: AsyncIterable[bytes | bytearray | memoryview], *,
        mode: int = 0o644, parents: bool = True, owner: OwnerArg = UNSET,
    ) -> int:
        """Write a file from ``pieces`` as they come, :data:`FILE_CHUNK` at a time: what is
        held here is at most one chunk plus one piece, whatever the file's size. Returns
        the bytes written. A failure part-way leaves what was written (the caller removes it)."""
        self._owned(sandbox_id, owner)
        p = self._path(sandbox_id, path)
        if not 0 <= mode <= 0o7777:
            raise InvalidArgument(f"invalid file mode {mode:o}")
        offset = 0

        async def send(chunk: bytes | memoryview) -> None:
            nonlocal offset
            await self._file_request(
                sandbox_id, Msg.FWRITE, p,
                [(Tag.DATA, chunk), (Tag.OFFSET, offset), (Tag.TRUNCATE, offset == 0),
                 (Tag.MODE, mode), (Tag.PARENTS, parents)],
            )
            offset += len(chunk)

        pending = bytearray()
        async for piece in pieces:
            view = memoryview(piece).cast("B")
            while view:
                if not pending and len(view) >= FILE_CHUNK:  # a whole chunk: no copy
                    await send(view[:FILE_CHUNK])
                    view = view[FILE_CHUNK:]
                    continue
                room = FILE_CHUNK - len(pending)
                pending += view[:room]
                view = view[room:]
                if len(pending) == FILE_CHUNK:
                    await send(bytes(pending))
                    pending.clear()
        if pending or offset == 0:  # the tail, or an empty file
            await send(bytes(pending))
        return offset

    async def read_file(
        self, sandbox_id: str, path: str, *, max_bytes: int = DEFAULT_MAX_READ,
        owner: OwnerArg = UNSET,
    ) -> bytes:
        """Read a whole file; :class:`FileTooLarge` if it is bigger than ``max_bytes``.
        A stopped sandbox's files are read from what it kept (:mod:`.kept_files`)."""
        reading = await self.open_read(sandbox_id, path, max_bytes=max_bytes, owner=owner)
        return b"".join([chunk async for chunk in reading.chunks])

    async def open_read(
        self, sandbox_id: str, path: str, *, max_bytes: int = DEFAULT_MAX_READ,
        owner: OwnerArg = UNSET,
    ) -> FileReading:
        """Start reading a file :data:`FILE_CHUNK` at a time: its size is checked against
        ``max_bytes`` (:class:`FileTooLarge`) and its first chunk read before this returns,
        so a caller can still answer with an error; then ``chunks`` yields the file, no
        more than the size it had at the start (a file that shrinks meanwhile raises
        :class:`FileError` at the end: a reader must not take a short file for whole)."""
        self._owned(sandbox_id, owner)
        kept = self._kept_path(sandbox_id, path)
        p = kept if kept is not None else self._path(sandbox_id, path)

        async def chunk_at(offset: int) -> tuple[int, bytes]:
            if kept is not None:
                return await asyncio.to_thread(
                    self.kept.read_at, sandbox_id, p, offset, FILE_CHUNK, max_bytes)
            f = await self._file_request(
                sandbox_id, Msg.FREAD, p, [(Tag.OFFSET, offset), (Tag.LENGTH, FILE_CHUNK)])
            size = f.u64(Tag.SIZE)
            if size > max_bytes:
                raise FileTooLarge(
                    f"{p} in sandbox {sandbox_id} is {size} bytes, over the {max_bytes}-byte "
                    "read limit: raise max_bytes or read it in parts",
                    details={"path": p, "size": size, "limit": max_bytes},
                )
            return size, f.raw(Tag.DATA)

        size, first = await chunk_at(0)

        async def chunks() -> AsyncIterator[bytes]:
            data, offset = first[:size], 0
            while True:
                if data:
                    yield data
                offset += len(data)
                if offset >= size:
                    return
                if not data:
                    raise FileError(f"{p} in sandbox {sandbox_id} shrank while it was read "
                                    f"({offset} of {size} bytes): read it again",
                                    details={"path": p, "size": size, "read": offset})
                _, data = await chunk_at(offset)
                data = data[: size - offset]

        return FileReading(size, chunks())

    async def list_dir(self, sandbox_id: str, path: str = ".", *,
                       owner: OwnerArg = UNSET) -> list[FileInfo]:
        self._owned(sandbox_id, owner)
        if (kept := self._kept_path(sandbox_id, path)) is not None:
            return await asyncio.to_thread(self.kept.list_dir, sandbox_id, kept)
        p = self._path(sandbox_id, path)
        f = await self._file_request(sandbox_id, Msg.FLIST, p, [])
        infos = [_file_info(p, raw, child=True) for raw in f.all(Tag.ENTRY)]
        return sorted(infos, key=lambda i: i.name)

    async def stat(self, sandbox_id: str, path: str, *, owner: OwnerArg = UNSET) -> FileInfo:
        self._owned(sandbox_id, owner)
        if (kept := self._kept_path(sandbox_id, path)) is not None:
            return await asyncio.to_thread(self.kept.stat, sandbox_id, kept)
        p = self._path(sandbox_id, path)
        f = await self._file_request(sandbox_id, Msg.FSTAT, p, [])
        return _file_info(p, f.raw(Tag.ENTRY), child=False)

    async def remove(self, sandbox_id: str, path: str, *, recursive: bool = False,
                     owner: OwnerArg = UNSET) -> None:
        self._owned(sandbox_id, owner)
        p = self._path(sandbox_id, path)
        if p == "/":
            raise InvalidArgument("refusing to remove the sandbox's root directory")
        await self._file_request(sandbox_id, Msg.FREMOVE, p, [(Tag.RECURSIVE, recursive)])

    async def mkdir(
        self, sandbox_id: str, path: str, *, parents: bool = True, mode: int = 0o755,
        owner: OwnerArg = UNSET,
    ) -> None:
        self._owned(sandbox_id, owner)
        p = self._path(sandbox_id, path)
        await self._file_request(
            sandbox_id, Msg.FMKDIR, p, [(Tag.PARENTS, parents), (Tag.MODE, mode)]
        )


def _file_info(parent: str, raw: bytes, *, child: bool) -> FileInfo:

    mode, size, mtime, _uid, _gid, name = decode_entry(raw)
    path = (parent.rstrip("/") + "/" + name) if child else name
    return FileInfo(
        path=path,
        name=name if child else (path.rsplit("/", 1)[-1] or "/"),
        size=size,
        mode=st.S_IMODE(mode),
        mtime=mtime / 1e9,
        is_dir=st.S_ISDIR(mode),
        is_symlink=st.S_ISLNK(mode),
    )


def _file_error(sandbox_id: str, path: str, f: Fields,
                volumes: tuple[tuple[str, str, str], ...] = ()) -> CorralError:
    err = f.u64(Tag.ERRNO)
    details = {"sandbox_id": sandbox_id, "path": path, "errno": err}
    if err == errno.ENOENT:
        return FileNotFound(f"no such file or directory in sandbox {sandbox_id}: {path}", details=details)
    rw = [(src, dest) for mode, src, dest in volumes
          if mode == "rw" and (path == dest or path.startswith(dest.rstrip("/") + "/"))]
    if err in (errno.ENOSPC, errno.EDQUOT) and rw:
        name = os.path.basename(os.path.dirname(rw[0][0]))
        return VolumeFull(
            f"{path} in sandbox {sandbox_id}: the volume {name!r} at {rw[0][1]} is full (its "
            "max_mb): remove files from it, or make a larger volume",
            details={**details, "volume": name, "mount": rw[0][1]})
    if err in (errno.ENOSPC, errno.EDQUOT):
        return SandboxDiskFull(
            f"{path} in sandbox {sandbox_id}: the sandbox's disk is full (its disk_mb or "
            "inodes): free space in it, or create it with a larger disk_mb/inodes",
            details=details)
    hint = {
        errno.EACCES: "permission denied (the image's files are read-only; write under "
        f"{SANDBOX_HOME}, /workspace, /tmp or a directory you created)",
        errno.EISDIR: "it is a directory",
        errno.ENOTDIR: "a part of the path is not a directory",
        errno.ENOTEMPTY: "the directory is not empty (remove it with recursive=True)",
        errno.EEXIST: "it already exists",
        errno.EROFS: "read-only file system",
    }.get(err, f.text(Tag.MESSAGE))
    return FileError(f"{path} in sandbox {sandbox_id}: {hint}", details=details)
