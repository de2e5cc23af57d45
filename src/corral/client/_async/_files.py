"""Files inside a sandbox: ``sb.files``."""

from __future__ import annotations

import builtins
import contextlib
import functools
import os
import secrets
from collections.abc import AsyncIterator, Callable
from pathlib import Path

from corral.client import _tree, _validate
from corral.client._async._client import AsyncClient
from corral.client._backends import AsyncBackend
from corral.client._body import CHUNK_BYTES
from corral.client._config import exec_http_timeout
from corral.client._models import exec_body, parse_exec, parse_file_info
from corral.errors import DaemonUnavailable, FileError, FileNotFound, RequestTimeout
from corral.schema import FileInfo

RESUMABLE_ABOVE = 256 << 20  # upload() sends larger files as resumable uploads
UPLOAD_PART = 8 << 20  # bytes per request of a resumable upload
UPLOAD_RESUMES = 20  # dropped connections survived per upload


def _read_part(path: Path, offset: int, length: int) -> bytes:
    with open(path, "rb") as f:
        f.seek(offset)
        return f.read(length)


def _path(path: object, name: str = "path") -> str:
    return _validate.text(name, os.fspath(path) if isinstance(path, os.PathLike) else path)


def _local(path: object) -> Path:
    if not isinstance(path, (str, os.PathLike)) or not os.fspath(path):
        raise _validate.invalid("local_path", f"expected a path, got {path!r}")
    return Path(path)


