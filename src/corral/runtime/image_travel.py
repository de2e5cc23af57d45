"""Built images that travel: an image built on one node, usable on every node.

An image is built once, on one node (the cluster client sends builds to one daemon);
other nodes pull it lazily, on the first sandbox placed on them that needs it. A built
image is a manifest (its root image by name and digest, its layers by digest, its
``env`` and ``workdir``) over content-addressed layers in the host's image layer store
(:mod:`corral.runtime.image_cache`). Pulling it fetches the layers this host lacks from
the daemon that has the image (:class:`~corral.runtime.layer_fetch.LayerFetcher`: each
checked against its digest, once per host, concurrent pulls sharing one fetch) and
publishes the same manifest here, under the build lock so that no collection takes a
layer before the manifest that keeps it.

The root image (``python``, or an imported one) travels too, by the digest of its
content (:mod:`corral.runtime.root_travel`): a node that has it with the same digest
uses its own; one that lacks it, or has another build of it (every host debootstraps
its own ``python``, with its own digest), pulls the builder's root once, under an
internal name (``root-<hex>``), never over its own ``python``, and publishes the built
image on that. A root filesystem image (``corral image import``) is pulled the same
way, under its own name.
"""

from __future__ import annotations

import asyncio
import os
from collections.abc import Callable
from typing import Any

from corral.errors import ImageNotFound, InvalidArgument
from corral.image_schema import validate_image_name
from corral.runtime import image_cache, layer_wire, root_travel
from corral.runtime.images import Image, ImageStore
from corral.runtime.layer_fetch import LayerFetcher, OpenLayer, layers_of

_KEPT = ("digest", "size_bytes", "python", "base", "root", "env", "workdir", "source", "user",
         "entrypoint", "cmd")


def describe_image(images: ImageStore, name: str) -> dict[str, Any]:
    """What another node needs to pull the image ``name``: its manifest, with the
    content digest of its root (a built image's, or its own for a root filesystem).
    Blocking: the first description of a root hashes it (run it in a thread)."""
    image = images.get(name)
    if image.kind != "built":
        return {"name": name, "kind": image.kind, "digest": image.digest,
                "env": dict(image.env), "workdir": image.workdir,
                "content": root_travel.content_of(images, name)}
    manifest = images.manifest(name)
    assert image.root_image is not None
    return {"name": name, **{k: manifest.get(k) for k in _KEPT},
            "layers": list(manifest.get("layers") or []),
            "root_content": root_travel.content_of(images, image.root_image),
            "root_meta": _root_meta(images.get(image.root_image))}


def _root_meta(root: Image) -> dict[str, Any]:
    return {"kind": root.kind, "digest": root.digest, "env": dict(root.env),
            "workdir": root.workdir}


async def pull_image(fetcher: LayerFetcher, desc: dict[str, Any], open_layer: OpenLayer
                     ) -> Image:
    """Publish here the built image a peer described, fetching the layers it lacks.
    Idempotent: an image here with the same digest is left as it is; concurrent pulls
    of one image share one."""
    name = validate_image_name(str(desc.get("name")))
    if desc.get("kind", "built") != "built":  # a root filesystem, by name
        image: Image = await root_travel.pull_root(
            fetcher, desc.get("content"), open_layer, meta=desc, name=name)
        return image
    image = await fetcher.once(f"image:{name}", lambda: _pull(fetcher, desc, open_layer))
    return image


async def _pull(fetcher: LayerFetcher, desc: dict[str, Any], open_layer: OpenLayer) -> Image:
    images = fetcher.snapshots.images
    name = validate_image_name(str(desc.get("name")))
    digest = desc.get("digest")
    if images.exists(name) and images.get(name, check_base=False).digest == digest:
        return images.get(name)
    root = desc.get("root")
    if not isinstance(root, dict) or not isinstance(digest, str):
        raise InvalidArgument(f"the peer described image {name!r} without its root image")
    try:
        here = images.get(validate_image_name(str(root.get("image"))))
    except ImageNotFound:
        here = None
    layers = layers_of(desc)
    store = image_cache.layer_store(images.images_dir)
    lock = await asyncio.to_thread(image_cache.hold_build_lock, images.images_dir)
    try:  # no collection while a root or layers are here without the manifest keeping them
        if here is None or here.digest != root.get("digest"):  # this node's root differs
            if not isinstance(desc.get("root_meta"), dict):
                raise InvalidArgument(f"the peer described image {name!r} without its root")
            here = await root_travel.pull_root(fetcher, desc.get("root_content"), open_layer,
                                               meta=desc["root_meta"])
        for lid, layer_digest, size in layers:
            if not store.path(lid).is_dir():
                await fetcher.fetch(store, layer_digest, size, open_layer)
        manifest = _checked_built(desc)
        manifest["root"] = {"image": here.name, "digest": here.digest}
        manifest["layers"] = [{"id": lid, "digest": d, "size_bytes": size}
                              for lid, d, size in layers]
        return await asyncio.to_thread(images.publish_built, name, manifest)
    finally:
        os.close(lock)


