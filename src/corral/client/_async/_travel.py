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
images are. A volume made on one node (its home) is copied the same way
(``POST /v1/cluster/volumes/fetch``) to a node a sandbox that mounts it ``ro`` or ``cow``
lands on; a sandbox that mounts one ``rw`` is placed on the volume's home
(:mod:`corral.runtime.volume_travel`).
"""

from __future__ import annotations

from typing import Any

from corral.api.operations import request_line
from corral.client._async._cluster_view import ClusterView
from corral.cluster.directory import Node
from corral.errors import DaemonUnavailable, SnapshotNotFound, VolumeNotFound
from corral.volume_schema import parse_mount

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


def _named_volumes(volumes: Any, modes: tuple[str, ...] = ("cow", "ro", "rw")) -> list[str]:
    """The volumes (not host directories) a spec's ``volumes`` mounts in ``modes``
    (a malformed entry is left to the daemon, which says what is wrong)."""
    names = set()
    for value in (volumes or {}).values() if isinstance(volumes, dict) else ():
        try:
            source, mode = parse_mount(str(value))
        except ValueError:
            continue
        if not source.startswith("/") and mode in modes:
            names.add(source)
    return sorted(names)


async def volume_home(router: ClusterView, name: str) -> Node | None:
    """The node whose own volume ``name`` is (not a copy), or None if none has it."""
    nodes = await router.alive_nodes()
    replies = await router._each(nodes, *request_line("get_volume", name=name), {})
    for n, reply in zip(nodes, replies, strict=True):
        if not isinstance(reply, BaseException) and reply.json().get("home") is None:
            return n
    return None


async def rw_home(router: ClusterView, volumes: Any) -> str | None:
    """The node a sandbox mounting ``volumes`` must go to: the home of a volume it
    mounts ``rw`` (a copy is never written), else None (placed by room)."""
    for name in _named_volumes(volumes, ("rw",)):
        home = await volume_home(router, name)
        if home is not None:
            return home.node_id
    return None


async def bring_volumes(router: ClusterView, target: Node, volumes: Any) -> None:
    """Make the volumes ``volumes`` names usable on ``target``: a copy fetched from each
    one's home (checked once per node and volume by this client)."""
    for name in _named_volumes(volumes):
        if (target.node_id, name) in router.volumes_at:
            continue
        home = await volume_home(router, name)
        if home is not None and home.node_id != target.node_id:  # else: the create says
            body = {"volume": name, "node": home.node_id}
            await router._on(target, *request_line("fetch_own_volume"),
                             {"json": body, "timeout": FETCH_TIMEOUT_S}, False, None)
        router.volumes_at.add((target.node_id, name))


async def delete_everywhere(router: ClusterView, path: str, kwargs: dict[str, Any]) -> None:
    """Delete a snapshot or a volume on every node that has a copy (a snapshot:
    idempotent; a volume: :class:`VolumeNotFound` if no node had it)."""
    nodes = await router.alive_nodes()
    missing = []
    for reply in await router._each(nodes, "DELETE", path, kwargs):
        if isinstance(reply, VolumeNotFound):
            missing.append(reply)
        elif isinstance(reply, BaseException) and not isinstance(
            reply, (SnapshotNotFound, DaemonUnavailable)
        ):
            raise reply
    router.snapshots_at.clear()
    router.volumes_at.clear()
    if missing and len(missing) == len(nodes):
        raise missing[0]


def once_each(items: list[Any]) -> list[Any]:
    """A merged list of snapshots with each id once (copies on several nodes)."""
    seen: set[str] = set()
    out = []
    for item in items:
        if item.get("id") not in seen:
            seen.add(item.get("id"))
            out.append(item)
    return out
