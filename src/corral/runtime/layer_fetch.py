"""Snapshots that travel: restore on this node a snapshot taken on another.

A snapshot is an image plus a chain of content-addressed layers
(:mod:`corral.runtime.snapshots`). To restore one taken elsewhere, this node reads the
snapshot's description from the daemon that holds it (:func:`describe` there), fetches
every layer of its chain it does not have (:mod:`corral.runtime.layer_wire`, each
checked against its digest), and registers the snapshot under the same id and name,
as if taken here. Each layer crosses the network once per node: one that is here
already is not fetched, and concurrent first uses of a layer share one fetch.

The network is the caller's (the daemon's peer client, :mod:`corral.server.peer_layers`):
this module gets ``open_layer(digest, size_bytes)``, a context manager over the
layer's stream of bytes.

Example::

    fetcher = LayerFetcher(engine.snapshots)
    info = await fetcher.import_snapshot(description, open_layer)
    await engine.create(SandboxSpec(snapshot=info.id))
"""

from __future__ import annotations

import asyncio
import re
import sqlite3
from collections.abc import Awaitable, Callable, Iterable
from contextlib import AbstractContextManager
from dataclasses import dataclass, field
from typing import Any

from corral.errors import InvalidArgument, InvalidState, Unsupported
from corral.runtime import image_cache, layer_wire, live_travel
from corral.runtime.layers import Layer, LayerStore, is_pending, layer_id
from corral.runtime.registry import SnapshotRow
from corral.runtime.snapshots import Snapshots
from corral.schema import SandboxSpec, SnapshotInfo

OpenLayer = Callable[[str, int], AbstractContextManager[Iterable[bytes]]]
SLACK_BYTES = 64 << 20  # tar headers of small entries, beyond a layer's disk usage
SNAPSHOT_ID = re.compile(r"snap-[0-9a-f]{12}")


@dataclass
class FetchStats:
    """What crossed the network to this daemon: layers fetched and their bytes."""

    layers: int = 0
    bytes: int = 0
    by_digest: dict[str, int] = field(default_factory=dict)  # digest -> times fetched

    def json(self) -> dict[str, Any]:
        return {"layers": self.layers, "bytes": self.bytes, "by_digest": dict(self.by_digest)}

    def count(self, digest: str, received: int) -> None:
        """One tree fetched: ``digest``, ``received`` bytes of stream."""
        self.layers += 1
        self.bytes += received
        self.by_digest[digest] = self.by_digest.get(digest, 0) + 1


def describe(snapshots: Snapshots, ref: str, owner: str | None) -> dict[str, Any]:
    """What another node needs to restore ``owner``'s snapshot ``ref``: its row, and its
    layers with their digests and sizes."""
    info = snapshots.get(ref, owner=owner)
    row = snapshots.registry.snapshot(info.id)
    assert row is not None
    sizes = snapshots.registry.layer_rows(row.layers)
    if any(is_pending(sizes[i][0]) for i in row.layers if i in sizes):
        raise InvalidState(  # its digest is not computed yet: Snapshots.settled() first
            f"snapshot {row.id} is still being committed: ask again in a moment",
            details={"snapshot_id": row.id, "cause": "settling"})
    return {
        "id": row.id, "name": row.name, "image": row.image, "image_digest": row.image_digest,
        "created_at": row.created_at, "size_bytes": row.size_bytes,
        "source_sandbox": row.source_sandbox, "spec": row.spec.model_dump(mode="json"),
        "layers": [{"id": i, "digest": sizes[i][0], "size_bytes": sizes[i][1]}
                   for i in row.layers],
    }


