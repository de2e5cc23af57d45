"""A root image fetched from a peer is hostile data until its content digest says otherwise.

A root image's tree crosses the network in its travelling form (no device nodes, no
setuid/setgid bits, no xattrs but ``user.*``: :mod:`corral.runtime.root_travel`), so a
received root is refused outright if it carries any of them, on top of every check a
layer gets (paths, links, length, digest). Each attack ends in a typed error with
nothing left: no image, no temporary tree, no file outside the store. And the route
that serves roots reads only the root images this daemon described, by digest, to
the admin (the cluster): never a host path, never for a tenant.
"""

from __future__ import annotations

import http.server
import io
import json
import os
import shutil
import stat
import subprocess
import tarfile
import threading
from pathlib import Path

import httpx
import pytest

from corral.errors import LayerTransferError
from corral.runtime import layer_wire
from corral.runtime.layers import LayerStore, tree_digest
from corral.runtime.paths import default_cache_dir
from tests.conftest import requires_root
from tests.security.tenants_helpers import ADMIN_TOKEN, team_daemon
from tests.security.test_layer_transfer import _tar

pytestmark = requires_root  # root owners, device nodes and trusted xattrs need root


@pytest.fixture
def store(tmp_path):
    s = LayerStore(tmp_path / "store")
    s.open([])
    return s


def _rootfs(base: Path) -> Path:
    """A small root filesystem with what a real one has: a setuid root binary, device
    nodes, a user xattr, and a trusted one."""
    root = base / "rootfs"
    (root / "usr/bin").mkdir(parents=True)
    (root / "dev").mkdir()
    (root / "usr/bin/passwd").write_bytes(b"\x7fELF" + b"x" * 5000)
    os.chmod(root / "usr/bin/passwd", 0o4755)
    os.mknod(root / "dev/null", 0o666 | stat.S_IFCHR, os.makedev(1, 3))
    (root / "etc").mkdir()
    (root / "etc/hostname").write_text("sandbox\n")
    os.setxattr(root / "etc/hostname", "user.note", b"kept")
    os.setxattr(root / "etc", "trusted.overlay.opaque", b"y")
    os.symlink("/etc/hostname", root / "hn")
    os.chmod(root, 0o755)
    return root


def _left(store: LayerStore) -> list[str]:
    return sorted(os.listdir(store.root))


def test_a_root_travels_without_devices_setuid_bits_or_foreign_xattrs(store, tmp_path):
    root = _rootfs(tmp_path)
    digest, _ = tree_digest(root, root_form=True)
    assert digest != tree_digest(root)[0]
    sealed, received = layer_wire.receive_tree(
        store, digest, layer_wire.stream(root, root_form=True), max_bytes=1 << 20,
        root_form=True)
    tree = sealed.tmp / "tree"
    assert sealed.digest == digest and received > 5000
    assert not (tree / "dev/null").exists()
    assert stat.S_IMODE(os.stat(tree / "usr/bin/passwd").st_mode) == 0o755
    assert (tree / "usr/bin/passwd").read_bytes() == (root / "usr/bin/passwd").read_bytes()
    assert os.getxattr(tree / "etc/hostname", "user.note") == b"kept"
    assert "trusted.overlay.opaque" not in os.listxattr(tree / "etc")
    assert os.readlink(tree / "hn") == "/etc/hostname"
    assert tree_digest(tree)[0] == digest  # the received tree is its own travelling form
    store.discard(sealed.tmp)


DIGEST = "sha256:" + "cd" * 32
_X = {"data": b"x"}


