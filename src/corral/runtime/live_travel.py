"""Live snapshots that travel: a checkpoint's CRIU images fetched from the node that
took it (docs/live.md).

A live snapshot is a snapshot of files (its layers travel as any snapshot's do,
:mod:`corral.runtime.layer_fetch`) plus CRIU's images of its processes in
``STATE/checkpoints/<tenant>/<snapshot id>`` (:mod:`corral.runtime.checkpoint`). To
restore it on another node, that node:

- compares the holder's kernel release and CRIU build (:func:`describe`) with its own,
  and refuses a mismatch typed (:class:`~corral.errors.Unsupported`, ``cause:
  live_mismatch``, naming both sides): CRIU restores only onto the kernel and build
  that dumped;
- fetches the images as one tree in the form roots travel in (:mod:`corral.runtime.layer_wire`,
  ``root_form``: no device node, setuid bit or extended attribute; the ACL entries a
  restore gives its files are not part of it) into a fresh temporary directory of the
  layer store, checked against the digest the holder described, nothing kept on a
  mismatch), refuses a tree that is not a flat directory of plain files, makes it
  root's (0700, files 0600) and moves it in by one rename, before the snapshot's row
  is registered (a row here means its images are here);
- then restores as from a local checkpoint: the restore path treats every image as
  hostile input (:mod:`corral.runtime.live_images`), wherever it came from.

The holder serves the images only to the cluster's peer credential, for the tenant
that owns the snapshot (another tenant's answers as not found), by snapshot id:
never by a digest or a path.
"""

from __future__ import annotations

import os
import shutil
import stat
from collections.abc import Iterable
from contextlib import AbstractContextManager
from pathlib import Path
from typing import Any, Callable

from corral.errors import InvalidArgument, LayerTransferError, Unsupported
from corral.runtime import checkpoint, criu, layer_wire
from corral.runtime.layers import TREE, LayerStore, tree_digest

OpenImages = Callable[[str, int], AbstractContextManager[Iterable[bytes]]]
SLACK_BYTES = 16 << 20  # tar headers, beyond the images' disk usage
MAX_FILES = 4096  # CRIU writes a few files per task: a sandbox has up to its pids limit


def host_build(cache_dir: Path) -> dict[str, str]:
    """This node's kernel release and CRIU build (``4.2.1-corral1``; ``none``)."""
    found = criu.find(cache_dir)
    build = "none" if found is None else (
        found.version_text + (f"-corral{found.patch_level}" if found.patch_level else ""))
    return {"kernel": os.uname().release, "criu": build}


def describe(images: Path, cache_dir: Path) -> dict[str, Any]:
    """What another node needs to fetch and restore the images ``images``: their tree's
    digest and size, and the kernel and CRIU that dumped them. Blocking (it hashes)."""
    digest, size = tree_digest(images, root_form=True)
    return {"digest": digest, "size_bytes": size, **host_build(cache_dir)}


def checked(live: Any, sid: str, holder: str | None, cache_dir: Path) -> dict[str, Any]:
    """The peer's description of ``sid``'s images, checked, if this node can restore
    them; :class:`Unsupported` (``cause: live_mismatch``) naming both sides if its
    kernel or CRIU build differs."""
    if not isinstance(live, dict):
        raise InvalidArgument(f"the peer described live snapshot {sid} without its images")
    digest = layer_wire.check_digest(live.get("digest"))
    size = live.get("size_bytes")
    if not isinstance(size, int) or size < 0:
        raise InvalidArgument(f"live snapshot {sid}: invalid size {str(size)[:40]!r}")
    theirs = {k: str(live.get(k))[:120] for k in ("kernel", "criu")}
    ours = host_build(cache_dir)
    if theirs != ours:
        where = f"node {holder[:80]}" if holder else "the node that took it"
        raise Unsupported(
            f"live snapshot {sid} was taken on {where} with kernel {theirs['kernel']} and "
            f"CRIU {theirs['criu']}; this node has kernel {ours['kernel']} and CRIU "
            f"{ours['criu']}: CRIU restores only onto the kernel and build that dumped. "
            "Restore it on a node that matches (or on its own node), or give every node "
            f"the same kernel and CRIU ({criu.BUILD})",
            details={"snapshot_id": sid, "cause": "live_mismatch", "node": holder,
                     "theirs": theirs, "ours": ours})
    return {"digest": digest, "size_bytes": size}


def receive(store: LayerStore, state_dir: Path, tenant: str | None, sid: str,
            live: dict[str, Any], open_images: OpenImages) -> Path:
    """Fetch ``sid``'s images (``live``: :func:`checked`) into
    ``STATE/checkpoints/<tenant>/<sid>``, through a temporary directory of ``store``
    (the snapshots' layer store, under the state directory too: what a crash leaves
    there is swept when the engine opens it); nothing is left on any failure. Blocking."""
    target = checkpoint.images_root(state_dir, tenant) / sid
    if target.is_dir():
        return target
    digest, size = live["digest"], live["size_bytes"]
    with open_images(digest, size) as chunks:
        sealed, _ = layer_wire.receive_tree(store, digest, chunks,
                                            max_bytes=2 * size + SLACK_BYTES, need_bytes=size,
                                            root_form=True)
    try:
        tree = sealed.tmp / TREE
        _flat_files(tree, sid)
        for entry in tree.iterdir():
            os.chown(entry, 0, 0, follow_symlinks=False)
            os.chmod(entry, 0o600)
        os.chown(tree, 0, 0)
        os.chmod(tree, 0o700)
        try:
            tree.rename(target)
        except OSError:
            if not target.is_dir():
                raise
    finally:
        store.discard(sealed.tmp)
    return target


def _flat_files(tree: Path, sid: str) -> None:
    """:class:`LayerTransferError` unless ``tree`` is what a dump writes: plain files,
    no subdirectory, link, FIFO or device, each with one name."""
    count = 0
    for entry in os.scandir(tree):
        st = entry.stat(follow_symlinks=False)
        count += 1
        if not stat.S_ISREG(st.st_mode) or st.st_nlink != 1 or count > MAX_FILES:
            raise LayerTransferError(
                f"live snapshot {sid}: the peer's images hold {entry.name[:80]!r}, which is "
                "not what a checkpoint holds (plain files only): refused and deleted",
                details={"snapshot_id": sid, "path": entry.name[:80]})


def remove(state_dir: Path, tenant: str | None, sid: str) -> None:
    """Undo :func:`receive` (the snapshot's row could not be registered)."""
    shutil.rmtree(checkpoint.images_root(state_dir, tenant) / sid, ignore_errors=True)
