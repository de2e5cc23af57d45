"""Red-team: a volume's ``max_mb`` is the most its rw writers may write, but a sparse
image promised it without taking it: a tenant without a snapshot quota (the default)
made a volume larger than the free disk (or many, each as large) and its sandboxes'
writes then filled the disk every tenant's state is on. A capped volume's image is now
allocated in full when it is made, refused typed (``StorageFull``) past the disk's
reserve, and nothing of a refused one is left. An uncapped volume (its archive's tree)
stops at the reserve too, as snapshots do."""

from __future__ import annotations

import io
import tarfile

import pytest

from corral.errors import StorageFull
from corral.runtime.storage import room_above_reserve


def _archive(tmp_path):
    data = b"rows\n"
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w") as tar:
        info = tarfile.TarInfo("a.csv")
        info.size = len(data)
        tar.addfile(info, io.BytesIO(data))
    path = tmp_path / "vol.tar"
    path.write_bytes(buf.getvalue())
    return path


async def test_a_volume_never_promises_more_than_the_disk_holds(engine, tmp_path):
    archive = _archive(tmp_path)
    alice = {"owner": "alice"}
    root = engine.volumes.root
    root.mkdir(parents=True, exist_ok=True)
    beyond = max(8, (room_above_reserve(root) >> 20) + 1024)  # more than is free
    try:
        with pytest.raises(StorageFull) as caught:
            await engine.create_volume("huge", archive, max_mb=beyond, **alice)
        assert caught.value.details["max_mb"] == beyond
        assert engine.list_volumes(**alice) == []
        assert [p.name for p in (root / "alice").iterdir()] == []  # no half-made one
        # a volume that fits takes its space now: its image is allocated, not sparse
        await engine.create_volume("small", archive, max_mb=8, **alice)
        image = root / "alice" / "small" / "volume.img"
        assert image.stat().st_blocks * 512 >= 8 << 20
    finally:  # unmounted: a loop device is the host's
        for v in engine.list_volumes(**alice):
            await engine.remove_volume(v.name, **alice)


async def test_an_uncapped_volume_leaves_the_disk_reserve_free(engine, tmp_path, monkeypatch):
    """A stream of volumes (each at most --max-upload-bytes) stops at the disk's reserve,
    as snapshots do (the disk's room made small: 4 KiB above its reserve)."""
    from corral.runtime import volumes

    archive = _archive(tmp_path)
    monkeypatch.setattr(volumes, "room_above_reserve", lambda _path: 4096)
    with pytest.raises(StorageFull):
        await engine.create_volume("many", archive, owner="alice")  # a 10 KiB tar
    assert engine.list_volumes(owner="alice") == []
    monkeypatch.setattr(volumes, "room_above_reserve", lambda _path: 1 << 20)
    await engine.create_volume("fits", archive, owner="alice")
    await engine.remove_volume("fits", owner="alice")
