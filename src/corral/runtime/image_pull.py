"""Pulling images from OCI / Docker registries into the image store.

A pulled image is stored like a built one (:mod:`corral.runtime.image_build`): no
root filesystem of its own, but one layer of the host-wide layer store per layer of
the image, above the empty root image :data:`SCRATCH`. Each OCI layer is unpacked once
into an overlayfs lower layer (its whiteouts become overlayfs's markers: see
:func:`corral.runtime.oci_layers.apply_layer`, whose safety rules apply unchanged: no path
out of the layer, no device node, no set-id bit, no extended attribute), so

* two images that share a base layer (same blob digest) store it once, and a second
  pull of it downloads nothing (the build cache maps the blob digest to the layer);
* a sandbox of a freshly pulled image mounts those layers as they are: nothing is
  copied per image or per sandbox;
* images pulled on one node of a cluster travel to others from the peer, as built
  images do (:mod:`corral.runtime.image_travel`).

Every blob is checked against its digest (and each layer's unpacked tar against the
config's ``diff_ids``); a manifest is capped at 4 MiB, a config at 8 MiB, and what one
pull may unpack at ``max_bytes`` (default :data:`~corral.runtime.layer_codec.DEFAULT_MAX_BYTES`, or
``CORRAL_PULL_MAX_BYTES``). Blobs download into ``<images_dir>/.blobs/`` and are
deleted once unpacked; a download cut off (by the network, or a killed daemon) is
resumed from where it stopped with a ``Range`` request, by this pull or the next.

Pulls of one image are coalesced: a lock per local name makes a second caller wait for
the first and then find the image. The local name of a reference is
:func:`local_name` (a readable prefix and a hash of the reference).

Example::

    image = pull_image(store, "registry.example:5000/team/task:v1")   # blocking
    image.name                       # "registry.example-5000-team-task-v1-3f9c2a1b"
"""

from __future__ import annotations

import contextlib
import hashlib
import http.client
import json
import os
import re
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from corral.errors import ImageImportError, ImageNotFound, InvalidArgument, RegistryError
from corral.image_schema import validate_image_name
from corral.runtime import image_cache, layer_codec
from corral.runtime.debian import _make_world_readable
from corral.runtime.distribution import (
    INDEX_TYPES,
    Reference,
    RegistryClient,
    parse_reference,
    plain_http_allowed,
)
from corral.runtime.fsutil import _flock, _remove_tree
from corral.runtime.image_cache import CacheEntry
from corral.runtime.images import Image, ImageStore
from corral.runtime.layer_codec import MAX_BYTES_ENV, max_pull_bytes
from corral.runtime.oci import _env, _workdir, choose_platform
from corral.runtime.oci_layers import apply_overlay_layer

SCRATCH = "scratch"
BLOBS = ".blobs"
MAX_CONFIG_BYTES = 8 << 20
MAX_LAYERS = 127  # Docker's own limit
RESUME_TRIES = 8
_CHUNK = 1 << 20
_KEY_FORMAT = b"corral-oci-layer-1\n"
_DIGEST_RE = re.compile(r"sha256:[0-9a-f]{64}")
_SLUG_RE = re.compile(r"[^a-z0-9._-]+")

OnProgress = Callable[[dict[str, Any]], Any]


def local_name(ref: str | Reference) -> str:
    """The image store's name for a registry reference: readable and unique."""
    text = str(ref if isinstance(ref, Reference) else parse_reference(ref))
    slug = _SLUG_RE.sub("-", text.lower()).strip("-._")[:54].rstrip("-._") or "image"
    return f"{slug}-{hashlib.sha256(text.encode()).hexdigest()[:8]}"


