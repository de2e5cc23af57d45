"""The engine's volume verbs, for the owner each call names (:mod:`corral.runtime.volumes`).

Mixed into :class:`~corral.runtime.engine.Engine`. A volume counts against its
tenant's ``max_snapshot_mb`` like its snapshots (checked before it appears), and one
mounted by a live sandbox cannot be removed. On a cluster, volumes travel
(:mod:`corral.runtime.volume_travel`): ``describe_volume`` for a peer, ``pull_volume``
from one.
"""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import TYPE_CHECKING, Any

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
