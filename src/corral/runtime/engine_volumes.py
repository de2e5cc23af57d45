"""The engine's volume verbs, for the owner each call names (:mod:`corral.runtime.volumes`).

Mixed into :class:`~corral.runtime.engine.Engine`. A volume counts against its
tenant's ``max_snapshot_mb`` like its snapshots (checked before it appears), and one
mounted by a live sandbox cannot be removed.
"""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import TYPE_CHECKING

from corral.runtime.ownership import UNSET, OwnerArg
from corral.volume_schema import VolumeInfo

if TYPE_CHECKING:
    from corral.runtime.live import Live
    from corral.runtime.ownership import Owners
    from corral.runtime.snapshots import Snapshots
    from corral.runtime.volumes import Volumes


class VolumeOps:
    """``create_volume``, ``list_volumes``, ``get_volume``, ``remove_volume``."""

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
        path = str(self.volumes.data_dir(owner, name))
        in_use = any(src == path for live in self._live.values() for _, src, _ in live.volumes)
        await asyncio.to_thread(self.volumes.remove, owner, name, in_use)
