"""Importing images: ``docker save`` tarballs and OCI image layouts (a directory or tar).

No registry is involved: the archive is made elsewhere (``docker save``, ``skopeo copy
... oci:dir``, ``podman save --format oci-archive``) and brought here. Its layers are
applied in order into one root filesystem, which is registered like any image; the
image config's ``Env`` and ``WorkingDir`` become the defaults of its sandboxes.

Layers follow the OCI rules for changesets: ``.wh.<name>`` deletes ``<name>`` from the
layers below, ``.wh..wh..opq`` empties its directory of what the layers below put
there; whiteouts apply before the layer's own entries (so a layer may re-create what
it hides). Layers may be plain tar, gzip or zstd (:mod:`corral.runtime.layer_codec`);
blobs are checked against their digests, and layers against the config's ``diff_ids``.

Safety: the archive is untrusted. Entry names that are absolute or contain ``..``,
hard links that do, and symbolic links whose relative target climbs out of the root
are refused with :class:`~corral.errors.ImageImportError`; paths are resolved inside
the root the way the sandbox will see them (a symlink is followed as if the root were
``/``), so nothing is ever written outside it. Device nodes are skipped (sandboxes
mount their own ``/dev``). Files owned by uid/gid 1000 become the sandbox user's.

Example::

    image = import_image(store, Path("alpine.tar"), "alpine")     # blocking: a thread
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import platform
import re
import tarfile
from collections.abc import Iterator
from pathlib import Path, PurePosixPath
from typing import IO, Any

from corral.errors import ImageImportError
from corral.image_schema import validate_image_name
from corral.runtime import layer_codec
from corral.runtime.fsutil import _remove_tree
from corral.runtime.images import Image, ImageStore
from corral.runtime.oci_layers import _archive_path, _sandbox_ready, apply_layer

_CHUNK = 1 << 20
_INDEX_TYPES = ("application/vnd.oci.image.index.v1+json",
                "application/vnd.docker.distribution.manifest.list.v2+json")
_ARCH = {"x86_64": "amd64", "aarch64": "arm64"}
_ENV_KEY = re.compile(r"[A-Za-z_][A-Za-z0-9_]*")


def import_image(store: ImageStore, source: Path, name: str, *, replace: bool = True) -> Image:
    """Import the archive or OCI layout directory ``source`` as the image ``name``
    (replacing one of that name unless ``replace`` is false). Blocking."""
    validate_image_name(name)
    source = Path(source)
    if not source.exists():
        raise ImageImportError(f"{source} does not exist", details={"path": str(source)})
    if store.exists(name) and not replace:
        raise ImageImportError(f"image {name!r} already exists", details={"image": name})
    work = store._new_tmp_dir(name)
    try:
        with _open_source(source, work) as src:
            config, layers, described = _read_image(src)
            root = work / "tree"
            root.mkdir(mode=0o755)
            diff_ids = (config.get("rootfs") or {}).get("diff_ids") or []
            for i, (path, digest) in enumerate(layers):
                layer = _fetch_layer(src, path, digest, work / "layer.tar", i)
                expected = diff_ids[i] if len(diff_ids) == len(layers) else None
                if expected and _sha256_file(layer) != expected:
                    raise ImageImportError(
                        f"layer {i + 1} of {source} does not match its diff_id {expected} "
                        "(a damaged or altered archive)", details={"layer": i + 1})
                apply_layer(root, layer, i + 1)
                layer.unlink()
        _sandbox_ready(root)
        cfg = config.get("config") or {}
        env, workdir = _env(cfg.get("Env")), _workdir(cfg.get("WorkingDir"))
        return store.add_rootfs(
            name, root, move=True, replace=replace,
            source={"kind": "oci", **described, "layers": [d for _, d in layers]},
            extra={"kind": "oci", "env": env, "workdir": workdir},
        )
    finally:
        _remove_tree(work)


# ------------------------------------------------------------------ the archive


class _Source:
    """Files of an image archive by their path in it."""

    def open(self, path: str) -> IO[bytes]:
        raise NotImplementedError

    def exists(self, path: str) -> bool:
        raise NotImplementedError

    def json(self, path: str) -> Any:
        try:
            with self.open(path) as f:
                return json.load(f)
        except (ValueError, UnicodeDecodeError) as exc:
            raise ImageImportError(f"{path} in the archive is not valid JSON: {exc}") from None


class _DirSource(_Source):
    def __init__(self, root: Path) -> None:
        self.root = root

    def _path(self, path: str) -> Path:
        return self.root / _archive_path(path)

    def open(self, path: str) -> IO[bytes]:
        p = self._path(path)
        if p.is_symlink() or not p.is_file():
            raise ImageImportError(f"{path} is missing from {self.root}", details={"path": path})
        return open(p, "rb")

    def exists(self, path: str) -> bool:
        return self._path(path).is_file()


class _TarSource(_Source):
    def __init__(self, tar: tarfile.TarFile) -> None:
        self.tar = tar
        self.members = {str(_archive_path(m.name)): m for m in tar.getmembers() if m.isfile()}

    def open(self, path: str) -> IO[bytes]:
        m = self.members.get(str(_archive_path(path)))
        f = self.tar.extractfile(m) if m is not None else None
        if f is None:
            raise ImageImportError(f"{path} is missing from the archive", details={"path": path})
        return f

    def exists(self, path: str) -> bool:
        return str(_archive_path(path)) in self.members


@contextlib.contextmanager
def _open_source(source: Path, work: Path) -> Iterator[_Source]:
    if source.is_dir():
        yield _DirSource(source)
        return
    if layer_codec.codec(source) != "tar":  # `docker save | gzip` (or zstd): unpacked
        plain = work / "archive.tar"  # once, then read at random
        layer_codec.decompress_to(source, plain, str(source))
        source = plain
    try:
        tar = tarfile.open(source, "r:")
    except tarfile.TarError as exc:
        raise ImageImportError(f"{source} is neither a tar archive nor a directory ({exc})",
                               details={"path": str(source)}) from None
    with tar:
        yield _TarSource(tar)


def _read_image(
    src: _Source,
) -> tuple[dict[str, Any], list[tuple[str, str | None]], dict[str, Any]]:
    """(image config, [(layer path, sha256 digest or None)], provenance)."""
    if src.exists("oci-layout") and src.exists("index.json"):
        manifest = _pick_manifest(src, src.json("index.json"))
        config = src.json(_blob(manifest["config"]["digest"]))
        layers = [(_blob(layer["digest"]), layer["digest"]) for layer in manifest["layers"]]
        return config, layers, {"format": "oci", "config": manifest["config"]["digest"]}
    if src.exists("manifest.json"):
        entries = src.json("manifest.json")
        if not isinstance(entries, list) or not entries:
            raise ImageImportError("manifest.json of the archive lists no image")
        if len(entries) > 1:
            tags = [t for e in entries for t in e.get("RepoTags") or []]
            raise ImageImportError(
                f"the archive holds {len(entries)} images ({', '.join(tags) or 'untagged'}): "
                "save one image per archive")
        entry = entries[0]
        try:
            config = src.json(entry["Config"])
            layers = [(str(p), _digest_of(str(p))) for p in entry["Layers"]]
        except (KeyError, TypeError):
            raise ImageImportError("manifest.json of the archive lacks Config or Layers") from None
        tags = entry.get("RepoTags") or []
        return config, layers, {"format": "docker", "ref": tags[0] if tags else None}
    raise ImageImportError(
        "not an image archive: expected manifest.json (docker save) or oci-layout and "
        "index.json (an OCI image layout)")


def _pick_manifest(src: _Source, index: dict[str, Any], depth: int = 0) -> dict[str, Any]:
    """The image manifest of this host's platform (or the only one) in an OCI index."""
    manifests = index.get("manifests") or []
    if not manifests or depth > 4:
        raise ImageImportError("the OCI index lists no image manifest")
    chosen = choose_platform(manifests)
    body = src.json(_blob(chosen["digest"]))
    if not isinstance(body, dict):
        raise ImageImportError(f"blob {chosen['digest']} is not an image manifest")
    if chosen.get("mediaType") in _INDEX_TYPES or "manifests" in body:
        return _pick_manifest(src, body, depth + 1)
    if "config" not in body or "layers" not in body:
        raise ImageImportError(f"blob {chosen['digest']} is not an image manifest")
    return body


