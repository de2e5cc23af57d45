"""A hostile registry (a server on 127.0.0.1 that answers whatever the test wants):
huge manifests, layers that expand past the limit, paths and links that climb out of
the layer, set-id root files, device nodes, blobs that are not what their digest says,
redirects that would carry credentials elsewhere. Each pull fails typed (or stores a
harmless layer), and a failed one leaves no image, layer, temporary dir or blob."""

from __future__ import annotations

import gzip
import hashlib
import io
import json
import os
import secrets
import stat
import tarfile
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import pytest

from corral.errors import ImageImportError, RegistryError
from corral.runtime import image_cache
from corral.runtime.image_pull import BLOBS, SCRATCH, local_name, pull_image
from corral.runtime.images import ImageStore
from corral.runtime.treecopy import remove_tree
from tests.conftest import requires_root
from tests.runtime.oci_archives import DEEP, Layer, deep_layer
from tests.runtime.registries import write_auth_file

pytestmark = [requires_root, pytest.mark.root, pytest.mark.timeout(120)]


def digest(data: bytes) -> str:
    return "sha256:" + hashlib.sha256(data).hexdigest()


class Hostile:
    """Serves ``routes[path] = (status, headers, body)``; records each request's headers."""

    def __init__(self) -> None:
        self.routes: dict[str, tuple[int, dict[str, str], bytes]] = {}
        self.seen: list[tuple[str, dict[str, str]]] = []
        hostile = self

        class Handler(BaseHTTPRequestHandler):
            def do_GET(self) -> None:  # noqa: N802
                hostile.seen.append((self.path, dict(self.headers)))
                status, headers, body = hostile.routes.get(self.path, (404, {}, b"{}"))
                self.send_response(status)
                for k, v in headers.items():
                    self.send_header(k, v)
                if "Content-Length" not in headers:
                    self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                try:
                    self.wfile.write(body)
                except OSError:
                    pass

            def log_message(self, *args: object) -> None:
                pass

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.host = f"127.0.0.1:{self.server.server_address[1]}"
        threading.Thread(target=self.server.serve_forever, daemon=True).start()

    def image(self, repo: str, layers: list[bytes], *, gz: bool = True,
              diff_ids: list[str] | None = None) -> str:
        """Serve an image of ``layers`` (plain tars) at ``repo:v1``; its reference."""
        stored = [gzip.compress(x, mtime=0) if gz else x for x in layers]
        config = json.dumps({"architecture": "amd64", "os": "linux", "config": {},
                             "rootfs": {"type": "layers", "diff_ids": diff_ids or [
                                 digest(x) for x in layers]}}).encode()
        manifest = json.dumps({
            "schemaVersion": 2, "mediaType": "application/vnd.oci.image.manifest.v1+json",
            "config": {"mediaType": "application/vnd.oci.image.config.v1+json",
                       "digest": digest(config), "size": len(config)},
            "layers": [{"mediaType": "application/vnd.oci.image.layer.v1.tar+gzip",
                        "digest": digest(x), "size": len(x)} for x in stored]}).encode()
        self.routes[f"/v2/{repo}/manifests/v1"] = (
            200, {"Content-Type": "application/vnd.oci.image.manifest.v1+json"}, manifest)
        for blob in (config, *stored):
            self.routes[f"/v2/{repo}/blobs/{digest(blob)}"] = (200, {}, blob)
        return f"{self.host}/{repo}:v1"

    def stop(self) -> None:
        self.server.shutdown()
        self.server.server_close()


@pytest.fixture
def hostile():
    h = Hostile()
    yield h
    h.stop()


@pytest.fixture
def store(tmp_path) -> ImageStore:
    return ImageStore(tmp_path / "images")


def left_behind(store: ImageStore) -> list[str]:
    """What a failed pull must not leave: images (the empty root aside), layers,
    temporary dirs, blobs."""
    root = store.images_dir
    found = [n for n in os.listdir(root) if not n.startswith(".") and n != SCRATCH]
    found += [n for n in os.listdir(root) if n.startswith(".tmp-")]
    layers = root / image_cache.LAYERS
    if layers.exists():
        found += [f".layers/{n}" for n in os.listdir(layers)]
    if (root / BLOBS).exists():
        found += [f".blobs/{n}" for n in os.listdir(root / BLOBS)]
    return found


