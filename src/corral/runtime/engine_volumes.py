"""The engine's volume verbs, for the owner each call names (:mod:`corral.runtime.volumes`).

Mixed into :class:`~corral.runtime.engine.Engine`. A volume counts against its
tenant's ``max_snapshot_mb`` like its snapshots (checked before it appears), and one
mounted by a live sandbox cannot be removed. On a cluster, volumes travel
(:mod:`corral.runtime.volume_travel`): ``describe_volume`` for a peer, ``pull_volume``
from one.
"""

from __future__ import annotations

import asyncio
import os
from pathlib import Path
from typing import TYPE_CHECKING, Any

from corral.errors import InvalidState, VolumeFull, VolumeNotFound
from corral.runtime import volume_travel
from corral.runtime.ownership import UNSET, OwnerArg
from corral.volume_schema import VolumeInfo

if TYPE_CHECKING:
    from corral.runtime.layer_fetch import LayerFetcher, OpenLayer
    from corral.runtime.live import Live
    from corral.runtime.ownership import Owners
    from corral.runtime.snapshots import Snapshots
    from corral.runtime.volumes import Volumes


class VolumeOps:
    """``create_volume``, ``list_volumes``, ``get_volume``, ``remove_volume``, and their
    travel: ``describe_volume``, ``pull_volume``."""

    if TYPE_CHECKING:
        _live: dict[str, Live]
        owners: Owners
        snapshots: Snapshots
        volumes: Volumes

    def _volume_quota(self, owner: str | None, size: int) -> None:
        self.snapshots.check_quota(owner, {"volume": size})  # QuotaExceeded

    async def create_volume(self, name: str, archive: Path, *, max_mb: int | None = None,
                            owner: OwnerArg = UNSET) -> VolumeInfo:
        """A volume of ``owner`` from the tar file ``archive`` (all or nothing);
        ``max_mb``: a size limit its ``rw`` writers share (VolumeFull past it)."""
        return await asyncio.to_thread(self.volumes.create, self.owners.of(owner), name,
                                       archive, check=self._volume_quota, max_mb=max_mb)

    def check_volume_quota(self, size: int, *, owner: OwnerArg = UNSET) -> None:
        """QuotaExceeded if a volume of ``size`` bytes would pass ``owner``'s quota (a
        streamed archive: :mod:`corral.server.volume_stream`)."""
        self._volume_quota(self.owners.of(owner), size)

    def check_volume_name_free(self, name: str, *, owner: OwnerArg = UNSET) -> None:
        """InvalidState if ``owner`` has a volume ``name`` (before its archive is read)."""
        try:
            self.volumes.get(self.owners.of(owner), name)
        except VolumeNotFound:
            return
        raise InvalidState(f"volume {name!r} exists: remove it first (corral volume rm "
                           f"{name}) or pick another name", details={"volume": name})

    def list_volumes(self, *, owner: OwnerArg = UNSET) -> list[VolumeInfo]:
        return self.volumes.of(self.owners.of(owner))

    def get_volume(self, name: str, *, owner: OwnerArg = UNSET) -> VolumeInfo:
        return self.volumes.get(self.owners.of(owner), name)

    async def remove_volume(self, name: str, *, owner: OwnerArg = UNSET) -> None:
        owner = self.owners.of(owner)
        await asyncio.to_thread(self.volumes.remove, owner, name, self._mounted(owner, name))

    def _mounted(self, owner: str | None, name: str, modes: tuple[str, ...] = ("cow", "ro", "rw")
                 ) -> bool:
        """Whether a live sandbox here mounts ``owner``'s volume ``name`` (in ``modes``)."""
        path = str(self.volumes.data_dir(owner, name))
        return any(src == path and mode in modes
                   for live in self._live.values() for mode, src, _ in live.volumes)

    async def snapshot_volume(self, name: str, new: str, *, owner: OwnerArg = UNSET
                              ) -> VolumeInfo:
        """A new volume ``new`` of ``owner``: ``name``'s files as they are now, counted
        against the owner's quota; refused while a sandbox mounts ``name`` rw (its files
        are changing)."""
        owner = self.owners.of(owner)
        self.volumes.get(owner, name)  # VolumeNotFound first
        if self._mounted(owner, name, ("rw",)):
            raise InvalidState(
                f"volume {name!r} is mounted rw by a running sandbox: its files are changing, "
                "so no snapshot of it is taken until that sandbox ends",
                details={"volume": name, "cause": "writer"})
        return await asyncio.to_thread(self.volumes.snapshot, owner, name, new,
                                       check=self._volume_quota)

    def check_volume_upload(self, name: str, size: int, *, owner: OwnerArg = UNSET
                            ) -> VolumeInfo:
        """Whether a file of ``size`` bytes may be uploaded into ``owner``'s volume
        ``name`` (:mod:`corral.server.volume_uploads`): made here, mounted by no running
        sandbox ro or cow, and within the owner's quota or the volume's ``max_mb``."""
        owner = self.owners.of(owner)
        info = self._writable(owner, name)
        if info.max_mb is None:
            self._volume_quota(owner, size)
            self.volumes.check_room(owner, size)  # the disk's reserve stays free
        else:
            self.volumes.ensure_mounted(owner, name)
            vfs = os.statvfs(self.volumes.data_dir(owner, name))
            if size > vfs.f_bavail * vfs.f_frsize:
                raise VolumeFull(f"{size} bytes do not fit volume {name!r} (max_mb "
                                 f"{info.max_mb}): remove files from it or make a larger one",
                                 details={"volume": name, "max_mb": info.max_mb})
        return info

    async def write_volume_file(self, name: str, path: str, source: Path, mode: int, *,
                                owner: OwnerArg = UNSET) -> None:
        """Put the host file ``source`` at ``path`` in ``owner``'s volume ``name``."""
        owner = self.owners.of(owner)
        info = self._writable(owner, name)
        check = self._volume_quota if info.max_mb is None else None  # (a capped one: ENOSPC)
        await asyncio.to_thread(self.volumes.write_file, owner, name, path, source, mode, check)

    def _writable(self, owner: str | None, name: str) -> VolumeInfo:
        info = self.volumes.get(owner, name)
        if info.home is not None:
            raise InvalidState(f"volume {name!r} here is a copy of node {info.home}'s: write "
                               "into it there", details={"volume": name, "home": info.home})
        if self._mounted(owner, name, ("cow", "ro")):
            raise InvalidState(
                f"volume {name!r} is mounted ro or cow by a running sandbox, whose files "
                "would change under it: write into it when none does (or mount it rw)",
                details={"volume": name, "cause": "mounted"})
        return info

    async def describe_volume(self, name: str, *, owner: OwnerArg = UNSET) -> dict[str, Any]:
        """What another node needs to copy ``owner``'s volume ``name`` (a peer's question;
        the first one hashes the volume)."""
        owner = self.owners.of(owner)
        writing = self._mounted(owner, name, ("rw",))
        return await asyncio.to_thread(volume_travel.describe, self.volumes, owner, name,
                                       writing=writing)

    async def pull_volume(self, name: str, desc: dict[str, Any], open_layer: OpenLayer,
                          fetcher: LayerFetcher, *, node: str, owner: OwnerArg = UNSET
                          ) -> VolumeInfo:
        """``owner``'s volume ``name`` usable here, as node ``node``'s daemon described it
        (``desc``), its tree fetched with ``open_layer`` if this node lacks that version;
        counted against the owner's quota like a volume made here."""
        owner = self.owners.of(owner)
        return await volume_travel.pull(
            fetcher, self.volumes, owner, name, desc, open_layer, node=node,
            in_use=lambda: self._mounted(owner, name), check=self._volume_quota)
