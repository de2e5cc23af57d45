"""Volumes travel between nodes over the peer path (runtime/volume_travel.py), and a
tenant gets nothing through it that is not its own.

One daemon whose peers (``CORRAL_PEERS``) are itself (``self``: an honest holder) and a
fake daemon (``evil``: it answers whatever the test sets). A tenant that names another
tenant's volume, a path for a name, or that a peer answers with another tenant's
digest, a stream that does not hash to it or another volume's name, ends with a typed
error and nothing made: no volume, no temporary tree. The peer routes stay the peer
credential's; a copy is never mounted ``rw`` and follows its home when unused.
"""

from __future__ import annotations

import http.server
import json
import os
import tarfile
import threading
import time
from pathlib import Path

import pytest

from corral.runtime import layer_wire
from corral.runtime.layers import tree_digest
from tests.conftest import Daemon, _base_dir, have_root_runtime
from tests.security.tenants_helpers import ADMIN_TOKEN, Team, no_traceback
from tests.security.test_layer_transfer import _tar
from tests.security.test_root_layer_transfer import _Peer as _FakePeer
from tests.server.conftest import free_port
from tests.server.test_image_input import _context_tar


class _Peer(_FakePeer):
    """The fake daemon ``evil``: its description of any volume, and one layer stream."""

    description: dict = {}
    layer = b""
    asked: list[str] = []


@pytest.fixture(scope="module")
def team():
    if not have_root_runtime():
        pytest.skip("needs root and the sandbox runtime")
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), _Peer)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    port = free_port()
    peers = {"evil": f"http://127.0.0.1:{server.server_address[1]}",
             "self": f"http://127.0.0.1:{port}"}
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("CORRAL_PEERS", json.dumps(peers))
        d = Daemon(_base_dir(), ["--tcp", f"127.0.0.1:{port}", "--token", ADMIN_TOKEN])
        d.start()
    t = Team(d, port)
    try:
        t.make_token("alice")
        t.make_token("bob")
        yield t
        no_traceback(t)
    finally:
        d.stop()
        server.shutdown()
        server.server_close()


def _tree(base: Path, text: bytes) -> tuple[Path, dict]:
    """A volume's tree and its content as a home describes it."""
    root = base / "tree"
    (root / "rows").mkdir(parents=True)
    (root / "rows" / "a.csv").write_bytes(text)
    (root / "README").write_text("the dataset\n")
    os.chmod(root, 0o755)
    digest, size = tree_digest(root, root_form=True)
    return root, {"digest": digest, "size_bytes": size}


def _described(name: str, content: dict, **extra) -> dict:
    return {"name": name, "size_bytes": content["size_bytes"], "files": 3,
            "created_at": time.time(), "max_mb": None, "home": None, "content": content,
            **extra}


def _left(team: Team, owner: str) -> list[str]:
    base = team.daemon.state_dir / "volumes" / owner
    return sorted(os.listdir(base)) if base.is_dir() else []


def _fetch(client, volume: str, node: str):
    return client.post("/v1/cluster/volumes/fetch", json={"volume": volume, "node": node})


def test_a_copy_mounts_is_never_written_rw_and_follows_its_home_when_unused(team, tmp_path):
    root, content = _tree(tmp_path / "v1", b"1,2,3\n")
    _Peer.description, _Peer.layer = _described("ds", content), b"".join(
        layer_wire.stream(root, root_form=True))
    with team.tenant("bob") as bob, team.tenant("alice") as alice:
        r = _fetch(bob, "ds", "evil")
        assert r.status_code == 200, r.text
        assert (r.json()["home"], r.json()["name"]) == ("evil", "ds")
        _Peer.asked.clear()
        assert _fetch(bob, "ds", "evil").status_code == 200  # the same version: kept
        assert not any("/v1/peer/layers/" in p for p in _Peer.asked)
        assert alice.get("/v1/volumes/ds").status_code == 404  # bob's copy, not hers
        sb = bob.post("/v1/sandboxes", json={"memory_mb": 64, "volumes": {"/data": "ds"}})
        assert sb.status_code == 201, sb.text
        sid = sb.json()["id"]
        read = bob.post(f"/v1/sandboxes/{sid}/exec", json={"cmd": ["cat", "/data/rows/a.csv"]})
        assert read.json()["stdout"] == "1,2,3\n", read.text
        rw = bob.post("/v1/sandboxes", json={"memory_mb": 64, "volumes": {"/data": "ds:rw"}})
        assert rw.status_code == 409 and rw.json()["error"]["code"] == "invalid_state", rw.text
        assert "copy" in rw.json()["error"]["message"]
        # the home changes: a copy in use is kept, an unused one is fetched again
        root2, content2 = _tree(tmp_path / "v2", b"4,5,6\n")
        _Peer.description, _Peer.layer = _described("ds", content2), b"".join(
            layer_wire.stream(root2, root_form=True))
        assert _fetch(bob, "ds", "evil").status_code == 200
        again = bob.post(f"/v1/sandboxes/{sid}/exec", json={"cmd": ["cat", "/data/rows/a.csv"]})
        assert again.json()["stdout"] == "1,2,3\n"
        assert bob.delete(f"/v1/sandboxes/{sid}").status_code == 204
        assert _fetch(bob, "ds", "evil").status_code == 200
        sb = bob.post("/v1/sandboxes", json={"memory_mb": 64, "volumes": {"/data": "ds:ro"}})
        sid = sb.json()["id"]
        now = bob.post(f"/v1/sandboxes/{sid}/exec", json={"cmd": ["cat", "/data/rows/a.csv"]})
        assert now.json()["stdout"] == "4,5,6\n", now.text
        bob.delete(f"/v1/sandboxes/{sid}")
        assert bob.delete("/v1/volumes/ds").status_code == 204
    assert _left(team, "bob") == []