def refuse_live(desc: dict[str, Any], holder: str | None) -> None:
    """:class:`Unsupported` (``cause: live_elsewhere``) for a live snapshot taken on
    another node, imported with no way to fetch its process images (CRIU's,
    :mod:`corral.runtime.live_travel`): a copy of its files alone would start none of
    its processes, silently."""
    if desc.get("kind") != "live":
        return
    sid, where = str(desc.get("id"))[:40], f"node {holder[:80]}" if holder else "its node"
    raise Unsupported(
        f"snapshot {sid} is live (its processes' memory is on {where}, which took it): "
        "restore it there (Sandbox.create(snapshot=..., node=...) on that node, or fork "
        "the sandbox there); a snapshot of its files (sb.snapshot(), `corral snapshot "
        "create` without --live) travels to any node",
        details={"snapshot_id": sid, "cause": "live_elsewhere", "node": holder})


def layer_path_for(snapshots: Snapshots, digest: str) -> Any:
    """The tree of the layer ``digest`` if a snapshot or a built image here holds it,
    else None: a peer reads only layers known to this daemon, by digest, never a path."""
    layer_wire.check_digest(digest)
    # a snapshot's own layer is named at random (LayerStore.install_unsealed)
    lid = snapshots.registry.layer_by_digest(digest) or layer_id(digest)
    row = snapshots.registry.layer_rows([lid]).get(lid)
    if row is not None and row[0] == digest:
        path = snapshots.store.path(lid)
    elif any(isinstance(x, dict) and x.get("digest") == digest
             for m in image_cache.manifests(snapshots.images.images_dir).values()
             for x in m.get("layers") or ()):
        path = image_cache.layer_store(snapshots.images.images_dir).path(lid)
    else:
        return None
    return path if path.is_dir() else None


