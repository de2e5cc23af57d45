"""Root images that travel: a root filesystem image, by the digest of its content.

A root image (``python``, or one imported: kind ``debootstrap``, ``rootfs``, ``oci``)
is named by a digest of its build inputs and its listing (:mod:`corral.runtime.images`),
which differs between two hosts that built the same recipe apart. To travel, it is
also *content-addressed*: its ``content`` digest is :func:`~corral.runtime.layers.tree_digest`
of its ``rootfs`` in the form a root travels in (:func:`~corral.runtime.layers.root_form_mode`:
without device nodes, setuid/setgid bits or xattrs other than ``user.*``, none of which
counts in a sandbox, whose lower layers are mounted ``nosuid,nodev``). It is computed
once, the first time a peer asks (a few seconds for ``python``), and kept in the
image's manifest (``"content": {"digest", "size_bytes"}``); a root received from a
peer has it from the start.

The tree then crosses as a layer does (:mod:`corral.runtime.layer_wire`, stricter in
``root_form``: no device node, setuid/setgid file or foreign xattr is accepted): built
in a temporary directory of the host's image layer store, hashed, and published as an
image by one rename, else :class:`~corral.errors.LayerTransferError` and nothing left.
Where it is published:

- an image pulled by name (``corral image import`` on one node, used on another)
  keeps its name, and the digest it has on the node it came from (so snapshots of it
  travel too);
- the root of a built image whose root this node lacks, or has as another build,
  goes under the internal name ``root-<32 hex of the content digest>`` (never over
  this node's own ``python``, which its own sandboxes keep using), marked
  ``pulled_root``: :func:`corral.runtime.image_cache.collect` deletes it once no image
  is built on it and no sandbox mounts it.

Any local root image whose content digest matches is used instead of fetching (each
root crosses once per node; concurrent first uses share one fetch).
"""

from __future__ import annotations

import asyncio
import json
import os
import re
import threading
from pathlib import Path
from typing import Any

from corral.errors import InvalidArgument
from corral.runtime import image_cache, layer_wire
from corral.runtime.fsutil import _write_atomic
from corral.runtime.images import MANIFEST, ROOTFS, Image, ImageStore
from corral.runtime.layer_fetch import SLACK_BYTES, LayerFetcher, OpenLayer
from corral.runtime.layers import TREE, tree_digest

CONTENT = "content"
PULLED = "pulled_root"
INTERNAL_PREFIX = "root-"
ROOT_KINDS = ("debootstrap", "rootfs", "oci")
_MAX_ENV = 512
_MAX_ENV_VALUE = 64 << 10  # characters of one variable
_computing = threading.Lock()  # one content digest computed at a time (they are big)


def internal_name(digest: str) -> str:
    """The name a pulled root of another node's built image gets here."""
    return INTERNAL_PREFIX + layer_wire.check_digest(digest)[7:39]


def kept_content(manifest: dict[str, Any]) -> dict[str, Any] | None:
    """The ``content`` (``{"digest", "size_bytes"}``) a manifest (a root image's, a
    volume's) keeps, if it is well-formed, else None."""
    found = manifest.get(CONTENT)
    if (isinstance(found, dict) and isinstance(found.get("digest"), str)
            and layer_wire.DIGEST_RE.fullmatch(found["digest"])
            and isinstance(found.get("size_bytes"), int)):
        return {"digest": found["digest"], "size_bytes": found["size_bytes"]}
    return None


def content_of(images: ImageStore, name: str) -> dict[str, Any]:
    """``{"digest", "size_bytes"}`` of the root image ``name`` as it travels: read from
    its manifest, else computed (blocking: a thread) and kept there."""
    image = images.get(name, check_base=False)
    if image.kind == "built":
        raise InvalidArgument(f"image {name!r} is built, not a root filesystem",
                              details={"image": name})
    found = kept_content(images.manifest(name))
    if found is not None:
        return found
    with _computing:
        manifest = images.manifest(name)
        found = kept_content(manifest)
        if found is not None:
            return found
        digest, size = tree_digest(image.rootfs, root_form=True)
        content = {"digest": digest, "size_bytes": size}
        with images._store_lock():  # unless replaced meanwhile: kept for the next peer
            now = images.manifest(name)
            if (now.get("digest"), now.get("created_at")) == (
                    manifest.get("digest"), manifest.get("created_at")):
                _write_atomic(images.images_dir / name / MANIFEST,
                              json.dumps({**now, CONTENT: content}, indent=2, sort_keys=True)
                              + "\n")
    return content


def _roots(images: ImageStore, digest: str) -> list[str]:
    """Names of the root images here whose content digest is ``digest``."""
    return sorted(
        name for name, m in image_cache.manifests(images.images_dir).items()
        if not name.startswith(".") and m.get("kind") != "built"
        and (kept_content(m) or {}).get("digest") == digest
        and (images.images_dir / name / ROOTFS).is_dir()
    )


def root_path_for(images: ImageStore, digest: str) -> Path | None:
    """The ``rootfs`` of a root image here whose content is ``digest``, if any (only
    one a peer was told of: its content digest is known), else None."""
    layer_wire.check_digest(digest)
    names = _roots(images, digest)
    return images.images_dir / names[0] / ROOTFS if names else None


def find_root(images: ImageStore, digest: str) -> Image | None:
    names = _roots(images, digest)
    return images.get(names[0], check_base=False) if names else None


