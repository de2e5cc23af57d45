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

The root image (``python``, or an imported one) does not travel: it must be on the
node already with the same digest (every node builds the default ``python`` image
itself, and hosts that built it apart differ: give them one image cache), else
:class:`~corral.errors.InvalidState` says so (and the cluster client keeps the image's
sandboxes on the nodes that have it).
"""

from __future__ import annotations

import asyncio
import os
from typing import Any

from corral.errors import ImageNotFound, InvalidArgument, InvalidState
from corral.image_schema import validate_image_name
from corral.runtime import image_cache
from corral.runtime.images import Image, ImageStore
from corral.runtime.layer_fetch import LayerFetcher, OpenLayer, layers_of

_KEPT = ("digest", "size_bytes", "python", "base", "root", "env", "workdir", "source")


def describe_image(images: ImageStore, name: str) -> dict[str, Any]:
    """What another node needs to pull the image ``name``: its manifest, for a built
    image; :class:`InvalidState` for a root filesystem (those do not travel)."""
    image = images.get(name)
    if image.kind != "built":
        raise InvalidState(
            f"image {name!r} is a root filesystem ({image.kind}), which does not travel "
            "between nodes: import it on every node, or build on it (a built image travels)",
            details={"image": name},
        )
    manifest = images.manifest(name)
    return {"name": name, **{k: manifest.get(k) for k in _KEPT},
            "layers": list(manifest.get("layers") or [])}


async def pull_image(fetcher: LayerFetcher, desc: dict[str, Any], open_layer: OpenLayer
                     ) -> Image:
    """Publish here the built image a peer described, fetching the layers it lacks.
    Idempotent: an image here with the same digest is left as it is; concurrent pulls
    of one image share one."""
    name = validate_image_name(str(desc.get("name")))
    image: Image = await fetcher.once(f"image:{name}", lambda: _pull(fetcher, desc, open_layer))
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
    if here is None or here.digest != root.get("digest"):
        raise InvalidState(
            f"image {name!r} was built on image {root.get('image')!r} "
            f"({root.get('digest')}), which this node "
            + ("does not have" if here is None else f"has as another build ({here.digest})")
            + ": give every node the same root image (one image cache), or build the "
            "image on this node",
            details={"image": name, "root": root.get("image")},
        )
    layers = layers_of(desc)
    store = image_cache.layer_store(images.images_dir)
    lock = await asyncio.to_thread(image_cache.hold_build_lock, images.images_dir)
    try:  # no collection while layers are here without the manifest that keeps them
        for lid, layer_digest, size in layers:
            if not store.path(lid).is_dir():
                await fetcher.fetch(store, layer_digest, size, open_layer)
        manifest = {k: desc.get(k) for k in _KEPT}
        manifest["layers"] = [{"id": lid, "digest": d, "size_bytes": size}
                              for lid, d, size in layers]
        return await asyncio.to_thread(images.publish_built, name, manifest)
    finally:
        os.close(lock)