def pull_image(store: ImageStore, ref: str, *, name: str | None = None,
               insecure: bool = False, if_missing: bool = False,
               on_progress: OnProgress | None = None, max_bytes: int | None = None) -> Image:
    """Pull ``ref`` into ``store`` as ``name`` (default :func:`local_name`). With
    ``if_missing``, an image already pulled is returned without asking the registry
    (first use by a sandbox); otherwise the registry's manifest is compared and the
    image replaced if it changed. ``insecure`` only confirms plain HTTP, which is
    allowed for loopback and ``CORRAL_INSECURE_REGISTRIES`` hosts. Blocking."""
    parsed = parse_reference(ref)
    if insecure and not plain_http_allowed(parsed.host):
        raise InvalidArgument(
            f"insecure (plain HTTP) pulls are allowed only from loopback registries or "
            f"those listed in CORRAL_INSECURE_REGISTRIES on the daemon, not {parsed.host}",
            details={"registry": parsed.host})
    name = validate_image_name(name or local_name(parsed))
    store.images_dir.mkdir(parents=True, exist_ok=True)
    emit = on_progress or (lambda _e: None)
    with _flock(store.images_dir / f".pull-{name}.lock",
                on_wait=lambda: emit({"type": "log", "line": f"waiting for another pull of {ref}"})):
        if if_missing and store.exists(name):
            return store.get(name)
        return _Pull(store, parsed, name, emit, max_bytes or max_pull_bytes()).run()


def ensure_scratch(store: ImageStore) -> Image:
    """The empty root image pulled images stand on (made once; never replaced)."""
    if store.exists(SCRATCH):
        return store.get(SCRATCH)
    with _flock(store.images_dir / f".build-{SCRATCH}.lock"):
        if store.exists(SCRATCH):
            return store.get(SCRATCH)
        work = store.work_dir(SCRATCH)
        try:
            etc = work / "tree" / "etc"
            etc.mkdir(parents=True, mode=0o755)
            os.chmod(work / "tree", 0o755)
            (etc / "resolv.conf").write_text("")
            (etc / "hosts").write_text("127.0.0.1\tlocalhost sandbox\n")
            for f in etc.iterdir():
                os.chmod(f, 0o644)
            return store.add_rootfs(SCRATCH, work / "tree", move=True,
                                    source={"kind": "scratch"}, extra={"kind": "rootfs"})
        finally:
            _remove_tree(work)


