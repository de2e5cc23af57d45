"""Image archives made in code for the import tests (no registry is reachable).

The base layer carries just enough of the default image's files for ``/bin/sh`` to
run (dash, cat, ln, the C library and the loader, and Debian's merged-/usr links,
``/lib64/ld-linux-x86-64.so.2`` being an absolute link through the relative ``lib``),
so an imported image really starts sandboxes.
"""

from __future__ import annotations

import gzip
import hashlib
import io
import json
import subprocess
import tarfile
from pathlib import Path

BINARIES = ("usr/bin/dash", "usr/bin/cat", "usr/bin/ln", "usr/bin/env")
LIBS = ("usr/lib/x86_64-linux-gnu/libc.so.6", "usr/lib/x86_64-linux-gnu/ld-linux-x86-64.so.2")


class Layer:
    """A layer being written: entries in order, then :meth:`bytes`."""

    def __init__(self) -> None:
        self.buf = io.BytesIO()
        self.tar = tarfile.open(fileobj=self.buf, mode="w", format=tarfile.PAX_FORMAT)

    def dir(self, name: str, mode: int = 0o755, uid: int = 0) -> Layer:
        info = tarfile.TarInfo(name)
        info.type, info.mode, info.uid, info.gid = tarfile.DIRTYPE, mode, uid, uid
        self.tar.addfile(info)
        return self

    def file(self, name: str, data: bytes = b"", mode: int = 0o644, uid: int = 0) -> Layer:
        info = tarfile.TarInfo(name)
        info.size, info.mode, info.uid, info.gid = len(data), mode, uid, uid
        self.tar.addfile(info, io.BytesIO(data))
        return self

    def symlink(self, name: str, target: str) -> Layer:
        info = tarfile.TarInfo(name)
        info.type, info.linkname, info.mode = tarfile.SYMTYPE, target, 0o777
        self.tar.addfile(info)
        return self

    def hardlink(self, name: str, target: str) -> Layer:
        info = tarfile.TarInfo(name)
        info.type, info.linkname = tarfile.LNKTYPE, target
        self.tar.addfile(info)
        return self

    def bytes(self) -> bytes:
        self.tar.close()
        return self.buf.getvalue()


def base_layer(rootfs: Path) -> Layer:
    """A layer with a working ``/bin/sh`` taken from ``rootfs`` (the default image)."""
    layer = Layer()
    for d in ("usr", "usr/bin", "usr/lib", "usr/lib/x86_64-linux-gnu", "usr/lib64", "etc",
              "home", "workspace", "opt", "opt/old", "opt/keep", "srv", "srv/data"):
        layer.dir(d)
    layer.dir("tmp", 0o1777)
    for link, target in (("bin", "usr/bin"), ("lib", "usr/lib"), ("lib64", "usr/lib64"),
                         ("sbin", "usr/sbin"), ("usr/bin/sh", "dash")):
        layer.symlink(link, target)
    layer.symlink("usr/lib64/ld-linux-x86-64.so.2", "/lib/x86_64-linux-gnu/ld-linux-x86-64.so.2")
    for rel in (*BINARIES, *LIBS):
        layer.file(rel, (rootfs / rel).read_bytes(), 0o755)
    layer.file("etc/os-release", b"ID=corral-test\n")
    layer.file("etc/gone.txt", b"deleted by layer 2\n")
    layer.file("opt/old/a.txt", b"hidden by the opaque dir\n")
    layer.file("opt/old/b.txt", b"hidden too\n")
    layer.file("opt/keep/k.txt", b"kept\n")
    layer.file("srv/data/owned.txt", b"the sandbox user's\n", uid=1000)
    layer.hardlink("srv/data/hard.txt", "opt/keep/k.txt")
    return layer


DEPTH = 1500  # past Python's recursion limit (1000), within PATH_MAX ("d/" a level)
LINKS = 1000
DEEP = "/".join(["d"] * DEPTH)


