"""Snapshots that travel across a cluster, for :class:`~._router.AsyncRouter`.

A snapshot is taken on one node, an image is built on one node; a sandbox made from
either may be placed on any node (by free capacity, or ``node=``). Before that create, the node is asked to make the
snapshot restorable there (``POST /v1/cluster/snapshots/fetch``, naming the node that
holds it; a tenant may ask for its own): its daemon fetches the layers it lacks straight
from the holder's daemon with the cluster's peer credential,
each checked against its digest, once per node (:mod:`corral.server.peer_layers`). The
snapshot then has the same id and name on both nodes; deleting it through the cluster
deletes every copy, and lists show it once. A built image is pulled the same way
(``POST /v1/cluster/images/fetch``) the first time a sandbox of it lands on a node without
it, and so is a root filesystem image (imported on one node), or a built image's root
that the node lacks (:mod:`corral.runtime.root_travel`): placement is free of where
images are.
"""

from __future__ import annotations

from typing import Any

from corral.api.operations import request_line
from corral.client._async._cluster_view import ClusterView
from corral.cluster.directory import Node
from corral.errors import DaemonUnavailable, SnapshotNotFound

FETCH_TIMEOUT_S = 900.0  # a big chain of layers over a slow link


async def bring_snapshot(router: ClusterView, target: Node, ref: str) -> None:
    """Make the snapshot ``ref`` restorable on ``target``: nothing if it is there
    already (remembered per client), else fetched from a node that holds it."""
    known = router.snapshots_at
    if (target.node_id, ref) in known:
        return
    try:
        await router._on(target, *request_line("get_snapshot", id_or_name=ref), {}, False, None)
    except SnapshotNotFound:
        holder = await router._holder_of(ref)
        if holder.node_id != target.node_id:  # else: none has it, and the create says so
            body = {"snapshot": ref, "node": holder.node_id}
            await router._on(target, *request_line("fetch_own_snapshot"),
                             {"json": body, "timeout": FETCH_TIMEOUT_S}, False, None)
    known.add((target.node_id, ref))


async def bring_image(router: ClusterView, target: Node, image: str) -> Node:
    """Make the image ``image`` usable on ``target``, pulled from a node that has it
    (built images and root filesystems travel); returns ``target``, the node to create
    on."""
    nodes = await router._refresh_loads()
    if image in router._images.get(target.node_id, ()):
        return target
    holders = [n for n in nodes if image in router._images.get(n.node_id, ())]
    if not holders:  # built a moment ago? ask the nodes again, once
        router._loaded_at = float("-inf")
        nodes = await router._refresh_loads()
        holders = [n for n in nodes if image in router._images.get(n.node_id, ())]
    if image in router._images.get(target.node_id, ()) or not holders:
        return target  # there now, or no node has it (the create says ImageNotFound)
    body = {"image": image, "node": holders[0].node_id}
    await router._on(target, *request_line("fetch_own_image"),
                     {"json": body, "timeout": FETCH_TIMEOUT_S}, False, None)
    router._images.setdefault(target.node_id, set()).add(image)
    return target


async def delete_everywhere(router: ClusterView, path: str, kwargs: dict[str, Any]) -> None:
    """Delete a snapshot on every node that has a copy (idempotent)."""
    nodes = await router.alive_nodes()
    for reply in await router._each(nodes, "DELETE", path, kwargs):
        if isinstance(reply, BaseException) and not isinstance(
            reply, (SnapshotNotFound, DaemonUnavailable)
        ):
            raise reply
    router.snapshots_at.clear()


def once_each(items: list[Any]) -> list[Any]:
    """A merged list of snapshots with each id once (copies on several nodes)."""
    seen: set[str] = set()
    out = []
    for item in items:
        if item.get("id") not in seen:
            seen.add(item.get("id"))
            out.append(item)
    return out