@pytest.mark.parametrize(("entries", "why"), [
    ([("./su", tarfile.REGTYPE, {**_X, "mode": 0o4755, "uid": 0})], "setuid"),
    ([("./sg", tarfile.REGTYPE, {**_X, "mode": 0o2755, "gid": 0})], "setuid/setgid"),
    ([("./d", tarfile.DIRTYPE, {"mode": 0o4755})], "setuid"),
    ([("./null", tarfile.CHRTYPE, {"devmajor": 1, "devminor": 3})], "device node"),
    ([("./wh", tarfile.CHRTYPE, {"devmajor": 0, "devminor": 0})], "device node"),
    ([("./sda", tarfile.BLKTYPE, {"devmajor": 8, "devminor": 0})], "device node"),
    ([("./o", tarfile.DIRTYPE, {"pax_headers": {
        "CORRAL.xattr.trusted.overlay.opaque": b"y".hex()}})], "extended attribute"),
    ([("./r", tarfile.DIRTYPE, {"pax_headers": {
        "CORRAL.xattr.trusted.overlay.redirect": b"/etc".hex()}})], "extended attribute"),
    ([("./cap", tarfile.REGTYPE, {**_X, "pax_headers": {
        "CORRAL.xattr.security.capability": b"\x01".hex()}})], "extended attribute"),
    ([("./../escape", tarfile.REGTYPE, _X)], "plain relative path"),
    ([("./s", tarfile.SYMTYPE, {"linkname": "/etc"}), ("./s/passwd", tarfile.REGTYPE, _X)],
     "not inside a directory"),
    ([("./h", tarfile.LNKTYPE, {"linkname": "/etc/shadow"})], "hard-links"),
    ([("./h", tarfile.LNKTYPE, {"linkname": "./../../etc/shadow"})], "hard-links"),
])
def test_an_unsafe_root_is_refused_and_nothing_is_left(store, tmp_path, entries, why):
    outside = sorted(os.listdir(tmp_path))
    with pytest.raises(LayerTransferError, match=why):
        layer_wire.receive_tree(store, DIGEST, [_tar(entries)], max_bytes=1 << 20,
                                root_form=True)
    assert _left(store) == [] and sorted(os.listdir(tmp_path)) == outside
    assert not Path("/escape").exists()


def test_a_root_that_does_not_hash_to_its_digest_or_runs_on_is_refused(store, tmp_path):
    root = _rootfs(tmp_path)
    digest, _ = tree_digest(root, root_form=True)
    data = b"".join(layer_wire.stream(root, root_form=True))
    with pytest.raises(LayerTransferError, match="hash to"):
        layer_wire.receive_tree(store, digest, [data.replace(b"sandbox", b"SANDBOX", 1)],
                                max_bytes=1 << 20, root_form=True)
    with pytest.raises(LayerTransferError, match="more than"):
        layer_wire.receive_tree(store, digest, [data, b"\0" * (1 << 20)] * 4,
                                max_bytes=len(data) + 4096, root_form=True)
    assert _left(store) == []


# ------------------------------------------------ a hostile peer, against a real daemon


class _Peer(http.server.BaseHTTPRequestHandler):
    """A fake daemon: ``description`` for any description it is asked, ``layer`` for
    any layer; the paths it was asked kept in ``asked``."""

    description: dict = {}
    layer = b""
    asked: list[str] = []

    def do_GET(self):  # noqa: N802
        type(self).asked.append(self.path)
        body = (self.layer if self.path.startswith("/v1/peer/layers/")
                else json.dumps(self.description).encode())
        self.send_response(200)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, *args):
        pass


@pytest.fixture
def hostile(monkeypatch, tmp_path_factory):
    """A daemon with an image cache of its own (the default image hard-linked in), and
    a hostile peer it knows as node ``evil``."""
    if not (default_cache_dir() / "images" / "python").is_dir():
        pytest.skip("needs the default image (python -m corral.runtime.prepare)")
    cache = tmp_path_factory.mktemp("cache")
    os.chmod(cache, 0o711)
    (cache / "images").mkdir()
    for part in ("bin", "share", "images/python"):
        subprocess.run(["cp", "-al", str(default_cache_dir() / part), str(cache / part)],
                       check=True)
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), _Peer)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    monkeypatch.setenv("CORRAL_PEERS", json.dumps(
        {"evil": f"http://127.0.0.1:{server.server_address[1]}"}))
    try:
        with team_daemon("--cache-dir", str(cache)) as team:
            team.images_dir = cache / "images"
            yield team
    finally:
        server.shutdown()
        server.server_close()
        shutil.rmtree(cache, ignore_errors=True)


