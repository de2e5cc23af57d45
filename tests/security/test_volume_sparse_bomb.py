"""Red team: a volume's archive with a sparse entry (GNU tar ``-S``). A 10 KB archive
declares a file of 256 MiB of holes; the extractor writes the holes out as zeros, so
before the fix the tree was written in full on the host's disk and only then weighed
against the tenant's quota and the disk's reserve (the streamed bytes, checked as they
came, were 10 KB). A 1 TB entry fills the disk every tenant's state is on. Now the
headers' sizes are weighed first: refused before a byte of the tree lands."""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path

import pytest

from corral.errors import QuotaExceeded, StorageFull, VolumeFull
from corral.runtime import volumes as volumes_mod
from corral.runtime.volumes import Volumes

REAL = 256 << 20  # what the entry unpacks to


@pytest.fixture
def sparse_tar(tmp_path: Path) -> Path:
    if shutil.which("tar") is None:
        pytest.skip("GNU tar is needed to make a sparse archive")
    src = tmp_path / "src"
    src.mkdir()
    with open(src / "holes", "wb") as f:
        f.truncate(REAL)
        f.seek(REAL - 1)
        f.write(b"x")
    out = tmp_path / "bomb.tar"
    subprocess.run(["tar", "--format=gnu", "-S", "-cf", str(out), "-C", str(src), "holes"],
                   check=True)
    assert out.stat().st_size < 1 << 20  # a tiny archive
    return out


def _written(root: Path) -> int:
    """Bytes of regular files anywhere under ``root`` (apparent sizes)."""
    return sum(p.stat().st_size for p in root.rglob("*") if p.is_file() and not p.is_symlink())


def test_a_sparse_entry_is_weighed_against_the_quota_before_it_is_written(tmp_path, sparse_tar):
    root = tmp_path / "vols"
    root.mkdir()
    seen: list[tuple[int, int]] = []

    def quota(owner: str | None, size: int) -> None:
        seen.append((size, _written(root)))
        if size > 8 << 20:
            raise QuotaExceeded(f"{size} bytes over carol's 8 MiB")

    with pytest.raises(QuotaExceeded):
        Volumes(root).create("carol", "bomb", sparse_tar, check=quota)
    assert seen and seen[0] == (seen[0][0], 0), f"the tree was written before the quota: {seen}"
    assert seen[0][0] >= REAL
    assert _written(root) == 0


def test_a_sparse_entry_is_weighed_against_the_disks_reserve_and_a_cap(
        tmp_path, sparse_tar, monkeypatch):
    root = tmp_path / "vols"
    root.mkdir()
    monkeypatch.setattr(volumes_mod, "room_above_reserve", lambda _p: 64 << 20)
    with pytest.raises(StorageFull):
        Volumes(root).create(None, "bomb", sparse_tar)
    with pytest.raises(VolumeFull):
        Volumes(root).create(None, "capped", sparse_tar, max_mb=16)
    assert _written(root) == 0


def test_a_sparse_entry_unpacks_with_its_holes_kept(tmp_path, sparse_tar):
    """The extractor every image import, Dockerfile build and volume uses
    (oci_layers.apply_layer): a sparse entry wrote its full size of zeros (an image import of a
    few KB filled the image cache's disk; an import's limit counts the archive's bytes,
    not what its entries claim). Now its holes stay holes: its data, at its offsets."""
    from corral.runtime.oci_layers import apply_layer, apply_overlay_layer

    for name, apply in (("file", lambda root: apply_layer(root, sparse_tar)),
                        ("stream", lambda root: apply_overlay_layer(root, sparse_tar.open("rb")))):
        root = tmp_path / name
        root.mkdir()
        apply(root)
        st = (root / "holes").stat()
        assert st.st_size == REAL
        assert st.st_blocks * 512 < 1 << 20, f"{name}: {st.st_blocks * 512} bytes for holes"
        with open(root / "holes", "rb") as f:
            assert f.read(4096) == bytes(4096)
            f.seek(REAL - 1)
            assert f.read() == b"x"
