"""A root pulled from a peer for a built image (``root-<hex>``, :mod:`corral.runtime.root_travel`)
stays while an image is built on it or a mount holds it (a sandbox's lower layer), and
goes with the collection after that; a root of this node's own is never collected.

The mount that holds it is a real bind mount of its ``rootfs`` in a mount namespace of
its own (what a sandbox's launcher makes of its lower layers), read back by
:func:`image_cache.mounted_lowers`.
"""

from __future__ import annotations

import os
import subprocess

import pytest

from corral.runtime import image_cache, root_travel
from corral.runtime.images import ImageStore
from corral.runtime.layers import tree_digest
from tests.conftest import requires_root

pytestmark = requires_root  # a bind mount


def _tree(path):
    (path / "etc").mkdir(parents=True)
    (path / "etc/os-release").write_text("ID=test\n")
    return path


def test_a_pulled_root_lives_as_long_as_its_users(tmp_path):
    images = ImageStore(tmp_path / "images")
    image_cache.layer_store(images.images_dir)  # as after a pull: layers fetched
    own = images.add_rootfs("python", _tree(tmp_path / "own"))
    content, size = tree_digest(_tree(tmp_path / "peer"), root_form=True)
    name = root_travel.internal_name(content)
    root = images.add_rootfs(name, tmp_path / "peer", move=True, extra={
        root_travel.PULLED: True, root_travel.CONTENT: {"digest": content, "size_bytes": size}})
    assert root_travel.find_root(images, content) == root
    assert root_travel.root_path_for(images, content) == root.rootfs
    for built in ("b1", "b2"):
        images.publish_built(built, {"root": {"image": name, "digest": root.digest},
                                     "layers": [], "digest": "sha256:" + "0" * 64,
                                     "size_bytes": 0, "python": None})
    mnt = tmp_path / "mnt"
    mnt.mkdir()
    images.remove("b1")
    assert images.exists(name)  # b2 is built on it
    holder = subprocess.Popen(  # in a mount namespace of its own, as a sandbox's
        ["unshare", "--mount", "--propagation", "private", "sh", "-c",
         f"mount --bind {root.rootfs} {mnt} && echo ready && exec sleep 60"],
        stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout is not None and holder.stdout.readline() == "ready\n"
        images.remove("b2")  # collects: but a sandbox (the mount) holds the root
        assert images.exists(name)
    finally:
        holder.kill()
        holder.wait()
    assert name in image_cache.collect(images.images_dir)
    assert not images.exists(name) and images.get("python") == own  # its own: kept
    assert not [n for n in os.listdir(images.images_dir) if n.startswith((".tmp-", "root-"))]
    assert root_travel.find_root(images, content) is None


def test_a_content_digest_is_computed_once_and_kept(tmp_path):
    images = ImageStore(tmp_path / "images")
    image = images.add_rootfs("imp", _tree(tmp_path / "t"))
    first = root_travel.content_of(images, "imp")
    assert first["digest"] == tree_digest(image.rootfs, root_form=True)[0]
    assert images.manifest("imp")[root_travel.CONTENT] == first
    assert images.get("imp").digest == image.digest  # the image's own digest unchanged
    with pytest.raises(Exception, match="not a root filesystem"):
        images.publish_built("b", {"root": {"image": "imp", "digest": image.digest},
                                   "layers": [], "digest": "sha256:" + "1" * 64,
                                   "size_bytes": 0, "python": None})
        root_travel.content_of(images, "b")


def test_a_root_pulled_for_a_snapshot_is_kept_before_any_collection_can_run(tmp_path):
    """The race: a snapshot's root is pulled (or found already pulled for a built image),
    and a collection (any build or image removal, which a tenant can start) runs before
    the snapshot is registered on it. Returned kept, the root survives it."""
    import asyncio
    import contextlib

    from corral.runtime import layer_wire
    from corral.runtime.layer_fetch import LayerFetcher
    from corral.runtime.paths import Layout
    from corral.runtime.registry import Registry
    from corral.runtime.snapshots import Snapshots

    layout = Layout.create(tmp_path / "state", tmp_path / "cache")
    images = ImageStore(layout.cache_dir / "images")
    fetcher = LayerFetcher(Snapshots(layout, Registry(tmp_path / "reg.db"), images))
    peer = _tree(tmp_path / "peer")
    (peer / "bin").mkdir()
    os.chmod(peer, 0o755)
    content, size = tree_digest(peer, root_form=True)
    data = b"".join(layer_wire.stream(peer, root_form=True))
    fetched: list[str] = []

    @contextlib.contextmanager
    def open_layer(digest, _size):
        fetched.append(digest)
        yield [data]

    meta = {"kind": "rootfs", "digest": "sha256:" + "ab" * 32}
    desc = {"digest": content, "size_bytes": size}
    # already here for a built image (marked pulled), as the snapshot asks for it
    first = asyncio.run(root_travel.pull_root(fetcher, desc, open_layer, meta=meta))
    images.publish_built("b", {"root": {"image": first.name, "digest": first.digest},
                               "layers": [], "digest": "sha256:" + "0" * 64,
                               "size_bytes": 0, "python": None})
    root = asyncio.run(root_travel.pull_root(fetcher, desc, open_layer, meta=meta,
                                             keep_it=True))
    assert root.name == first.name and fetched == [content]  # found, not fetched again
    images.remove("b")  # collects: the one user the collection can see goes
    assert images.exists(root.name), "collected between the pull and its snapshot"
    assert root_travel.PULLED not in images.manifest(root.name)