class _Pull:
    def __init__(self, store: ImageStore, ref: Reference, name: str, emit: OnProgress,
                 max_bytes: int) -> None:
        self.store, self.ref, self.name, self.emit = store, ref, name, emit
        self.budget = max_bytes
        self.images_dir = store.images_dir
        self.client = RegistryClient(ref)

    def run(self) -> Image:
        try:
            return self._run()
        finally:
            self.client.close()

    def _run(self) -> Image:
        manifest, digest = self._manifest()
        if self.store.exists(self.name):
            with contextlib.suppress(ImageNotFound):
                old = self.store.manifest(self.name).get("source") or {}
                if old.get("manifest") == digest:
                    self.emit({"type": "log", "line": f"{self.ref}: up to date ({digest})"})
                    return self.store.get(self.name)
        config_desc = manifest["config"]
        config = json.loads(self._small_blob(config_desc, MAX_CONFIG_BYTES))
        if not isinstance(config, dict):
            raise ImageImportError(f"the config of {self.ref} is not a JSON object")
        descs = manifest["layers"]
        diff_ids = (config.get("rootfs") or {}).get("diff_ids") or []
        if len(diff_ids) != len(descs):
            raise ImageImportError(
                f"the config of {self.ref} lists {len(diff_ids)} diff_ids for {len(descs)} "
                "layers", details={"ref": str(self.ref)})
        scratch = ensure_scratch(self.store)
        lock = image_cache.hold_build_lock(self.images_dir)  # no collection meanwhile
        try:
            made = [self._layer(i, d, str(diff_ids[i]), len(descs)) for i, d in enumerate(descs)]
            unique = {e.layer_id: e for e in reversed(made)}  # top first, each once
            layers: list[dict[str, Any]] = [
                {"id": e.layer_id, "digest": e.digest, "size_bytes": e.size_bytes}
                for e in unique.values()]
            cfg = config.get("config") or {}
            image = self.store.publish_built(self.name, {
                "digest": digest, "size_bytes": scratch.size_bytes + sum(
                    x["size_bytes"] for x in layers),
                "python": self._python(made), "base": SCRATCH,
                "root": {"image": SCRATCH, "digest": scratch.digest}, "layers": layers,
                "env": _env(cfg.get("Env")), "workdir": _workdir(cfg.get("WorkingDir")),
                "user": cfg.get("User") or None,
                "cmd": _strings(cfg.get("Cmd")), "entrypoint": _strings(cfg.get("Entrypoint")),
                "source": {"kind": "pull", "ref": str(self.ref), "manifest": digest,
                           "config": config_desc["digest"],
                           "keys": [e.key for e in made]},
            })
        finally:
            os.close(lock)
        self.emit({"type": "log", "line": f"{self.ref}: pulled as {self.name} ({digest})"})
        return image

    # ------------------------------------------------------------------ manifests

    def _manifest(self) -> tuple[dict[str, Any], str]:
        manifest, digest, media = self.client.manifest(self.ref.reference)
        if media in INDEX_TYPES or "manifests" in manifest:
            chosen = choose_platform(manifest.get("manifests") or [])
            manifest, digest, media = self.client.manifest(_digest(chosen.get("digest")))
            if media in INDEX_TYPES or "manifests" in manifest:
                raise ImageImportError(f"{self.ref}: an index inside an index is not supported")
        layers = manifest.get("layers")
        config = manifest.get("config")
        if not isinstance(config, dict) or not isinstance(layers, list) or not all(
                isinstance(x, dict) for x in layers):
            raise ImageImportError(f"the manifest of {self.ref} lacks config or layers",
                                   details={"ref": str(self.ref)})
        if len(layers) > MAX_LAYERS:
            raise ImageImportError(f"{self.ref} has {len(layers)} layers (at most "
                                   f"{MAX_LAYERS})", details={"ref": str(self.ref)})
        for d in (config, *layers):
            _digest(d.get("digest"))
            size = d.get("size")
            if not isinstance(size, int) or size < 0:
                raise ImageImportError(f"a descriptor of {self.ref} has no valid size")
        return manifest, digest

    def _small_blob(self, desc: dict[str, Any], limit: int) -> bytes:
        digest = _digest(desc.get("digest"))
        if desc["size"] > limit:
            raise ImageImportError(f"the config of {self.ref} is {desc['size']} bytes, over "
                                   f"the {limit}-byte limit", details={"ref": str(self.ref)})
        resp, _ = self.client.blob_stream(digest)
        try:
            body = resp.read(limit + 1)
        finally:
            resp.close()
        if len(body) > limit or "sha256:" + hashlib.sha256(body).hexdigest() != digest:
            raise ImageImportError(f"blob {digest} of {self.ref} does not match its digest "
                                   "(a damaged or altered image): refused",
                                   details={"ref": str(self.ref), "digest": digest})
        return body

    # ------------------------------------------------------------------ layers

    def _layer(self, index: int, desc: dict[str, Any], diff_id: str, total: int) -> CacheEntry:
        digest = _digest(desc["digest"])
        key = hashlib.sha256(_KEY_FORMAT + digest.encode()).hexdigest()
        entry = image_cache.cache_get(self.images_dir, key)
        base = {"type": "layer", "layer": index + 1, "total": total, "digest": digest,
                "size": desc["size"]}
        if entry is not None:
            self.emit({**base, "cached": True, "bytes": desc["size"]})
            return entry
        if desc["size"] > self.budget:
            raise self._too_large(index, desc["size"])
        blob = self._download(index, digest, desc["size"], base)
        try:
            return self._install(index, key, digest, blob, diff_id)
        finally:
            blob.unlink(missing_ok=True)  # unpacked or refused: never kept

    def _install(self, index: int, key: str, digest: str, blob: Path,
                 diff_id: str) -> CacheEntry:
        layers = image_cache.layer_store(self.images_dir)
        staged = None
        try:
            staged = layers.new_tmp()
            tree = staged / "tree"
            tree.mkdir(mode=0o755)
            self._unpack(index, blob, tree, diff_id)
            _make_world_readable(tree)
            sealed = layers.seal(staged)
            layer, _new = layers.install(sealed)
        except BaseException:
            layers.discard(staged)
            raise
        entry = CacheEntry(key, layer.id, layer.digest, layer.size_bytes,
                           f"pull {self.ref} layer {index + 1}: {digest}")
        image_cache.cache_put(self.images_dir, entry)
        return entry

    def _download(self, index: int, digest: str, size: int, event: dict[str, Any]) -> Path:
        """The blob in ``.blobs/``, verified; resumes a partial download."""
        blobs = self.images_dir / BLOBS
        blobs.mkdir(mode=0o700, exist_ok=True)
        done = blobs / digest.removeprefix("sha256:")
        partial = done.with_suffix(".partial")
        last = 0.0
        h, hashed = hashlib.sha256(), 0  # hashed as it arrives: no second read
        for attempt in range(RESUME_TRIES):
            have = partial.stat().st_size if partial.exists() else 0
            if have > size:
                partial.unlink()
                have = 0
            try:
                if have == size and size:
                    break
                resp, start = self.client.blob_stream(digest, have)
                if start == 0 and have:
                    partial.unlink()
                    have = 0
                if hashed != have:  # resuming what an earlier pull (or try) fetched
                    h, hashed = _hash_prefix(partial, have)
                try:
                    with open(partial, "ab") as f:
                        while chunk := resp.read(_CHUNK):
                            have += len(chunk)
                            if have > size:
                                raise ImageImportError(
                                    f"blob {digest} of {self.ref} is longer than its "
                                    f"{size} bytes: refused", details={"digest": digest})
                            f.write(chunk)
                            h.update(chunk)
                            hashed = have
                            now = time.monotonic()
                            if now - last > 0.2:
                                last = now
                                self.emit({**event, "cached": False, "bytes": have})
                finally:
                    resp.close()
                if have == size:
                    break
            except (OSError, http.client.HTTPException, RegistryError) as exc:
                if isinstance(exc, RegistryError) and (exc.details.get("status") or 500) < 500:
                    raise
                self.emit({"type": "log", "line": f"layer {index + 1}: connection lost after "
                           f"{have} bytes, resuming (try {attempt + 2})"})
                time.sleep(min(0.2 * 2 ** attempt, 3.0))
        else:
            raise RegistryError(f"registry {self.ref.host} kept dropping blob {digest} of "
                                f"{self.ref}; pull again to resume from where it stopped",
                                details={"registry": self.ref.host, "ref": str(self.ref)})
        if hashed != size:
            h, hashed = _hash_prefix(partial, size)
        got = "sha256:" + h.hexdigest()
        if got != digest:
            partial.unlink()
            raise ImageImportError(
                f"layer {index + 1} of {self.ref} does not match its digest {digest} (got "
                f"{got}: a damaged or altered blob): refused",
                details={"ref": str(self.ref), "layer": index + 1, "digest": digest})
        os.replace(partial, done)
        self.emit({**event, "cached": False, "bytes": size})
        return done

    def _unpack(self, index: int, blob: Path, tree: Path, diff_id: str) -> None:
        """Unpack the blob into ``tree`` in one pass (gunzipped or un-zstd-ed on the way), its tar's
        sha256 checked against ``diff_id``, within the pull's byte budget."""
        with layer_codec.open_layer(blob, f"layer {index + 1} of {self.ref}") as src:
            reader = _Checked(src, self.budget, lambda n: self._too_large(index, n))
            apply_overlay_layer(tree, reader, index + 1)
            reader.drain()  # the tar's zero blocks and padding count in diff_id
        self.budget -= reader.count
        if "sha256:" + reader.hash.hexdigest() != diff_id:
            raise ImageImportError(
                f"layer {index + 1} of {self.ref} does not match its diff_id {diff_id} "
                "(a damaged or altered image): refused", details={"layer": index + 1})

    def _too_large(self, index: int, size: int) -> ImageImportError:
        return ImageImportError(
            f"layer {index + 1} of {self.ref} expands past what one pull may unpack "
            f"({size} bytes; limit {MAX_BYTES_ENV}): refused",
            details={"ref": str(self.ref), "layer": index + 1, "limit": "max_bytes"})

    def _python(self, made: list[CacheEntry]) -> str | None:
        store = image_cache.layer_store(self.images_dir)
        for e in reversed(made):
            for rel in ("usr/local/bin/python3", "usr/bin/python3"):
                p = store.path(e.layer_id) / rel
                if os.path.lexists(p) and not p.is_char_device():
                    return "/" + rel
        return None


