"""A volume's archive received as a stream (``POST /v1/volumes``): staged in a file on
the host's disk as it arrives, never held in memory, so a dataset of many GB makes a
volume like a small one.

Its bytes are checked as they come, not once they are all here: the tenant's
``max_snapshot_mb`` quota (:class:`~corral.errors.QuotaExceeded`) and the disk's reserve
(:class:`~corral.errors.StorageFull`; the staged archive and the tree it becomes are on
the disk at once, so the room must hold twice what came). A stream past either is cut
off there, and the staged file goes on any error, a dropped connection or a cancelled
request, so nothing half-made remains. The archive is then unpacked by the checked
extractor (:meth:`corral.runtime.volumes.Volumes.create`), whose own quota and reserve
checks apply to the tree it made.
"""

from __future__ import annotations

import asyncio
import os
import tempfile
from collections.abc import AsyncIterator, Callable
from pathlib import Path

from starlette.requests import Request

from corral.errors import InvalidArgument, StorageFull
from corral.runtime.storage import room_above_reserve
from corral.server.wire import paced

QUOTA_STEP = 4 << 20  # the quota is checked again each time this many more bytes came
STAGE_PREFIX = ".volume-upload-"


async def stage_body(request: Request, where: Path,
                     quota: Callable[[int], None]) -> Path:
    """The request body written to a new file under ``where``: ``quota(n)`` raises once
    ``n`` bytes are too many for the caller, :class:`StorageFull` once the disk could
    not also hold their tree above its reserve. The caller unlinks the file."""
    declared = request.headers.get("content-length")
    if declared is not None:
        if not declared.isdecimal():
            raise InvalidArgument(f"invalid Content-Length header {declared!r}")
        _check(where, int(declared), 0, quota)  # refused before a byte is read
    fd, tmp = await asyncio.to_thread(tempfile.mkstemp, prefix=STAGE_PREFIX, dir=where)
    path = Path(tmp)
    try:
        try:
            await _write(fd, paced(request), where, quota)
        finally:
            os.close(fd)
    except BaseException:  # an error, a dropped connection, a cancel: nothing stays
        path.unlink(missing_ok=True)
        raise
    return path


async def _write(fd: int, pieces: AsyncIterator[bytes], where: Path,
                 quota: Callable[[int], None]) -> None:
    seen, checked = 0, 0
    async for chunk in pieces:
        seen += len(chunk)
        due = seen - checked >= QUOTA_STEP
        _check(where, seen, seen - len(chunk), quota if due else None)  # statvfs: cheap
        if due:
            checked = seen
        await asyncio.to_thread(os.write, fd, chunk)
    _check(where, seen, seen, quota)


def _room(where: Path) -> int:
    return room_above_reserve(where)


def _check(where: Path, total: int, staged: int,
           quota: Callable[[int], None] | None) -> None:
    """``total`` bytes of archive, ``staged`` of them on disk already: within the quota
    (when ``quota`` is given), and the disk holds the rest of the archive and its
    unpacked tree above its reserve."""
    if quota is not None:
        quota(total)
    room = _room(where)
    need = 2 * total - staged
    if need > room:
        raise StorageFull(
            f"no room for a volume of a {total}-byte archive under {where}: "
            f"{max(0, room) >> 20} MiB are free above the disk's reserve and the archive "
            "and its tree are held at once; remove volumes or snapshots, or free space there",
            details={"path": str(where), "received": total})