class AsyncFiles:
    """Read, write and list files inside one sandbox, as the sandbox's user sees them.

    Relative paths are relative to the sandbox's ``workdir`` (``/workspace`` unless
    set); a path that climbs above ``/`` raises :class:`~corral.errors.PathOutsideSandbox`.

    Example::

        await sb.files.write("/app/solution.py", "print(42)\\n")
        data = await sb.files.read("/app/solution.py")        # b"print(42)\\n"
        names = [f.name for f in await sb.files.list("/app")]
    """

    def __init__(self, client: AsyncClient, sandbox_id: str) -> None:
        self._client = client
        self._sandbox_id = sandbox_id
        self._ids = {"sandbox_id": sandbox_id}

    async def write(self, path: str, data: bytes | str, *, mode: int = 0o644) -> None:
        """Create or replace a file (parent directories are created); ``str`` is UTF-8."""
        params = {"path": _path(path), "mode": f"{_validate.file_mode('mode', mode):04o}"}
        content = _validate.content("data", data)
        await self._client.call("upload_file", self._ids, params=params, content=content)

    async def read(self, path: str) -> bytes:
        """The whole content of a file."""
        params = {"path": _path(path)}
        return (await self._client.call("download_file", self._ids, params=params)).content

    async def list(self, path: str = ".") -> builtins.list[FileInfo]:
        """The entries of a directory, sorted by name."""
        params = {"path": _path(path)}
        response = await self._client.call("list_files", self._ids, params=params)
        return [parse_file_info(e) for e in response.json()["entries"]]

    async def stat(self, path: str) -> FileInfo:
        """Size, mode, mtime and type of a file or directory."""
        params = {"path": _path(path)}
        response = await self._client.call("stat_file", self._ids, params=params)
        return parse_file_info(response.json())

    async def exists(self, path: str) -> bool:
        """True if ``path`` exists (a file, a directory or anything else)."""
        try:
            await self.stat(path)
        except FileNotFound:
            return False
        return True

    async def remove(self, path: str, *, recursive: bool = False) -> None:
        """Remove a file, or a directory (non-empty ones only with ``recursive=True``)."""
        recursive = _validate.flag("recursive", recursive)
        params = {"path": _path(path), "recursive": "true" if recursive else "false"}
        await self._client.call("remove_file", self._ids, params=params)

    async def mkdir(self, path: str, *, parents: bool = True, mode: int = 0o755) -> None:
        """Create a directory (and its parents, unless ``parents=False``)."""
        body = {
            "path": _path(path), "parents": _validate.flag("parents", parents),
            "mode": _validate.file_mode("mode", mode),
        }
        await self._client.call("make_dir", self._ids, json=body)

    async def upload(
        self, local_path: str | os.PathLike[str], remote_path: str, *, mode: int | None = None,
        resumable: bool | None = None, progress: Callable[[int, int], object] | None = None,
    ) -> None:
        """Copy a local file into the sandbox; ``mode`` defaults to the local file's
        permission bits (so an executable stays executable). The file is read in
        pieces as it is sent, never whole into memory.

        ``resumable`` (by default: files over :data:`RESUMABLE_ABOVE` bytes): send it
        as a resumable upload, in parts of :data:`UPLOAD_PART` bytes; a dropped
        connection is resumed from the byte the daemon has (up to
        :data:`UPLOAD_RESUMES` times). See docs/network.md.

        ``progress(sent, total)`` is called as bytes go out (a streamed upload: as each
        piece is read; a resumable one: as the daemon acknowledges each part)."""
        local = _local(local_path)
        params = {"path": _path(remote_path, "remote_path")}
        st = await AsyncBackend.run_blocking(local.stat)
        if mode is None:
            mode = st.st_mode & 0o777
        params["mode"] = f"{_validate.file_mode('mode', mode):04o}"
        if resumable or (resumable is None and st.st_size > RESUMABLE_ABOVE):
            await self._upload_resumable(local, params, st.st_size, progress)
            return
        body = await AsyncBackend.file_body(local)
        if progress is not None:
            body.progress = functools.partial(_report, progress, body.size)
        await self._client.call(
            "upload_file", self._ids, params=params, content=body, headers=body.headers
        )

    async def _upload_resumable(self, local: Path, params: dict[str, str], size: int,
                                progress: Callable[[int, int], object] | None) -> None:
        await send_resumable(self._client, SANDBOX_UPLOAD, self._ids, local, params, size,
                             progress)

    async def download(self, remote_path: str, local_path: str | os.PathLike[str], *,
                       progress: Callable[[int, int], object] | None = None) -> Path:
        """Copy a file out of the sandbox to ``local_path``; returns that path. The
        bytes are written as they arrive, to a temporary file renamed into place once
        complete (a failed download leaves nothing at ``local_path``).
        ``progress(received, total)`` is called as they arrive (total: 0 if unknown)."""
        local = _local(local_path)
        params = {"path": _path(remote_path, "remote_path")}
        response = await self._client.call("download_file", self._ids, params=params, stream=True)
        try:
            with self._client._errors():
                pieces = response.aiter_bytes(CHUNK_BYTES)
                if progress is not None:
                    size = response.headers.get("content-length", "")
                    pieces = _counted(pieces, progress, int(size) if size.isdigit() else 0)
                await AsyncBackend.save(pieces, local)
        finally:
            await response.aclose()
        return local

    async def upload_dir(
        self, local_dir: str | os.PathLike[str], remote_dir: str, *, timeout: float | None = None
    ) -> None:
        """Copy a local directory's contents into ``remote_dir`` (created if missing;
        what is there already stays unless overwritten). The tree travels as one tar
        archive, unpacked by the sandbox's ``tar`` (the default image has it);
        symbolic links are copied as links, never followed. ``timeout`` bounds the
        unpacking (``None``: no limit)."""
        local = _local(local_dir)
        target = _path(remote_dir, "remote_dir")
        archive = await AsyncBackend.run_blocking(_tree.pack, local)
        remote_archive = f"{_tree.ARCHIVE_DIR}/.corral-cp-{secrets.token_hex(6)}.tar"
        try:
            await self.upload(archive, remote_archive, mode=0o600)
        finally:
            await AsyncBackend.run_blocking(archive.unlink)
        await self._sh(_tree.UNPACK, [target, remote_archive], f"unpacking {local}", timeout)

    async def download_dir(
        self, remote_dir: str, local_dir: str | os.PathLike[str], *, timeout: float | None = None
    ) -> Path:
        """Copy the directory ``remote_dir`` out of the sandbox as the new local
        directory ``local_dir`` (which must not exist: a copy never merges); returns
        that path. Packed by the sandbox's ``tar``; symbolic links stay links (never
        followed); device files, absolute paths and hard links out of the copy are
        refused; a failed copy leaves nothing behind. ``timeout`` bounds the packing."""
        local = _local(local_dir)
        source = _path(remote_dir, "remote_dir")
        info = await self.stat(source)
        if not info.is_dir:
            raise FileError(
                f"sandbox {self._sandbox_id}: {source} is not a directory: use files.download",
                details={"sandbox_id": self._sandbox_id, "path": source},
            )
        await AsyncBackend.run_blocking(
            _tree.refuse_existing, local, f"{self._sandbox_id}:{source}")
        remote_archive = f"{_tree.ARCHIVE_DIR}/.corral-cp-{secrets.token_hex(6)}.tar"
        archive = await AsyncBackend.run_blocking(_tree.scratch)
        try:
            await self._sh(_tree.PACK, [source, remote_archive], f"packing {source}", timeout)
            await self.download(remote_archive, archive)
            await AsyncBackend.run_blocking(functools.partial(
                _tree.unpack, archive, local, mode=info.mode, sandbox_id=self._sandbox_id,
                source=source))
        finally:
            await AsyncBackend.run_blocking(functools.partial(archive.unlink, missing_ok=True))
            with contextlib.suppress(FileNotFound):
                await self.remove(remote_archive)
        return local

    async def _sh(self, script: str, params: builtins.list[str], what: str,
                  timeout: float | None) -> None:
        """Run a shell script (``$1``, ``$2``... from ``params``); raise if it fails."""
        cmd = ["sh", "-c", script, "sh", *params]
        body = exec_body(cmd, timeout=timeout, env=None, cwd=None, stdin=None,
                         max_output=None, output_tail=None)
        response = await self._client.call(
            "exec_command", self._ids, json=body,
            timeout=exec_http_timeout(timeout))
        result = parse_exec(response.json(), args=cmd, sandbox_id=self._sandbox_id,
                            timeout=timeout)
        if not result.ok:
            raise FileError(
                f"sandbox {self._sandbox_id}: {what} failed (exit status {result.returncode}): "
                f"{result.stderr.strip() or 'no message'}",
                details={"sandbox_id": self._sandbox_id},
            )

    def __repr__(self) -> str:
        return f"<{type(self).__name__} of {self._sandbox_id}>"