def test_a_tenant_cannot_pull_another_tenants_volume_by_name_or_digest(team):
    with team.tenant("alice") as alice:
        r = alice.post("/v1/volumes?name=secret", content=_context_tar({"key": b"alice's key\n"}))
        assert r.status_code == 201, r.text
    with team.tcp(ADMIN_TOKEN) as admin:  # a peer's description makes it servable by digest
        desc = admin.get("/v1/peer/volumes/secret?owner=alice")
        assert desc.status_code == 200, desc.text
        digest = desc.json()["content"]["digest"]
        assert admin.get("/v1/peer/volumes/secret?owner=bob").status_code == 404
        assert admin.get("/v1/peer/volumes/secret").status_code == 404  # not the admin's
        for owner in ("../alice", "alice/..", "_admin", ".", "ALICE"):  # a path, never
            r = admin.get("/v1/peer/volumes/secret", params={"owner": owner})
            assert r.status_code == 400, (owner, r.text)
    with team.tenant("bob") as bob:
        r = _fetch(bob, "secret", "self")  # the honest holder, asked as bob
        assert r.status_code == 404 and r.json()["error"]["code"] == "volume_not_found", r.text
        assert bob.get("/v1/peer/volumes/secret?owner=alice").status_code == 403
        assert bob.get(f"/v1/peer/layers/{digest}").status_code == 403
        # a peer answers bob with alice's digest: the stream must hash to it, and the
        # daemon never takes alice's tree from its own disk for it
        _Peer.description = _described("mine", {"digest": digest, "size_bytes": 4096})
        _Peer.layer = _tar([("./key", tarfile.REGTYPE, {"size": 0})])
        r = _fetch(bob, "mine", "evil")
        assert r.json()["error"]["code"] == "layer_transfer_failed", r.text
        # a peer that answers with another volume's name
        _Peer.description = _described("secret", {"digest": digest, "size_bytes": 4096})
        r = _fetch(bob, "mine", "evil")
        assert r.json()["error"]["code"] == "layer_transfer_failed", r.text
        assert bob.get("/v1/volumes/mine").status_code == 404
        assert bob.get("/v1/volumes/secret").status_code == 404
    assert _left(team, "bob") == []


@pytest.mark.parametrize("name", ["../alice/secret", "..", "a/b", "/etc", "%2e%2e", "x" * 64,
                                  "Secret", ".hidden"])
def test_volume_names_that_are_paths_are_refused(team, name):
    _Peer.asked.clear()
    with team.tenant("bob") as bob:
        r = _fetch(bob, name, "evil")
        assert r.status_code == 400 and r.json()["error"]["code"] == "invalid_argument", r.text
    assert _Peer.asked == []  # refused before any peer was asked
    with team.tcp(ADMIN_TOKEN) as admin:
        assert admin.get(f"/v1/peer/volumes/{name.replace('/', '%2F')}").status_code in (400, 404)
    assert _left(team, "bob") == []


def test_a_capped_volume_travels_as_a_filesystem_of_its_size(team):
    """A volume with max_mb (an ext4 image at home) described and streamed by its real
    home, received as a copy that is again a filesystem of that size."""
    with team.tenant("alice") as alice:
        r = alice.post("/v1/volumes?name=capped&max_mb=8",
                       content=_context_tar({"w.bin": os.urandom(300_000)}))
        assert r.status_code == 201, r.text
    with team.tcp(ADMIN_TOKEN) as admin:
        desc = admin.get("/v1/peer/volumes/capped?owner=alice").raise_for_status().json()
        layer = admin.get(f"/v1/peer/layers/{desc['content']['digest']}").raise_for_status()
    _Peer.description, _Peer.layer = desc, layer.content  # evil relays the home's answer
    with team.tenant("bob") as bob:
        r = _fetch(bob, "capped", "evil")
        assert r.status_code == 200, r.text
        assert (r.json()["max_mb"], r.json()["home"]) == (8, "evil")
        sb = bob.post("/v1/sandboxes", json={"memory_mb": 64, "volumes": {"/d": "capped"}})
        sid = sb.json()["id"]
        out = bob.post(f"/v1/sandboxes/{sid}/exec", json={"cmd": ["wc", "-c", "/d/w.bin"]})
        assert out.json()["stdout"].split()[0] == "300000", out.text
        copy = team.daemon.state_dir / "volumes" / "bob" / "capped"
        assert (copy / "volume.img").stat().st_size == 8 << 20
        assert os.path.ismount(copy / "data")
        bob.delete(f"/v1/sandboxes/{sid}")
        assert bob.delete("/v1/volumes/capped").status_code == 204
    assert _left(team, "bob") == []
