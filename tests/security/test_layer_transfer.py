"""A layer fetched from a peer daemon is hostile data until its digest says otherwise.

A peer (or any TCP client holding the cluster's token and posing as one) may serve a
layer whose bytes do not match its digest, cut the stream short, or craft a tar that
climbs out with ``..``, absolute names, symlinked parents or hard links, makes device
nodes, sets overlay xattrs, or is larger than the disk. Each must end in a typed error
with nothing left behind: no temporary tree, no layer, no file outside the store.
"""

from __future__ import annotations

import http.server
import io
import os
import tarfile
import threading
from pathlib import Path

import pytest

from corral.errors import InvalidArgument, LayerTransferError, StorageFull
from corral.runtime import layer_wire
from corral.runtime.layers import LayerStore
from corral.server.peer_layers import Peer
from tests.conftest import requires_root

pytestmark = requires_root  # owners, whiteouts and trusted xattrs need root


@pytest.fixture
def stores(tmp_path):
    src, dst = LayerStore(tmp_path / "src"), LayerStore(tmp_path / "dst")
    src.open([])
    dst.open([])
    return src, dst


def _layer(src: LayerStore):
    tmp = src.new_tmp()
    tree = tmp / "tree"
    (tree / "d").mkdir(parents=True)
    (tree / "d" / "f").write_bytes(b"the right bytes" * 1000)
    os.symlink("f", tree / "d" / "link")
    os.mknod(tree / "gone", 0o600 | 0o020000, os.makedev(0, 0))  # a whiteout
    os.setxattr(tree / "d", "trusted.overlay.opaque", b"y")
    layer, _ = src.install(src.seal(tmp))
    return layer


def _left(store: LayerStore) -> list[str]:
    return sorted(os.listdir(store.root))


def _tar(entries) -> bytes:
    """A stream of hand-made entries: ``(name, type, extra)`` after a valid root."""
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w", format=tarfile.PAX_FORMAT) as tar:
        root = tarfile.TarInfo(".")
        root.type, root.mode = tarfile.DIRTYPE, 0o755
        tar.addfile(root)
        for name, kind, extra in entries:
            m = tarfile.TarInfo(name)
            m.type = kind
            data = None
            for k, v in extra.items():
                if k == "data":
                    data, m.size = io.BytesIO(v), len(v)
                else:
                    setattr(m, k, v)
            tar.addfile(m, data)
    return buf.getvalue()


def test_a_faithful_stream_round_trips(stores):
    src, dst = stores
    layer = _layer(src)
    got, received = layer_wire.receive(dst, layer.digest, layer_wire.stream(layer.path),
                                       max_bytes=1 << 20)
    assert got.digest == layer.digest and received > 15000
    assert os.readlink(got.path / "d" / "link") == "f"


def test_bytes_that_do_not_match_the_digest_are_refused_and_deleted(stores):
    src, dst = stores
    layer = _layer(src)
    data = b"".join(layer_wire.stream(layer.path)).replace(b"the right", b"THE WRONG", 1)
    with pytest.raises(LayerTransferError, match="hash to"):
        layer_wire.receive(dst, layer.digest, [data], max_bytes=1 << 20)
    assert _left(dst) == []


@pytest.mark.parametrize("cut", [100, 1000, 3000, -1100])
def test_a_truncated_stream_is_refused(stores, cut):
    src, dst = stores
    layer = _layer(src)
    data = b"".join(layer_wire.stream(layer.path))
    with pytest.raises(LayerTransferError):
        layer_wire.receive(dst, layer.digest, [data[:cut]], max_bytes=1 << 20)
    assert _left(dst) == []


DIGEST = "sha256:" + "ab" * 32


