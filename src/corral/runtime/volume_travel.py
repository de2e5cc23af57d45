"""Volumes that travel: made on one node, mounted by sandboxes on any node of a cluster.

A volume has a *home*, the node it was made on (where the cluster client sends
``corral volume create``). A sandbox placed on another node that mounts it ``ro`` or
``cow`` gets a *copy* there: the node's daemon asks the home's daemon to describe the
volume (:func:`describe`, as the tenant that owns it: another tenant's answers as one
that does not exist) and fetches its tree by the digest of its content, through the
same peer path as image layers and root images (``/v1/peer/layers/{digest}``,
:mod:`corral.runtime.layer_wire` in its strict root form: no device node, no setuid
bit, no foreign xattr; checked against the digest as it arrives; nothing left on a
failure). Each version crosses once per node; concurrent first uses share one fetch.

- The content digest (:func:`~corral.runtime.layers.tree_digest` of the volume's tree)
  is computed the first time a peer asks and kept in the volume's ``meta.json``; a
  sandbox mounting the volume ``rw`` drops it (the next peer's question hashes the new
  generation). While a writer runs, the home refuses to describe it
  (:class:`~corral.errors.InvalidState`): a copy is never taken of files that change.
- A copy is read-only as far as the volume goes: ``cow`` writes stay in each
  sandbox's own layer, as at home, and ``rw`` is refused on a copy (the cluster client
  places a sandbox that mounts a volume ``rw`` on its home).
- A copy follows its home: fetched again when the home's content differs and no
  sandbox on its node mounts the old one (a sandbox that does keeps it, and so does
  the next create there until it ends).
- A peer reads a volume's tree only by a digest this daemon described (never a name,
  never a path), with the cluster's peer credential, never a tenant's.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

from corral.errors import InvalidArgument, InvalidState, LayerTransferError, VolumeNotFound
from corral.runtime import layer_wire
from corral.runtime.layer_fetch import SLACK_BYTES, LayerFetcher, OpenLayer
from corral.runtime.layers import TREE, LayerStore, tree_digest
from corral.runtime.root_travel import kept_content
from corral.runtime.volumes import (
    ADMIN_DIR,
    CONTENT,
    GENERATION,
    MAX_MB,
    META,
    MIN_MB,
    Volumes,
    check_name,
)
from corral.volume_schema import VolumeInfo


def content_of(volumes: Volumes, owner: str | None, name: str) -> dict[str, Any]:
    """``{"digest", "size_bytes"}`` of the volume's tree as it travels: kept, else
    computed (blocking: a thread; it reads every file once) and kept unless a writer
    mounted it meanwhile."""
    meta = volumes.meta(owner, name)
    found = kept_content(meta)
    if found is not None:
        return found
    volumes.ensure_mounted(owner, name)
    digest, size = tree_digest(volumes.data_dir(owner, name), root_form=True)
    content = {"digest": digest, "size_bytes": size}
    with volumes._lock:
        now = volumes.meta(owner, name)
        if now.get(GENERATION) == meta.get(GENERATION) and now.get("created_at") == meta.get(
                "created_at"):
            volumes.set_meta(owner, name, {**now, CONTENT: content})
    return content


def describe(volumes: Volumes, owner: str | None, name: str, *, writing: bool) -> dict[str, Any]:
    """What another node needs to copy ``owner``'s volume ``name`` (blocking: the first
    description hashes it). ``writing``: a sandbox here mounts it ``rw`` now."""
    info = volumes.get(owner, name)
    if writing:
        raise InvalidState(
            f"volume {name!r} is mounted rw by a running sandbox on its node: its files are "
            "changing, so no other node gets a copy until that sandbox ends (or mount it "
            "on this node)", details={"volume": name, "cause": "writer"})
    return {**info.model_dump(mode="json"), "content": content_of(volumes, owner, name)}


def volume_path_for(volumes: Volumes, digest: str) -> Path | None:
    """The tree of a volume here whose described content is ``digest``, else None."""
    layer_wire.check_digest(digest)
    if not volumes.root.is_dir():
        return None
    for owner_dir in sorted(volumes.root.iterdir()):
        if owner_dir.name.startswith(".") or not owner_dir.is_dir():
            continue
        for d in sorted(owner_dir.iterdir()):
            try:
                meta = json.loads((d / META).read_text())
            except (OSError, ValueError):
                continue
            if not d.name.startswith(".") and (kept_content(meta) or {}).get("digest") == digest:
                owner = None if owner_dir.name == ADMIN_DIR else owner_dir.name
                volumes.ensure_mounted(owner, d.name)  # a capped one, after a reboot
                return d / "data"
    return None


def _checked(desc: dict[str, Any], name: str) -> tuple[str, int, int | None]:
    """The digest, size and max_mb of a peer's description of the volume ``name``."""
    content, max_mb = desc.get("content"), desc.get("max_mb")
    if desc.get("name") != name or not isinstance(content, dict):
        raise LayerTransferError(f"the peer described another volume than {name!r}, or "
                                 "none: refused (a broken or hostile peer)",
                                 details={"volume": name})
    digest = layer_wire.check_digest(content.get("digest"))
    size = content.get("size_bytes")
    if (not isinstance(size, int) or isinstance(size, bool) or not 0 <= size < 1 << 62
            or not (max_mb is None or isinstance(max_mb, int) and not isinstance(max_mb, bool)
                    and MIN_MB <= max_mb <= MAX_MB)):
        raise InvalidArgument(f"the peer described volume {name!r} with an invalid size or "
                              "max_mb: refused (a broken or hostile peer)",
                              details={"volume": name})
    return digest, size, max_mb