def deep_layer() -> Layer:
    """1500 nested directories, a set-user-id file at the bottom and 1000 hard links to
    it near the top (tests/security/test_deep_image_trees.py)."""
    layer = Layer().dir("x")
    for i in range(1, DEPTH + 1):
        layer.dir("/".join(["d"] * i), mode=0o700)
    layer.file(f"{DEEP}/f", b"deep\n", mode=0o4700)
    for i in range(LINKS):
        layer.hardlink(f"x/h{i}", f"{DEEP}/f")
    return layer


def second_layer() -> Layer:
    """Deletes a file of the base (whiteout), empties a directory (opaque) and refills
    it, changes a file."""
    return (Layer()
            .file("etc/.wh.gone.txt")
            .dir("opt/old")
            .file("opt/old/.wh..wh..opq")
            .file("opt/old/new.txt", b"after the opaque marker\n")
            .file("etc/os-release", b"ID=corral-test\nVERSION=2\n"))


CONFIG = {
    "architecture": "amd64", "os": "linux",
    "config": {"Env": ["PATH=/usr/local/bin:/usr/bin:/bin", "GREETING=hello from oci"],
               "WorkingDir": "/srv/data"},
}


def _digest(data: bytes) -> str:
    return "sha256:" + hashlib.sha256(data).hexdigest()


def with_diff_ids(config: dict, layers: list[bytes]) -> dict:
    return {**config, "rootfs": {"type": "layers", "diff_ids": [_digest(x) for x in layers]}}


def docker_save(layers: list[bytes], config: dict = CONFIG) -> bytes:
    """A ``docker save`` tarball (legacy layout: ``<id>/layer.tar``)."""
    buf = io.BytesIO()
    config_bytes = json.dumps(with_diff_ids(config, layers)).encode()
    names = [f"{hashlib.sha256(x).hexdigest()}/layer.tar" for x in layers]
    manifest = [{"Config": "config.json", "RepoTags": ["test/img:1"], "Layers": names}]
    with tarfile.open(fileobj=buf, mode="w") as tar:
        for name, data in [("manifest.json", json.dumps(manifest).encode()),
                           ("config.json", config_bytes), *zip(names, layers, strict=True)]:
            info = tarfile.TarInfo(name)
            info.size = len(data)
            tar.addfile(info, io.BytesIO(data))
    return buf.getvalue()


def oci_layout(dest: Path, layers: list[bytes], config: dict = CONFIG, *,
               gzip_layers: bool = True, zstd_layers: bool = False) -> Path:
    """An OCI image layout directory (index -> manifest -> config and layer blobs);
    layers gzipped, zstd-compressed (Debian's ``zstd``) or plain."""
    blobs = dest / "blobs" / "sha256"
    blobs.mkdir(parents=True)

    def put(data: bytes) -> str:
        d = _digest(data)
        (blobs / d.split(":")[1]).write_bytes(data)
        return d

    config_bytes = json.dumps(with_diff_ids(config, layers)).encode()
    if zstd_layers:
        stored = [subprocess.run(["zstd", "-q", "-c"], input=x, capture_output=True,
                                 check=True).stdout for x in layers]
    else:
        stored = [gzip.compress(x, mtime=0) if gzip_layers else x for x in layers]
    media = "application/vnd.oci.image.layer.v1.tar" + (
        "+zstd" if zstd_layers else "+gzip" if gzip_layers else "")
    manifest = {
        "schemaVersion": 2, "mediaType": "application/vnd.oci.image.manifest.v1+json",
        "config": {"mediaType": "application/vnd.oci.image.config.v1+json",
                   "digest": put(config_bytes), "size": len(config_bytes)},
        "layers": [{"mediaType": media, "digest": put(x), "size": len(x)} for x in stored],
    }
    manifest_bytes = json.dumps(manifest).encode()
    index = {"schemaVersion": 2, "manifests": [
        {"mediaType": manifest["mediaType"], "digest": put(manifest_bytes),
         "size": len(manifest_bytes), "platform": {"architecture": "amd64", "os": "linux"}}]}
    (dest / "index.json").write_text(json.dumps(index))
    (dest / "oci-layout").write_text('{"imageLayoutVersion": "1.0.0"}')
    return dest


def tar_directory(src: Path, dest: Path) -> Path:
    with tarfile.open(dest, "w") as tar:
        for entry in sorted(src.iterdir()):
            tar.add(entry, arcname=entry.name)
    return dest