def tar(*members: tarfile.TarInfo, data: dict[str, bytes] | None = None) -> bytes:
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w", format=tarfile.PAX_FORMAT) as t:
        for m in members:
            body = (data or {}).get(m.name)
            if body is not None:
                m.size = len(body)
            t.addfile(m, io.BytesIO(body) if body is not None else None)
    return buf.getvalue()


def member(name: str, kind: bytes = tarfile.REGTYPE, **attrs: object) -> tarfile.TarInfo:
    m = tarfile.TarInfo(name)
    m.type = kind
    for k, v in attrs.items():
        setattr(m, k, v)
    return m


def test_huge_manifest_is_refused(hostile, store):
    huge = b'{"layers": [' + b" " * (5 << 20) + b"]}"
    hostile.routes["/v2/big/manifests/v1"] = (200, {}, huge)
    with pytest.raises(RegistryError, match="limit"):
        pull_image(store, f"{hostile.host}/big:v1")
    # without a Content-Length (chunked, or a lying server): cut off at the cap all the same
    hostile.routes["/v2/big/manifests/v2"] = (200, {"Content-Length": "10"}, huge)
    with pytest.raises(RegistryError):
        pull_image(store, f"{hostile.host}/big:v2")
    assert left_behind(store) == []


def test_layer_expanding_past_the_limit_is_refused(hostile, store):
    bomb = tar(member("zeros"), data={"zeros": bytes(48 << 20)})  # ~48 KB gzipped
    ref = hostile.image("bomb", [bomb])
    with pytest.raises(ImageImportError, match="expands past"):
        pull_image(store, ref, max_bytes=8 << 20)
    assert left_behind(store) == []


@pytest.mark.parametrize("entries,message", [
    ([member("../../evil")], "climbs out"),
    ([member("/etc/evil")], "absolute path"),
    ([member("a", tarfile.SYMTYPE, linkname="../../../..")], "outside the root"),
    ([member("h", tarfile.LNKTYPE, linkname="/etc/passwd")], "absolute path"),
    ([member("h", tarfile.LNKTYPE, linkname="../etc/passwd")], "climbs out"),
    ([member("etc/.wh..")], "names no file"),
])
def test_paths_out_of_the_layer_are_refused(hostile, store, entries, message):
    ref = hostile.image(f"t{secrets.token_hex(3)}", [tar(*entries)])
    with pytest.raises(ImageImportError, match=message):
        pull_image(store, ref)
    assert left_behind(store) == []
    assert not Path("/evil").exists() and not Path("/etc/evil").exists()


def test_absolute_links_stay_inside_the_layer(hostile, store, tmp_path):
    outside = tmp_path / "outside"
    outside.mkdir()
    layer = tar(member("x", tarfile.SYMTYPE, linkname=str(outside)),
                member("x/planted"), member("etc/hostlink", tarfile.SYMTYPE,
                                              linkname="/etc/shadow"),
                data={"x/planted": b"written through an absolute link\n"})
    image = pull_image(store, hostile.image("links", [layer]))
    assert not (outside / "planted").exists()  # followed as the sandbox would: inside
    tree = image_cache.layer_store(store.images_dir).path(image.layer_ids[0])
    assert (tree / outside.relative_to("/") / "planted").read_bytes().startswith(b"written")
    assert os.readlink(tree / "etc/hostlink") == "/etc/shadow"  # a link, never followed here


def test_setuid_files_device_nodes_and_xattrs_are_dropped(hostile, store):
    layer = tar(member("usr/bin/su", mode=0o4755, uid=0),
                member("usr/bin/wall", mode=0o2755, gid=5),
                member("dev/sda", tarfile.BLKTYPE, devmajor=8, devminor=0),
                member("dev/mem", tarfile.CHRTYPE, devmajor=1, devminor=1),
                member("usr/bin/cap", pax_headers={
                    "SCHILY.xattr.security.capability": "\x01\x00\x00\x02" + "\xff" * 16}),
                data={"usr/bin/su": b"#!/bin/sh\n", "usr/bin/wall": b"", "usr/bin/cap": b""})
    image = pull_image(store, hostile.image("priv", [layer]))
    tree = image_cache.layer_store(store.images_dir).path(image.layer_ids[0])
    for name in ("usr/bin/su", "usr/bin/wall"):
        assert not os.stat(tree / name).st_mode & (stat.S_ISUID | stat.S_ISGID), name
    assert not (tree / "dev/sda").exists() and not (tree / "dev/mem").exists()
    assert os.listxattr(tree / "usr/bin/cap") == []