def choose_platform(manifests: list[Any]) -> dict[str, Any]:
    """The descriptor in an index's ``manifests`` for this host (linux and its
    architecture; an entry without a platform fits any), skipping attestations."""
    arch = _ARCH.get(platform.machine(), platform.machine())
    fitting = [m for m in manifests if isinstance(m, dict)
               and (m.get("platform") or {}).get("architecture", arch) == arch
               and (m.get("platform") or {}).get("os", "linux") == "linux"
               and (m.get("annotations") or {}).get("vnd.docker.reference.type")
               != "attestation-manifest"]
    if not fitting:
        raise ImageImportError(f"the image index has no manifest for linux/{arch}",
                               details={"platform": f"linux/{arch}"})
    return fitting[0]


def _blob(digest: str) -> str:
    alg, _, hexd = str(digest).partition(":")
    if alg != "sha256" or len(hexd) != 64 or not all(c in "0123456789abcdef" for c in hexd):
        raise ImageImportError(f"unsupported blob digest {digest!r} (expected sha256:<hex>)")
    return f"blobs/sha256/{hexd}"


def _digest_of(path: str) -> str | None:
    """A docker-save layer stored as a blob (``blobs/sha256/<hex>``) is named by its digest."""
    parts = PurePosixPath(path).parts
    if len(parts) == 3 and parts[:2] == ("blobs", "sha256"):
        return "sha256:" + parts[2]
    return None


def _fetch_layer(src: _Source, path: str, digest: str | None, dest: Path, index: int) -> Path:
    """Copy a layer out of the archive as a plain tar, checking its blob digest."""
    h = hashlib.sha256()
    with src.open(path) as fin, open(dest, "wb") as fout:
        while chunk := fin.read(_CHUNK):
            h.update(chunk)
            fout.write(chunk)
    if digest is not None and "sha256:" + h.hexdigest() != digest:
        raise ImageImportError(f"layer {index + 1} ({path}) does not match its digest "
                               f"{digest} (a damaged or altered archive)",
                               details={"layer": index + 1})
    if layer_codec.codec(dest) != "tar":
        plain = dest.with_suffix(".plain")
        layer_codec.decompress_to(dest, plain, f"layer {index + 1}")
        os.replace(plain, dest)
    return dest


def _sha256_file(path: Path) -> str:
    with open(path, "rb") as f:
        return "sha256:" + hashlib.file_digest(f, "sha256").hexdigest()


# ----------------------------------------------------------------- applying


def _env(raw: Any) -> dict[str, str]:
    """The config's ``Env`` (``["K=V", ...]``) as a dict; names a sandbox cannot take
    (not ``[A-Za-z_][A-Za-z0-9_]*``) are left out."""
    env = {}
    for item in raw or []:
        k, sep, v = str(item).partition("=")
        if sep and _ENV_KEY.fullmatch(k) and "\0" not in v:
            env[k] = v
    return env


def _workdir(raw: Any) -> str | None:
    if not raw or not isinstance(raw, str) or not raw.startswith("/") or ".." in raw.split("/"):
        return None
    return raw.rstrip("/") or "/"