def _debris(images_dir: Path) -> list[str]:
    found = [n for n in os.listdir(images_dir) if n.startswith((".tmp-", "evil", "root-"))]
    layers = images_dir / ".layers"
    return found + (os.listdir(layers) if layers.is_dir() else [])


@pytest.mark.parametrize("attack", ["mismatch", "device", "setuid", "xattr"])
def test_a_hostile_peer_cannot_plant_a_root_image(hostile, tmp_path, attack):
    team = hostile
    root = _rootfs(tmp_path)
    digest, size = tree_digest(root, root_form=True)
    entries = {
        "device": [("./sda", tarfile.BLKTYPE, {"devmajor": 8, "devminor": 0})],
        "setuid": [("./su", tarfile.REGTYPE, {**_X, "mode": 0o4755, "uid": 0})],
        "xattr": [("./o", tarfile.DIRTYPE, {"pax_headers": {
            "CORRAL.xattr.trusted.overlay.redirect": b"/".hex()}})],
    }.get(attack)
    _Peer.layer = (_tar(entries) if entries else
                   b"".join(layer_wire.stream(root, root_form=True)).replace(b"ELF", b"ELV", 1))
    for kind in ("rootfs", "built"):  # pulled by name; a built one's root
        name = f"evil-{kind}"
        meta = {"kind": "rootfs", "digest": DIGEST, "env": {}, "workdir": None}
        _Peer.description = ({"name": name, **meta, "content": {"digest": digest,
                                                               "size_bytes": size}}
                             if kind == "rootfs" else
                             {"name": name, "digest": DIGEST, "root": {"image": "python",
                              "digest": DIGEST}, "root_meta": meta,
                              "root_content": {"digest": digest, "size_bytes": size},
                              "layers": [{"id": "cd" * 8, "digest": DIGEST, "size_bytes": 1}]})
        with team.tcp(ADMIN_TOKEN) as http_:
            r = http_.post("/v1/peer/images/fetch", json={"image": name, "node": "evil"})
        assert r.status_code >= 400, r.text
        assert r.json()["error"]["code"] == "layer_transfer_failed", r.text
        images_dir = team.images_dir
        assert _debris(images_dir) == [], (attack, kind)
        with team.admin() as c:
            assert name not in [i["name"] for i in c.get("/v1/images").json()["images"]]


def test_the_root_route_reads_no_host_path_and_serves_no_tenant(hostile):
    team = hostile
    with team.tcp(ADMIN_TOKEN) as admin:  # describing python makes its root servable
        desc = admin.get("/v1/peer/images/python").json()
        digest = desc["content"]["digest"]
        with admin.stream("GET", f"/v1/peer/layers/{digest}") as r:
            assert r.status_code == 200
            head = next(r.iter_raw())
        assert tarfile.open(fileobj=io.BytesIO(head + b"\0" * 20480), mode="r|").next().name == "."
        for bad in ("etc%2Fpasswd", "..%2F..%2Fetc%2Fshadow", "sha256:" + "0" * 64,
                    "sha256:" + digest[7:].upper()):
            assert admin.get(f"/v1/peer/layers/{bad}").status_code in (400, 404), bad
    with team.tenant("alice") as alice:  # a tenant reads no root, nor a description
        assert alice.get(f"/v1/peer/layers/{digest}").status_code == 403
        assert alice.get("/v1/peer/images/python").status_code == 403
    assert httpx.get(team.url + f"/v1/peer/layers/{digest}").status_code == 401