class _Checked:
    """A reader that hashes what passes and stops past ``limit`` bytes."""

    def __init__(self, src: Any, limit: int, too_large: Callable[[int], Exception]) -> None:
        self.src, self.limit, self.too_large = src, limit, too_large
        self.hash = hashlib.sha256()
        self.count = 0

    def read(self, n: int = -1) -> bytes:
        data: bytes = self.src.read(n if n is not None and n >= 0 else _CHUNK)
        self.count += len(data)
        if self.count > self.limit:
            raise self.too_large(self.count)
        self.hash.update(data)
        return data

    def drain(self) -> None:
        while self.read(_CHUNK):
            pass


def _hash_prefix(path: Path, length: int) -> tuple[Any, int]:
    """sha256 over the first ``length`` bytes of ``path``."""
    h = hashlib.sha256()
    done = 0
    with contextlib.suppress(FileNotFoundError), open(path, "rb") as f:
        while done < length and (chunk := f.read(min(_CHUNK, length - done))):
            h.update(chunk)
            done += len(chunk)
    return h, done


def _digest(value: Any) -> str:
    if not isinstance(value, str) or not _DIGEST_RE.fullmatch(value):
        raise ImageImportError(f"unsupported digest {str(value)[:80]!r} (expected sha256:<hex>)")
    return value


