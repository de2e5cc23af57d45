"""Volumes on the daemon: named trees that sandboxes mount with ``volumes={...}``."""

from __future__ import annotations

import builtins
import os
from collections.abc import Callable

from typing_extensions import Self  # typing's since 3.11 only

from corral.client import _validate
from corral.client._async._client import AsyncClient
from corral.client._async._files import VOLUME_UPLOAD, _local, _path, send_resumable
from corral.client._backends import AsyncBackend
from corral.volume_schema import VolumeInfo


class AsyncVolume:
    """A volume: a tree of files made once, mounted into many sandboxes at no copy cost::

        vol = await AsyncVolume.create("dataset", "./data")     # a directory or a tarball
        sb = await AsyncSandbox.create(volumes={"/data": "dataset"})       # cow (default)
        sb = await AsyncSandbox.create(volumes={"/data": "dataset:ro"})    # or ro, rw

    ``cow``: each sandbox writes to a private layer over the shared files (nobody else
    sees it); ``ro``: read-only; ``rw``: shared, writes land in the volume. A volume is
    its tenant's own and counts against its ``max_snapshot_mb``. See docs/network.md.
    """

    def __init__(self, info: VolumeInfo, *, client: AsyncClient) -> None:
        self._info = info
        self._client = client

    @property
    def info(self) -> VolumeInfo:
        return self._info

    @property
    def name(self) -> str:
        return self._info.name

    @classmethod
    async def create(cls, name: str, source: str | os.PathLike[str], *,
                     max_mb: int | None = None, client: AsyncClient | None = None) -> Self:
        """A new volume ``name`` holding the directory or tar archive ``source`` (gzip,
        bzip2 or xz too); ``max_mb``: a size limit its ``rw`` writers share (a full one
        is ``ENOSPC`` inside, :class:`~corral.errors.VolumeFull` from the file API). The
        archive is made and sent as a stream (never whole in memory, of any size within
        the tenant's quota and the daemon's disk reserve)."""
        client = client or AsyncClient.default()
        body = await AsyncBackend.tar_body(source)
        params = {"name": name, **({"max_mb": str(max_mb)} if max_mb is not None else {})}
        response = await client.call(
            "create_volume", params=params, content=body,
            headers={"Content-Type": "application/x-tar"}, timeout=None)
        return cls(VolumeInfo.model_validate(response.json()), client=client)

    @classmethod
    async def get(cls, name: str, *, client: AsyncClient | None = None) -> Self:
        client = client or AsyncClient.default()
        response = await client.call("get_volume", {"name": name})
        return cls(VolumeInfo.model_validate(response.json()), client=client)

    @classmethod
    async def list(cls, *, client: AsyncClient | None = None) -> builtins.list[Self]:
        client = client or AsyncClient.default()
        response = await client.call("list_volumes")
        return [cls(VolumeInfo.model_validate(v), client=client)
                for v in response.json()["volumes"]]

    async def snapshot(self, name: str) -> Self:
        """A new volume ``name`` holding this one's files as they are now (a copy, with
        its ``max_mb``; counted against the quota): freeze an ``rw`` scratch volume
        between episodes. Refused (``InvalidState``) while a sandbox mounts it ``rw``."""
        response = await self._client.call("snapshot_volume", {"name": self.name},
                                           json={"name": name}, timeout=None)
        return type(self)(VolumeInfo.model_validate(response.json()), client=self._client)

    async def upload(self, local_path: str | os.PathLike[str], path: str, *,
                     mode: int | None = None,
                     progress: Callable[[int, int], object] | None = None) -> None:
        """Copy a local file (a 2 GB checkpoint) into the volume at ``path`` (relative to
        its root; parents made), as a resumable upload: sent in parts, a dropped
        connection resumed from the byte the daemon has, the file put in place whole
        once every byte is there. Refused (``InvalidState``) while a running sandbox
        mounts the volume ro or cow. ``progress(sent, total)`` as parts are taken."""
        local = _local(local_path)
        st = await AsyncBackend.run_blocking(local.stat)
        mode = st.st_mode & 0o777 if mode is None else mode
        params = {"path": _path(path), "mode": f"{_validate.file_mode('mode', mode):04o}"}
        await send_resumable(self._client, VOLUME_UPLOAD, {"name": self.name}, local, params,
                             st.st_size, progress)

    async def delete(self) -> None:
        """Remove it (refused while a running sandbox mounts it)."""
        await self._client.call("delete_volume", {"name": self.name})

    def __repr__(self) -> str:
        return f"<{type(self).__name__} {self.name} {self._info.size_bytes} bytes>"
