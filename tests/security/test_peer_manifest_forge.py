"""A hostile peer's description of a built image: what of it reaches this node's
manifest must be checked like the root's description is, or one bad image breaks
every tenant's image listing and sandbox creation on the node. Real daemon."""

from __future__ import annotations

import os

import pytest

from corral.runtime import layer_wire
from corral.runtime.layers import tree_digest
from tests.conftest import requires_root
from tests.security.tenants_helpers import ADMIN_TOKEN, no_traceback
from tests.security.test_root_layer_transfer import _Peer, hostile  # noqa: F401 (fixture)

pytestmark = requires_root


@pytest.mark.parametrize("forged", [
    {"env": {"PATH": 5}},
    {"env": "PATH=/evil"},
    {"env": {"X" * 10: "y" * (600 << 10)}},  # under the description bound
    {"workdir": 5},
    {"workdir": "relative/dir"},
    {"python": {"not": "a version"}},
    {"size_bytes": "lots"},
    {"digest": "not-a-digest"},
    {"source": {"keys": "x" * 100}},
])
def test_a_forged_built_image_description_breaks_nothing(hostile, tmp_path, forged):  # noqa: F811
    team = hostile
    layer = tmp_path / "layer"
    layer.mkdir()
    (layer / "f").write_bytes(b"hello")
    os.chmod(layer, 0o755)
    digest, size = tree_digest(layer)
    _Peer.layer = b"".join(layer_wire.stream(layer))
    with team.admin() as c:
        python = next(i for i in c.get("/v1/images").json()["images"] if i["name"] == "python")
    name = "forged-" + os.urandom(3).hex()
    _Peer.description = {
        "name": name, "kind": "built", "digest": "sha256:" + "ab" * 32, "size_bytes": size,
        "root": {"image": "python", "digest": python["digest"]},
        "layers": [{"id": "x", "digest": digest, "size_bytes": size}], **forged}
    with team.tcp(ADMIN_TOKEN) as admin:
        r = admin.post("/v1/peer/images/fetch", json={"image": name, "node": "evil"})
    if "source" in forged:  # taken, without the peer's build-cache keys
        assert r.status_code == 200, r.text
        manifest = (team.images_dir / name / "manifest.json").read_text()
        assert '"keys"' not in manifest
    else:  # refused, typed, nothing published
        assert r.status_code == 400, r.text
        assert r.json()["error"]["code"] == "invalid_argument"
        assert not (team.images_dir / name).exists()
    with team.admin() as c:
        listed = c.get("/v1/images")
        assert listed.status_code == 200, listed.text  # the node's listing still works
        made = c.post("/v1/sandboxes", json={"image": "python"})
        assert made.status_code == 201, made.text  # and its other images still run
        c.delete(f"/v1/sandboxes/{made.json()['id']}")
        if r.status_code == 200:  # if it was taken, it works or says why
            used = c.post("/v1/sandboxes", json={"image": name})
            assert used.status_code < 500, used.text
            if used.status_code == 201:
                c.delete(f"/v1/sandboxes/{used.json()['id']}")
            c.delete(f"/v1/images/{name}")
    no_traceback(team)