def _strings(value: Any) -> list[str] | None:
    if isinstance(value, list) and all(isinstance(x, str) for x in value):
        return value
    return None


def prune(images_dir: Path, *, partial_age_s: float = 60.0) -> tuple[list[str], int]:
    """Delete the layers nothing keeps (:func:`image_cache.collect`: no image, build
    cache entry of an image, or mounted sandbox) and partial downloads untouched for
    ``partial_age_s``; ``(what went, bytes freed)``. Does nothing while a build runs."""
    images_dir = Path(images_dir)
    sizes: dict[str, int] = {}
    layers_root = images_dir / image_cache.LAYERS
    with contextlib.suppress(FileNotFoundError):
        for entry in os.scandir(layers_root):
            with contextlib.suppress(OSError, ValueError, KeyError):
                sizes[entry.name] = int(json.loads(
                    Path(entry.path, "manifest.json").read_text())["size_bytes"])
    removed = image_cache.collect(images_dir)
    freed = sum(sizes.get(n, 0) for n in removed)
    now = time.time()
    with contextlib.suppress(FileNotFoundError):
        for entry in os.scandir(images_dir / BLOBS):
            with contextlib.suppress(OSError):
                st = entry.stat(follow_symlinks=False)
                if now - st.st_mtime > partial_age_s:
                    os.unlink(entry.path)
                    removed.append(f"{BLOBS}/{entry.name}")
                    freed += st.st_size
    return removed, freed


def unique_sizes(images_dir: Path) -> dict[str, int]:
    """``{image: bytes only it uses}``: its layers no other image lists, and its own
    root filesystem unless another image stands on it."""
    found = {n: m for n, m in image_cache.manifests(images_dir).items()
             if not n.startswith(".")}
    users: dict[str, int] = {}
    for m in found.values():
        for layer in m.get("layers") or []:
            users[str(layer.get("id"))] = users.get(str(layer.get("id")), 0) + 1
        root = (m.get("root") or {}).get("image")
        if root:
            users["root:" + str(root)] = users.get("root:" + str(root), 0) + 1
    out = {}
    for name, m in found.items():
        own = 0 if m.get("kind") == "built" else int(m.get("size_bytes") or 0)
        if users.get("root:" + name):
            own = 0
        out[name] = own + sum(int(x.get("size_bytes") or 0) for x in m.get("layers") or []
                              if users.get(str(x.get("id"))) == 1)
    return out
