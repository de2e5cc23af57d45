# Generated from _async/_files.py by scripts/gen_sync.py: edit that file, not this one.
# ruff: noqa: I001  (the imports keep the source's order, sorted for _async)
"""Files inside a sandbox: ``sb.files``."""

from __future__ import annotations

import builtins
import os
from pathlib import Path

from corral.client import _validate
from corral.client._sync._client import Client
from corral.client._backends import SyncBackend
from corral.client._models import parse_file_info
from corral.errors import FileNotFound
from corral.schema import FileInfo


def _path(path: object, name: str = "path") -> str:
    return _validate.text(name, os.fspath(path) if isinstance(path, os.PathLike) else path)


def _local(path: object) -> Path:
    if not isinstance(path, (str, os.PathLike)) or not os.fspath(path):
        raise _validate.invalid("local_path", f"expected a path, got {path!r}")
    return Path(path)


class Files:
    """Read, write and list files inside one sandbox, as the sandbox's user sees them.

    Relative paths are relative to the sandbox's ``workdir`` (``/workspace`` unless
    set); a path that climbs above ``/`` raises :class:`~corral.errors.PathOutsideSandbox`.

    Example::

        sb.files.write("/app/solution.py", "print(42)\\n")
        data = sb.files.read("/app/solution.py")        # b"print(42)\\n"
        names = [f.name for f in sb.files.list("/app")]
    """

    def __init__(self, client: Client, sandbox_id: str) -> None:
        self._client = client
        self._sandbox_id = sandbox_id
        self._base = f"/v1/sandboxes/{sandbox_id}/files"

    def write(self, path: str, data: bytes | str, *, mode: int = 0o644) -> None:
        """Create or replace a file (parent directories are created); ``str`` is UTF-8."""
        params = {"path": _path(path), "mode": f"{_validate.file_mode('mode', mode):04o}"}
        content = _validate.content("data", data)
        self._client.request("PUT", self._base, params=params, content=content)

    def read(self, path: str) -> bytes:
        """The whole content of a file."""
        params = {"path": _path(path)}
        return (self._client.request("GET", self._base, params=params)).content

    def list(self, path: str = ".") -> builtins.list[FileInfo]:
        """The entries of a directory, sorted by name."""
        params = {"path": _path(path)}
        response = self._client.request("GET", f"{self._base}/list", params=params)
        return [parse_file_info(e) for e in response.json()["entries"]]

    def stat(self, path: str) -> FileInfo:
        """Size, mode, mtime and type of a file or directory."""
        params = {"path": _path(path)}
        response = self._client.request("GET", f"{self._base}/stat", params=params)
        return parse_file_info(response.json())

    def exists(self, path: str) -> bool:
        """True if ``path`` exists (a file, a directory or anything else)."""
        try:
            self.stat(path)
        except FileNotFound:
            return False
        return True

    def remove(self, path: str, *, recursive: bool = False) -> None:
        """Remove a file, or a directory (non-empty ones only with ``recursive=True``)."""
        recursive = _validate.flag("recursive", recursive)
        params = {"path": _path(path), "recursive": "true" if recursive else "false"}
        self._client.request("DELETE", self._base, params=params)

    def mkdir(self, path: str, *, parents: bool = True, mode: int = 0o755) -> None:
        """Create a directory (and its parents, unless ``parents=False``)."""
        body = {
            "path": _path(path), "parents": _validate.flag("parents", parents),
            "mode": _validate.file_mode("mode", mode),
        }
        self._client.request("POST", f"{self._base}/mkdir", json=body)

    def upload(
        self, local_path: str | os.PathLike[str], remote_path: str, *, mode: int | None = None
    ) -> None:
        """Copy a local file into the sandbox; ``mode`` defaults to the local file's
        permission bits (so an executable stays executable)."""
        local = _local(local_path)
        _path(remote_path, "remote_path")
        if mode is None:
            mode = (SyncBackend.run_blocking(local.stat)).st_mode & 0o777
        data = SyncBackend.read_file(local)
        self.write(remote_path, data, mode=mode)

    def download(self, remote_path: str, local_path: str | os.PathLike[str]) -> Path:
        """Copy a file out of the sandbox to ``local_path``; returns that path."""
        local = _local(local_path)
        data = self.read(remote_path)
        SyncBackend.write_file(local, data)
        return local

    def __repr__(self) -> str:
        return f"<{type(self).__name__} of {self._sandbox_id}>"