def _report(progress: Callable[[int, int], object], total: int, sent: int) -> None:
    progress(sent, total)


async def _counted(pieces: AsyncIterator[bytes], progress: Callable[[int, int], object],
                   total: int) -> AsyncIterator[bytes]:
    got = 0
    async for piece in pieces:
        yield piece
        got += len(piece)
        progress(got, total)


SANDBOX_UPLOAD = ("create_upload", "patch_upload", "upload_state")
VOLUME_UPLOAD = ("create_volume_upload", "patch_volume_upload", "volume_upload_state")


async def send_resumable(client: AsyncClient, ops: tuple[str, str, str], ids: dict[str, str],
                         local: Path, params: dict[str, str], size: int,
                         progress: Callable[[int, int], object] | None) -> None:
    """Send ``local`` as a resumable upload (``ops``: its create, patch and state
    operations, on a sandbox's or a volume's ``ids``), in parts of :data:`UPLOAD_PART`
    bytes, resuming a dropped connection from the byte the daemon has."""
    create, patch, state_of = ops
    response = await client.call(create, ids, json={
        "path": params["path"], "size": size, "mode": params["mode"]})
    ids = {**ids, "upload_id": response.json()["upload_id"]}
    offset, resumes = 0, 0
    while True:
        try:
            if offset < size or size == 0:
                part = await AsyncBackend.run_blocking(_read_part, local, offset, UPLOAD_PART)
                state = (await client.call(
                    patch, ids, content=part,
                    headers={"Upload-Offset": str(offset)}, timeout=None)).json()
            else:  # every byte sent: the daemon writes the file
                state = (await client.call(state_of, ids)).json()
            if progress is not None:
                progress(state["offset"], size)
            if state["done"]:
                return
            offset = state["offset"]
        except (DaemonUnavailable, RequestTimeout):
            resumes += 1
            if resumes > UPLOAD_RESUMES:
                raise
            await AsyncBackend.sleep(min(0.1 * resumes, 2.0))
            offset = (await client.call(state_of, ids)).json()["offset"]