def _checked_built(desc: dict[str, Any]) -> dict[str, Any]:
    """What of a peer's description of a built image goes into its manifest here, each
    field checked as :meth:`ImageStore.get` and the sandboxes of the image read it (a
    damaged manifest would fail this node's image listing for everyone), else
    :class:`InvalidArgument`. Its source's build-cache keys are the peer's, not kept."""
    name = desc.get("name")
    digest, size, python = desc.get("digest"), desc.get("size_bytes"), desc.get("python")
    base, workdir, source = desc.get("base"), desc.get("workdir"), desc.get("source")
    if not (isinstance(digest, str) and layer_wire.DIGEST_RE.fullmatch(digest)
            and isinstance(size, int) and not isinstance(size, bool) and 0 <= size < 1 << 62
            and (python is None or isinstance(python, str) and python.startswith("/")
                 and len(python) < 4096 and "\0" not in python)
            and (base is None or isinstance(base, str) and len(base) < 256)
            and (workdir is None or isinstance(workdir, str) and workdir.startswith("/")
                 and len(workdir) < 4096 and "\0" not in workdir)
            and (source is None or isinstance(source, dict))):
        raise InvalidArgument(
            f"the peer described image {str(name)[:100]!r} with an invalid digest, size, "
            "python, base, workdir or source: refused (a broken or hostile peer)")
    env = root_travel.checked_env(desc.get("env"), f"image {str(name)[:100]!r}")
    kept_source = {k: v for k, v in (source or {}).items() if k != "keys"}
    return {"digest": digest, "size_bytes": size, "python": python, "base": base,
            "env": env, "workdir": workdir, "source": kept_source,
            **_checked_run_meta(desc, str(name)[:100])}


def _checked_run_meta(desc: dict[str, Any], name: str) -> dict[str, Any]:
    """The image's ``user``, ``entrypoint`` and ``cmd`` (docs/users.md), each checked
    (a string of at most 256 characters; lists of at most 256 such strings, 64 KiB in
    all), else :class:`InvalidArgument`; what is absent stays absent."""
    out: dict[str, Any] = {}
    user = desc.get("user")
    if user is not None:
        if not (isinstance(user, str) and len(user) <= 256 and "\0" not in user):
            raise InvalidArgument(f"the peer described image {name!r} with an invalid user")
        out["user"] = user
    for key in ("entrypoint", "cmd"):
        value = desc.get(key)
        if value is None:
            continue
        if not (isinstance(value, list) and len(value) <= 256
                and all(isinstance(v, str) and "\0" not in v for v in value)
                and sum(len(v) for v in value) <= 1 << 16):
            raise InvalidArgument(f"the peer described image {name!r} with an invalid {key}")
        out[key] = value
    return out


async def image_for_snapshot(fetcher: LayerFetcher, desc: dict[str, Any],
                             describe_peer: Callable[[str], dict[str, Any]],
                             open_layer: OpenLayer) -> dict[str, Any]:
    """The description ``desc`` of a peer's snapshot, with its image made usable here:
    as it is if this node has the image with the same digest; else the image pulled
    from the peer (``describe_peer(name)``: its description there), a built one by
    name, a root one under its internal name when this node has its own of that name
    (another ``python``), which the snapshot is then registered on, kept from
    collection from then on (:func:`root_travel.keep`)."""
    images = fetcher.snapshots.images
    name = validate_image_name(str(desc.get("image")))
    try:
        here: Image | None = images.get(name, check_base=False)
    except ImageNotFound:
        here = None
    if here is not None and here.digest == desc.get("image_digest"):
        return desc
    peer = await asyncio.to_thread(describe_peer, name)
    if peer.get("digest") != desc.get("image_digest") or peer.get("name") != name:
        return desc  # replaced there since: the import says the snapshot does not fit
    if peer.get("kind", "built") == "built":
        if here is None:
            await pull_image(fetcher, peer, open_layer)
        return desc  # or another build of it here: the import says so
    root = await root_travel.pull_root(fetcher, peer.get("content"), open_layer, meta=peer,
                                      name=None if here is not None else name, keep_it=True)
    return {**desc, "image": root.name}