async def pull(fetcher: LayerFetcher, volumes: Volumes, owner: str | None, name: str,
               desc: dict[str, Any], open_layer: OpenLayer, *, node: str,
               in_use: Callable[[], bool],
               check: Callable[[str | None, int], None] | None = None) -> VolumeInfo:
    """``owner``'s volume ``name`` usable here, as the daemon of ``node`` described it
    (``desc``: :func:`describe` there): a volume made here is left alone; a copy of
    the same content is kept; else its tree is fetched (``open_layer``) and published
    as a copy (replacing an older one unless ``in_use()``: a sandbox here mounts it)."""
    check_name(name)
    digest, size, max_mb = _checked(desc, name)
    home = desc.get("home") if isinstance(desc.get("home"), str) else node
    try:
        here: VolumeInfo | None = volumes.get(owner, name)
    except VolumeNotFound:
        here = None
    if here is not None:
        same = (kept_content(volumes.meta(owner, name)) or {}).get("digest") == digest
        if here.home is None or same or in_use():
            return here
    info: VolumeInfo = await fetcher.once(
        f"volume:{owner}:{name}:{digest}",
        lambda: asyncio.to_thread(_pull_now, fetcher, volumes, owner, name, digest, size,
                                  max_mb, open_layer, str(home)[:128], check))
    return info


def _pull_now(fetcher: LayerFetcher, volumes: Volumes, owner: str | None, name: str,
              digest: str, size: int, max_mb: int | None, open_layer: OpenLayer, home: str,
              check: Callable[[str | None, int], None] | None) -> VolumeInfo:
    store = LayerStore(volumes.owner_root(owner))  # its temporary trees: ".tmp-..."
    with open_layer(digest, size) as chunks:
        sealed, received = layer_wire.receive_tree(
            store, digest, chunks, max_bytes=2 * size + SLACK_BYTES, need_bytes=size,
            root_form=True)
    try:
        info = volumes.adopt(owner, name, sealed.tmp / TREE, home=home,
                             content={"digest": digest, "size_bytes": size}, max_mb=max_mb,
                             check=check)
    finally:
        if sealed.tmp.exists():
            store.discard(sealed.tmp)
    fetcher.stats.count(digest, received)
    return info