class LayerFetcher:
    """This daemon's fetches of snapshots' layers from peers (one per engine)."""

    def __init__(self, snapshots: Snapshots) -> None:
        self.snapshots = snapshots
        self.stats = FetchStats()
        self._inflight: dict[tuple[str, str], asyncio.Future[Layer]] = {}
        self._shared: dict[str, asyncio.Future[Any]] = {}

    async def import_snapshot(self, desc: dict[str, Any], open_layer: OpenLayer,
                              holder: str | None = None,
                              open_images: OpenLayer | None = None) -> SnapshotInfo:
        """Register here the snapshot ``desc`` (:func:`describe` of a peer, the node
        ``holder``'s), fetching the layers of its chain this node lacks. Idempotent;
        concurrent imports share one. A live snapshot (``desc["kind"]``) comes with its
        process images through ``open_images`` (:mod:`corral.runtime.live_travel`: on
        a node of the same kernel and CRIU only); without it, :func:`refuse_live`."""
        sid = desc.get("id")
        if not isinstance(sid, str) or not SNAPSHOT_ID.fullmatch(sid):
            raise InvalidArgument(f"the peer described no valid snapshot id ({str(sid)[:80]!r})")
        live = None
        if desc.get("kind") == "live":
            if open_images is None:
                refuse_live(desc, holder)
            live = live_travel.checked(desc.get("live"), sid, holder,
                                       self.snapshots.layout.cache_dir)
        here = self.snapshots.registry.snapshot(sid)
        if here is not None:
            return here.info()
        info: SnapshotInfo = await self.once(
            sid, lambda: self._import(sid, desc, open_layer, live, open_images))
        return info

    async def once(self, key: str, work: Callable[[], Awaitable[Any]]) -> Any:
        """``work()``, or the result of the same ``key``'s work already under way."""
        running = self._shared.get(key)
        if running is None:
            running = asyncio.ensure_future(work())
            self._shared[key] = running
            running.add_done_callback(lambda _f: self._shared.pop(key, None))
        return await asyncio.shield(running)

    async def _import(self, sid: str, desc: dict[str, Any], open_layer: OpenLayer,
                      live: dict[str, Any] | None = None,
                      open_images: OpenLayer | None = None) -> SnapshotInfo:
        layers = layers_of(desc)
        image = self.snapshots.images.get(str(desc.get("image")))
        if image.digest != desc.get("image_digest"):
            raise InvalidState(
                f"snapshot {sid} was taken on image {image.name!r} as it is on another node "
                f"({desc.get('image_digest')}); this node's {image.name!r} differs "
                f"({image.digest}): give every node the same image (build or import it "
                "through the cluster), then restore",
                details={"snapshot_id": sid, "image": image.name},
            )
        spec = SandboxSpec.parse(desc.get("spec") or {})
        known = self.snapshots.registry.layer_rows([x[0] for x in layers])
        for lid, digest, size in layers:
            if known.get(lid, ("",))[0] == digest and self.snapshots.store.path(lid).is_dir():
                continue
            await self.fetch(self.snapshots.store, digest, size, open_layer)
        if live is not None and open_images is not None:  # before its row: a row, its images
            state_dir = self.snapshots.layout.state_dir
            self.snapshots.check_quota(spec.tenant, {f"live:{sid}": live["size_bytes"]})
            await asyncio.to_thread(live_travel.receive, self.snapshots.store, state_dir,
                                    spec.tenant, sid, live, open_images)
            self.stats.count(live["digest"], live["size_bytes"])
        try:
            return await self._register(sid, desc, image, layers, spec)
        except BaseException:
            if live is not None:
                await asyncio.to_thread(live_travel.remove, self.snapshots.layout.state_dir,
                                        spec.tenant, sid)
            raise

    async def _register(self, sid: str, desc: dict[str, Any], image: Any,
                        layers: list[tuple[str, str, int]], spec: SandboxSpec) -> SnapshotInfo:
        async with self.snapshots._lock:  # no gc between the layers' install and their rows
            row = SnapshotRow(
                id=sid, name=desc.get("name"), image=image.name, image_digest=image.digest,
                layers=[x[0] for x in layers], created_at=float(desc.get("created_at") or 0),
                size_bytes=int(desc.get("size_bytes") or 0),
                source_sandbox=desc.get("source_sandbox"), spec=spec,
            )
            try:
                self.snapshots.registry.add_snapshot(row, layers[0], below=layers[1:])
            except sqlite3.IntegrityError:
                other = self.snapshots.registry.snapshot(sid)
                if other is not None and other.id == sid:
                    return other.info()
                raise InvalidState(
                    f"snapshot {sid} cannot be restored here: this node has another snapshot "
                    f"named {row.name!r}: delete or rename it", details={"snapshot_id": sid},
                ) from None
        for lid, _, _ in layers:
            self.snapshots._mark_checked(lid)  # verified against its digest as it arrived
        return row.info()

    async def fetch(self, store: LayerStore, digest: str, size: int,
                    open_layer: OpenLayer) -> Layer:
        """Fetch one layer into ``store``; a fetch of the same one under way is shared."""
        key = (str(store.root), digest)
        running = self._inflight.get(key)
        if running is None:
            running = asyncio.ensure_future(asyncio.to_thread(self._fetch_now, store, digest,
                                                              size, open_layer))
            self._inflight[key] = running
            running.add_done_callback(lambda _f: self._inflight.pop(key, None))
        return await asyncio.shield(running)

    def _fetch_now(self, store: LayerStore, digest: str, size: int,
                   open_layer: OpenLayer) -> Layer:
        with open_layer(digest, size) as chunks:
            layer, received = layer_wire.receive(
                store, digest, chunks, max_bytes=2 * size + SLACK_BYTES, need_bytes=size,
            )
        self.stats.count(digest, received)
        return layer


def layers_of(desc: dict[str, Any]) -> list[tuple[str, str, int]]:
    """``[(id, digest, size)]`` of a peer's description, checked (ids from digests)."""
    raw = desc.get("layers")
    if not isinstance(raw, list) or not raw or len(raw) > 64:
        raise InvalidArgument("the peer described a snapshot without a valid chain of layers")
    out = []
    for x in raw:
        digest = layer_wire.check_digest(x.get("digest") if isinstance(x, dict) else None)
        size = x.get("size_bytes")
        if not isinstance(size, int) or size < 0:
            raise InvalidArgument(f"layer {digest}: invalid size {str(size)[:40]!r}")
        out.append((layer_id(digest), digest, size))
    return out