@pytest.mark.parametrize(("entries", "why"), [
    ([("./../escape", tarfile.REGTYPE, {"data": b"x"})], "plain relative path"),
    (["/etc/evil", tarfile.REGTYPE, {"data": b"x"}], None),
    ([("./a/../../escape", tarfile.REGTYPE, {"data": b"x"})], "plain relative path"),
    ([("./s", tarfile.SYMTYPE, {"linkname": "/tmp"}),
      ("./s/evil", tarfile.REGTYPE, {"data": b"x"})], "not inside a directory"),
    ([("./h", tarfile.LNKTYPE, {"linkname": "/etc/passwd"})], "hard-links"),
    ([("./h", tarfile.LNKTYPE, {"linkname": "./../../etc/passwd"})], "hard-links"),
    ([("./null", tarfile.CHRTYPE, {"devmajor": 1, "devminor": 3})], "device node"),
    ([("./sda", tarfile.BLKTYPE, {"devmajor": 8, "devminor": 0})], "device node"),
    ([("./f", tarfile.REGTYPE, {"data": b"x"}), ("./f", tarfile.REGTYPE, {"data": b"y"})],
     "twice"),
    ([("./r", tarfile.DIRTYPE, {"pax_headers": {
        "CORRAL.xattr.trusted.overlay.redirect": b"/etc".hex()}})], "extended attribute"),
    ([("./f", tarfile.REGTYPE, {"data": b"x", "pax_headers": {
        "CORRAL.extents": "0:1", "CORRAL.size": str(1 << 60)}})], "extents"),
])
def test_unsafe_entries_are_refused_and_nothing_is_written(stores, tmp_path, entries, why):
    _, dst = stores
    if isinstance(entries[0], str):  # an absolute name: tarfile strips nothing on write
        entries = [tuple(entries)]
    outside = sorted(os.listdir(tmp_path))
    with pytest.raises(LayerTransferError, match=why or "plain relative path"):
        layer_wire.receive(dst, DIGEST, [_tar(entries)], max_bytes=1 << 20)
    assert _left(dst) == []
    assert sorted(os.listdir(tmp_path)) == outside
    assert not Path("/escape").exists()


def test_a_stream_without_its_root_first_is_refused(stores):
    _, dst = stores
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w", format=tarfile.PAX_FORMAT) as tar:
        tar.addfile(tarfile.TarInfo("./f"), io.BytesIO(b""))
    with pytest.raises(LayerTransferError, match="root directory"):
        layer_wire.receive(dst, DIGEST, [buf.getvalue()], max_bytes=1 << 20)
    assert _left(dst) == []


@pytest.mark.parametrize("digest", ["../../etc/passwd", "/etc/passwd", "sha256:../x",
                                    "sha256:" + "A" * 64, "sha256:" + "a" * 63, 7])
def test_a_digest_that_is_a_path_is_refused(stores, digest):
    _, dst = stores
    with pytest.raises(InvalidArgument, match="not a layer digest"):
        layer_wire.receive(dst, digest, [b""], max_bytes=1 << 20)  # type: ignore[arg-type]
    assert _left(dst) == []


def test_a_layer_larger_than_the_free_space_is_refused_before_any_byte(stores):
    src, dst = stores
    layer = _layer(src)
    vfs = os.statvfs(dst.root)
    pulled = []

    def chunks():
        pulled.append(1)
        yield from layer_wire.stream(layer.path)

    with pytest.raises(StorageFull, match="free"):
        layer_wire.receive(dst, layer.digest, chunks(), max_bytes=1 << 62,
                           need_bytes=vfs.f_bavail * vfs.f_frsize)
    assert pulled == [] and _left(dst) == []


def test_a_stream_longer_than_its_bound_is_cut_off(stores):
    src, dst = stores
    layer = _layer(src)
    endless = iter(lambda: b"\0" * 65536, None)  # zero blocks forever
    with pytest.raises(LayerTransferError, match="more than"):
        layer_wire.receive(dst, layer.digest, layer_wire.stream(layer.path), max_bytes=4096)
    with pytest.raises(LayerTransferError):
        layer_wire.receive(dst, layer.digest, endless, max_bytes=1 << 20)
    assert _left(dst) == []


class _Hostile(http.server.BaseHTTPRequestHandler):
    body = b""
    claimed = 0

    def do_GET(self):  # noqa: N802
        self.send_response(200)
        self.send_header("Content-Length", str(self.claimed or len(self.body)))
        self.end_headers()
        self.wfile.write(self.body)

    def log_message(self, *args):
        pass


@pytest.fixture
def hostile_peer():
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), _Hostile)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    yield server
    server.shutdown()
    server.server_close()


@pytest.mark.parametrize("mode", ["corrupt", "cut"])
def test_a_hostile_peer_over_http(stores, hostile_peer, mode):
    src, dst = stores
    layer = _layer(src)
    data = b"".join(layer_wire.stream(layer.path))
    _Hostile.body = data.replace(b"the right", b"THE WRONG", 1) if mode == "corrupt" else data[:5000]
    _Hostile.claimed = 0 if mode == "corrupt" else len(data)  # says more than it sends
    peer = Peer(f"http://127.0.0.1:{hostile_peer.server_address[1]}", "token")
    with pytest.raises(LayerTransferError, match="hash to" if mode == "corrupt" else "broke off"):
        with peer.open_layer(layer.digest, layer.size_bytes) as chunks:
            layer_wire.receive(dst, layer.digest, chunks, max_bytes=1 << 20)
    assert _left(dst) == []
