"""Image archives are input from outside: a layer's whiteouts delete only inside it.

A whiteout ``.wh.<name>`` deletes ``<name>`` from the layers below, in its own
directory. ``.wh..`` and ``.wh...`` name that directory and the one above it: applied
as written they removed the extraction root (or the import's work directory above
it). They are refused as an unsafe archive (400 ``image_import_failed``).
"""

from __future__ import annotations

import secrets

import pytest

from corral.errors import ImageImportError
from corral.runtime.images import ImageStore
from corral.runtime.oci_layers import apply_layer
from corral.runtime.paths import Layout
from tests.conftest import requires_root
from tests.runtime.oci_archives import Layer, base_layer, docker_save
from tests.server.conftest import assert_error, uds_client

BAD_WHITEOUTS = [".wh...", ".wh..", ".wh.", "etc/.wh...", "etc/.wh..", "etc/.wh."]


@pytest.mark.parametrize("whiteout", BAD_WHITEOUTS)
def test_a_whiteout_deletes_nothing_but_an_entry_of_its_directory(tmp_path, whiteout):
    """Before: ``.wh...`` removed the root's parent (here ``outer``, with the canary),
    ``.wh..`` the root, ``etc/.wh...`` the root through ``etc/..``."""
    outer = tmp_path / "outer"
    root = outer / "root"
    (root / "etc").mkdir(parents=True)
    (root / "etc/passwd").write_text("root:x:0:0::/root:/bin/sh\n")
    (outer / "canary").write_text("outside the root")
    layer = tmp_path / "layer.tar"
    layer.write_bytes(Layer().file(whiteout).bytes())
    with pytest.raises(ImageImportError, match="names no file"):
        apply_layer(root, layer, 2)
    assert (outer / "canary").read_text() == "outside the root"
    assert (root / "etc/passwd").exists()


def test_a_good_whiteout_still_deletes_its_entry(tmp_path):
    root = tmp_path / "root"
    (root / "etc").mkdir(parents=True)
    (root / "etc/gone").write_text("x")
    (root / "etc/kept").write_text("y")
    layer = tmp_path / "layer.tar"
    layer.write_bytes(Layer().file("etc/.wh.gone").bytes())
    apply_layer(root, layer, 2)
    assert sorted(p.name for p in (root / "etc").iterdir()) == ["kept"]


@requires_root
def test_importing_a_climbing_whiteout_is_a_typed_400(daemon):
    """Over the API: the typed error, no traceback in the daemon's log, no image made,
    and every image the daemon had is still there."""
    logged = daemon.log.stat().st_size
    with uds_client(daemon.socket) as client:
        _import_climbing_whiteouts(client)
    with open(daemon.log, "rb") as log:
        log.seek(logged)
        assert b"Traceback" not in log.read(), f"the daemon logged an error: {daemon.log}"


def _import_climbing_whiteouts(client) -> None:
    rootfs = ImageStore(Layout.create().images_dir).get("python").rootfs
    before = {i["name"] for i in client.get("/v1/images").json()["images"]}
    for whiteout in (".wh...", "etc/.wh.."):
        archive = docker_save([base_layer(rootfs).bytes(), Layer().file(whiteout).bytes()])
        name = f"t-whiteout-{secrets.token_hex(4)}"
        reply = client.post("/v1/images/import", params={"name": name}, content=archive)
        error = assert_error(reply, 400, "image_import_failed")
        assert "names no file" in error["message"]
        assert client.get(f"/v1/images/{name}").status_code == 404
    assert {i["name"] for i in client.get("/v1/images").json()["images"]} == before
    assert all(client.get(f"/v1/images/{n}").status_code == 200 for n in before)