def _checked_meta(meta: dict[str, Any]) -> dict[str, Any]:
    """What of a peer's description of a root goes into the manifest here (checked)."""
    out: dict[str, Any] = {"kind": meta.get("kind") if meta.get("kind") in ROOT_KINDS
                           else "rootfs"}
    digest = meta.get("digest")
    if isinstance(digest, str) and layer_wire.DIGEST_RE.fullmatch(digest):
        out["digest"] = digest
    env = checked_env(meta.get("env"), "a root image")
    if env:
        out["env"] = env
    workdir = meta.get("workdir")
    if isinstance(workdir, str) and workdir.startswith("/") and len(workdir) < 4096:
        out["workdir"] = workdir
    return out


def checked_env(env: Any, what: str) -> dict[str, str]:
    """A peer's ``env`` of an image, checked (names, count, sizes), else
    :class:`InvalidArgument`: it goes into a manifest every sandbox of the image reads."""
    env = env or {}
    if (not isinstance(env, dict) or len(env) > _MAX_ENV or not all(
            isinstance(k, str) and isinstance(v, str) and re.fullmatch(r"[A-Za-z_]\w{0,255}", k)
            and len(v) <= _MAX_ENV_VALUE and "\0" not in v for k, v in env.items())):
        raise InvalidArgument(f"the peer described {what} with an invalid env")
    return env


async def pull_root(fetcher: LayerFetcher, content: Any, open_layer: OpenLayer, *,
                    meta: dict[str, Any], name: str | None = None,
                    keep_it: bool = False) -> Image:
    """The root image here whose content is ``content`` (``{"digest", "size_bytes"}``
    from a peer), fetched if no image here has it. ``name``: publish it under that name
    (an image pulled by name), else under :func:`internal_name`. ``meta``: the peer's
    description of the image (its kind, digest, env, workdir). ``keep_it``: the root is
    returned kept from collection (:func:`keep`), made so under the build lock, so no
    collection between the pull and the caller's use takes it. Concurrent pulls of one
    root share one fetch."""
    if not isinstance(content, dict):
        raise InvalidArgument("the peer described a root image without its content digest")
    digest = layer_wire.check_digest(content.get("digest"))
    size = content.get("size_bytes")
    if not isinstance(size, int) or size < 0:
        raise InvalidArgument(f"root image {digest}: invalid size {str(size)[:40]!r}")
    target = name or internal_name(digest)
    checked = _checked_meta(meta)
    image: Image = await fetcher.once(
        f"root:{digest}:{target}:{keep_it}",
        lambda: asyncio.to_thread(_pull_kept if keep_it else _pull_now, fetcher, digest, size,
                                  open_layer, target, checked))
    return image


def _pull_kept(fetcher: LayerFetcher, digest: str, size: int, open_layer: OpenLayer,
               target: str, meta: dict[str, Any]) -> Image:
    images = fetcher.snapshots.images
    lock = image_cache.hold_build_lock(images.images_dir)  # held across both: no collection
    try:
        image = _pull_now(fetcher, digest, size, open_layer, target, meta)
        keep(images, image.name)
        return image
    finally:
        os.close(lock)


def _pull_now(fetcher: LayerFetcher, digest: str, size: int, open_layer: OpenLayer,
              target: str, meta: dict[str, Any]) -> Image:
    images = fetcher.snapshots.images
    lock = image_cache.hold_build_lock(images.images_dir)  # no collection meanwhile
    try:
        if images.exists(target):
            mine = images.get(target, check_base=False)
            if (kept_content(images.manifest(target)) or {}).get("digest") == digest:
                return mine
        here = find_root(images, digest)
        if here is not None and target.startswith(INTERNAL_PREFIX):
            return here  # any root here with that content will do
        if here is not None:  # imported here under another name: a copy, nothing fetched
            return images.add_rootfs(target, here.rootfs, source=_source(digest, meta),
                                     extra=_extra(digest, content_of(images, here.name)["size_bytes"],
                                                meta, target))
        store = image_cache.layer_store(images.images_dir)
        with open_layer(digest, size) as chunks:
            sealed, received = layer_wire.receive_tree(
                store, digest, chunks, max_bytes=2 * size + SLACK_BYTES, need_bytes=size,
                root_form=True)
        try:
            image = images.add_rootfs(target, sealed.tmp / TREE, move=True,
                                      source=_source(digest, meta),
                                      extra=_extra(digest, sealed.size_bytes, meta, target))
        finally:
            store.discard(sealed.tmp)
        fetcher.stats.count(digest, received)
        return image
    finally:
        os.close(lock)


def _source(digest: str, meta: dict[str, Any]) -> dict[str, Any]:
    return {"kind": "peer", "content": digest, "origin_digest": meta.get("digest")}


def _extra(digest: str, size: int, meta: dict[str, Any], target: str) -> dict[str, Any]:
    return {**meta, CONTENT: {"digest": digest, "size_bytes": size},
            **({PULLED: True} if target.startswith(INTERNAL_PREFIX) else {})}


def keep(images: ImageStore, name: str) -> None:
    """Keep the pulled root ``name`` from collection (a snapshot here stands on it,
    which :func:`image_cache.collect` cannot see): it stays until removed by hand."""
    with images._store_lock():
        manifest = images.manifest(name)
        if manifest.pop(PULLED, None) is not None:
            _write_atomic(images.images_dir / name / MANIFEST,
                          json.dumps(manifest, indent=2, sort_keys=True) + "\n")
