"""Compressed archives a client sends (an image import, a Dockerfile's ``ADD``) that
expand far beyond their size.

A `docker save | gzip` archive and a layer inside one were gunzipped (or un-zstd-ed) to
the cache with no bound, and a Dockerfile's ``ADD x.tar.bz2`` or ``.xz`` likewise: a few
MB of bzip2 of zeros expand to terabytes, and the host's disk fills. Each now stops at
what one pull may unpack (``CORRAL_PULL_MAX_BYTES``) and at the disk's reserve.
"""

from __future__ import annotations

import bz2
import gzip
import io
import secrets
import tarfile

import pytest

from corral.errors import ImageBuildError, ImageImportError
from corral.runtime.dockerfile_build import build_dockerfile
from corral.runtime.oci import import_image
from tests.conftest import requires_root

EXPANDED = 8 << 20  # what the archives hold
LIMIT = 1 << 20  # what this test lets one import unpack


def _tar_of_zeros() -> bytes:
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w") as tar:
        info = tarfile.TarInfo("zeros")
        info.size = EXPANDED
        tar.addfile(info, io.BytesIO(bytes(EXPANDED)))
    return buf.getvalue()


def test_an_import_that_expands_past_the_limit_is_refused(tmp_path, monkeypatch):
    from corral.runtime.images import ImageStore

    monkeypatch.setenv("CORRAL_PULL_MAX_BYTES", str(LIMIT))
    archive = tmp_path / "image.tar.gz"
    archive.write_bytes(gzip.compress(_tar_of_zeros()))
    assert archive.stat().st_size < LIMIT  # small on the wire
    store = ImageStore(tmp_path / "images")
    with pytest.raises(ImageImportError, match="expands past"):
        import_image(store, archive, "bomb")


@requires_root
async def test_a_dockerfile_add_that_expands_past_the_limit_is_refused(engine, tmp_path,
                                                                      monkeypatch):
    monkeypatch.setenv("CORRAL_PULL_MAX_BYTES", str(LIMIT))
    (tmp_path / "bomb.tar.bz2").write_bytes(bz2.compress(_tar_of_zeros()))
    (tmp_path / "Dockerfile").write_text("FROM python\nADD bomb.tar.bz2 /x/\n")
    with pytest.raises(ImageBuildError, match="expands past"):
        await build_dockerfile(engine, tmp_path, name=f"t-bomb-{secrets.token_hex(4)}")