def test_blobs_that_lie_are_refused(hostile, store):
    good = Layer().file("a.txt", b"a\n").bytes()
    ref = hostile.image("lie", [good])
    blob_path = next(p for p in hostile.routes if "/blobs/" in p
                     and hostile.routes[p][2] == gzip.compress(good, mtime=0))
    status, headers, blob = hostile.routes[blob_path]
    hostile.routes[blob_path] = (status, headers, blob + b"trailing bytes")  # longer
    with pytest.raises(ImageImportError, match="longer than"):
        pull_image(store, ref)
    hostile.routes[blob_path] = (status, headers, blob[:-4] + b"xxxx")  # altered
    with pytest.raises(ImageImportError, match="does not match its digest"):
        pull_image(store, ref)
    # the right blob, but a config whose diff_id says another tar
    ref2 = hostile.image("diffid", [good], diff_ids=[digest(b"other")])
    with pytest.raises(ImageImportError, match="diff_id"):
        pull_image(store, ref2)
    assert left_behind(store) == []


def test_manifest_by_digest_must_hash_to_it(hostile, store):
    hostile.image("pinned", [Layer().file("a", b"a").bytes()])
    body = hostile.routes["/v2/pinned/manifests/v1"][2]
    wrong = digest(b"not this manifest")
    hostile.routes[f"/v2/pinned/manifests/{wrong}"] = (200, {}, body)
    with pytest.raises(ImageImportError, match="hashes to"):
        pull_image(store, f"{hostile.host}/pinned@{wrong}")
    assert left_behind(store) == []


def test_credentials_never_follow_a_redirect(hostile, store, tmp_path, monkeypatch):
    elsewhere = Hostile()
    try:
        layer = Layer().file("a", b"a").bytes()
        ref = hostile.image("redir", [layer])
        for path in [p for p in hostile.routes if "/blobs/" in p]:
            elsewhere.routes[path] = hostile.routes[path]
            hostile.routes[path] = (307, {"Location": f"http://{elsewhere.host}{path}"}, b"")
        password = "pw-" + secrets.token_hex(8)
        auth = write_auth_file(tmp_path / "auth.json", hostile.host, ("u", password))
        monkeypatch.setenv("REGISTRY_AUTH_FILE", str(auth))
        unauth = hostile.routes.pop("/v2/redir/manifests/v1")
        challenged = {"n": 0}
        original = hostile.routes.get

        def manifest_route(path, default=None):  # 401 once, then the manifest
            if path == "/v2/redir/manifests/v1":
                challenged["n"] += 1
                if challenged["n"] == 1:
                    return (401, {"WWW-Authenticate": 'Basic realm="x"'}, b"")
                return unauth
            return original(path, default)

        hostile.routes = _Routes(hostile.routes, manifest_route)
        image = pull_image(store, ref)
        assert image.name == local_name(ref)
        assert any("Authorization" in h for _, h in hostile.seen)  # the registry got them
        assert elsewhere.seen and not any(
            "Authorization" in h or "authorization" in h for _, h in elsewhere.seen)
    finally:
        elsewhere.stop()


class _Routes(dict):
    def __init__(self, base: dict, getter) -> None:
        super().__init__(base)
        self._getter = getter

    def get(self, key, default=None):
        return self._getter(key, default)


def test_a_layer_1500_directories_deep_with_1000_hard_links_is_pulled(hostile, store):
    """Was a RecursionError (os.walk making the layer readable for the sandbox user)
    after a minute of unpacking (each entry's directories looked up from the root)."""
    try:
        image = pull_image(store, hostile.image("deep", [deep_layer().bytes()]))
        tree = image_cache.layer_store(store.images_dir).path(image.layer_ids[0])
        assert (tree / "x/h999").stat().st_nlink == 1001
        bottom = os.open(tree / DEEP[:2000], os.O_RDONLY | os.O_DIRECTORY)
        try:
            assert os.stat(DEEP[2000:].lstrip("/"), dir_fd=bottom).st_mode & 0o005 == 0o005
        finally:
            os.close(bottom)
    finally:
        remove_tree(store.images_dir)  # pytest's cleanup of tmp_path recurses
