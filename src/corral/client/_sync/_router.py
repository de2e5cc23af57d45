# Generated from _async/_router.py by scripts/gen_sync.py: edit that file, not this one.
# ruff: noqa: I001  (the imports keep the source's order, sorted for _async)
"""A client's calls spread over the daemons of a Ray cluster (``CORRAL_URL=ray://ADDR``).

The client does the routing itself, so every call goes straight to the daemon that
answers it (no proxy hop):

- a create goes where :mod:`corral.cluster.placement` says (or to ``node=``); if that
  node lacks its built image or its snapshot, the node's daemon first fetches the
  layers from a node that has it (:mod:`._travel`);
- a call on a sandbox (``/v1/sandboxes/ID/...``) goes to the node its id names
  (``sb-<node tag>-<hex>``, see :mod:`corral.cluster.ids`): no lookup;
- a call on a snapshot or a pool goes to the node that holds it (each node is asked);
- listing sandboxes, snapshots or pools asks every node and merges; ``/v1/info`` sums;
- a pool is made on ``node=``, else (as images) on this worker's own node or the
  first; with ``spread=True``, on every node (:mod:`._spread`).

When a node's daemon cannot be reached and Ray says the node is dead, the call raises
:class:`~corral.errors.SandboxLost` naming the node (the directory is read again, so
placement stops choosing it); if the daemon only moved (restarted by Ray on another
port), a request that never left is sent again to its new address.

When no node has room for a create (every one full: live sandboxes or committed
memory), the create waits up to :attr:`Router.placement_wait` seconds
(``CORRAL_PLACEMENT_WAIT``) for room, a node that joins or a sandbox that ends, while
the wait is shown to Ray's autoscaler (:mod:`corral.cluster.autoscale`); then
:class:`~corral.errors.CapacityExceeded` says what to configure.
"""

from __future__ import annotations

import threading
import time
import uuid
from collections import Counter
from collections.abc import Callable
from functools import partial
from typing import Any
from urllib.parse import unquote

import httpx

from corral.api.operation import Routing
from corral.api.operations import match, request_line, url
from corral.client._sync import _leases, _spread, _travel
from corral.client._sync._cluster_view import Call
from corral.client._backends import SyncBackend
from corral.client._transport import is_connect_error
from corral.cluster import autoscale
from corral.cluster.directory import Node
from corral.cluster.http_directory import open_directory
from corral.cluster.ids import tag_of
from corral.cluster.placement import Room, choose, has_room, having_image, room
from corral.cluster.proof import guard_client
from corral.errors import (
    DaemonUnavailable,
    InvalidArgument,
    SandboxLost,
    SandboxNotFound,
)
from corral.schema import DEFAULT_IMAGE, DEFAULT_MEMORY_MB

LOAD_TTL_S = 1.0
"""How long the nodes' loads (``/v1/info``) are trusted for placement; the creates this
client sends meanwhile it counts itself."""
INFO_TIMEOUT_S = 5.0
WAIT_POLL_S = 0.5

Send = Callable[..., Any]  # the client's send(request, stream=...)


class Router:
    """Where each request of a cluster client goes (built by the client; no I/O)."""

    def __init__(self, address: str, http: httpx.Client, send: Send,
                 token: str | None = None) -> None:
        self.directory = open_directory(address, token)  # token given: never the cluster's
        # a daemon proves it is the node the directory lists before any token goes to it
        guard_client(http, self.directory.pins)
        self._http = http
        self._send = send
        self._lock = SyncBackend.lock()
        self._loads: dict[str, dict[str, Any]] = {}
        self._images: dict[str, set[str]] = {}  # node id -> the images it has
        self._loaded_at = -LOAD_TTL_S - 1.0
        self._placed: dict[str, tuple[int, int]] = {}  # since the loads were read
        # creates sent (or about to be) whose reply has not come: (node id, MB) each; a
        # refresh of the loads keeps them placed, since its infos may predate them
        self._in_flight: dict[object, tuple[str, int]] = {}
        self.placement_wait = autoscale.placement_wait()
        self._id = uuid.uuid4().hex  # this client's demand entry
        self._waiting = [0, 0]  # creates (and their MB) waiting for room
        self._waiting_gpus: Counter[float] = Counter()  # of which how many ask for N GPUs
        self._waiting_lock = threading.Lock()
        self.snapshots_at: set[tuple[str, str]] = set()  # (node id, snapshot) known there
        self.volumes_at: set[tuple[str, str]] = set()  # (node id, volume) brought there
        self.leases: dict[str, tuple[float, set[str]]] = {}  # id -> (ttl, nodes that have it)

    def request(
        self, method: str, path: str, kwargs: dict[str, Any], *, node: str | None, stream: bool
    ) -> httpx.Response:
        """Send one request where its operation's :class:`~corral.api.Routing` says (a
        path no operation declares goes to the home node, which answers it)."""
        found = match(method, path.partition("?")[0])
        op, ids = found if found is not None else (None, {})
        routing = op.routing if op is not None else Routing.HOME
        if node is not None and routing not in (Routing.PLACE, Routing.POOL_CREATE):
            raise InvalidArgument("node= applies to creating a sandbox or a pool only")
        call = Call(method, path, kwargs, stream, op, {k: unquote(v) for k, v in ids.items()})
        reply: httpx.Response = _DISPATCH[routing](self, call, node)
        return reply

    def _to_sandbox(self, call: Call, node: str | None) -> httpx.Response:
        sandbox_id = call.ids["sandbox_id"]
        try:
            target = self._node_of(sandbox_id)
            return self._on(target, call.method, call.path, call.kwargs, call.stream,
                                  f"sandbox {sandbox_id}")
        except SandboxLost:
            if call.name == "delete_sandbox":  # gone with its node: deleted, then
                return _done(call)
            raise

    def _to_placed(self, call: Call, node: str | None) -> httpx.Response:
        return self._create(call.kwargs, node, call.stream)

    def _to_new_pool(self, call: Call, node: str | None) -> httpx.Response:
        if node == _spread.SPREAD:  # on every node...
            return _spread.create(self, call.kwargs)
        if node is not None:  # ...or on one
            target = SyncBackend.run_blocking(self.directory.pinned, node)
        else:
            target = SyncBackend.run_blocking(self.directory.home)
        return self._on(target, call.method, call.path, call.kwargs, call.stream, None)

    def _to_holder(self, call: Call, node: str | None) -> httpx.Response:
        target = self._holder_of(call.ids["id_or_name"])
        return self._on(target, call.method, call.path, call.kwargs, call.stream, None)

    def _to_volume_home(self, call: Call, node: str | None) -> httpx.Response:
        target = _travel.volume_home(self, call.ids["name"])  # not a copy of it
        if target is None:
            target = SyncBackend.run_blocking(self.directory.home)
        return self._on(target, call.method, call.path, call.kwargs, call.stream, None)

    def _to_every_copy(self, call: Call, node: str | None) -> httpx.Response:
        _travel.delete_everywhere(self, call.path, call.kwargs)
        return _done(call)

    def _to_pool(self, call: Call, node: str | None) -> httpx.Response:
        return _spread.on_pool(self, call)

    def _to_all_merged(self, call: Call, node: str | None) -> httpx.Response:
        assert call.op is not None
        (key,) = call.op.reply.model_fields  # SandboxList: "sandboxes"...
        return self._merged_list(call.path, key, call.kwargs)

    def _to_all_summed(self, call: Call, node: str | None) -> httpx.Response:
        return self._merged_info(call.kwargs)

    def _to_lease_nodes(self, call: Call, node: str | None) -> httpx.Response:
        return _leases.call(self, call)

    def _to_split(self, call: Call, node: str | None) -> httpx.Response:
        return self._exchange(call.kwargs, call.stream)

    def _to_home(self, call: Call, node: str | None) -> httpx.Response:
        target = SyncBackend.run_blocking(self.directory.home)
        return self._on(target, call.method, call.path, call.kwargs, call.stream, None)

    # ------------------------------------------------------------- one node

    def _build(self, target: Node, method: str, path: str, kwargs: dict[str, Any]) -> httpx.Request:
        kwargs = dict(kwargs)  # a call's own headers (a build's Content-Type) kept
        headers = {**(kwargs.pop("headers", None) or {}),
                   "Authorization": f"Bearer {target.token}"}  # that node's own token
        return self._http.build_request(method, target.url + path, headers=headers, **kwargs)

    def _on(
        self, target: Node, method: str, path: str, kwargs: dict[str, Any], stream: bool,
        what: str | None,
    ) -> httpx.Response:
        try:
            sent: httpx.Response = self._send(
                self._build(target, method, path, kwargs), stream=stream
            )
            return sent
        except DaemonUnavailable as exc:
            self._loads.pop(target.node_id, None)  # placement skips it until it answers again
            now = SyncBackend.run_blocking(self.directory.forget, target)
            if now is None:
                raise self.directory.lost(
                    target, what or f"the daemon of node {target.node_id}", _sandbox(what)
                ) from exc
            if now.url == target.url or not is_connect_error(exc):
                raise
        # The node is alive but its daemon moved (Ray restarted it): the request never
        # left, so sending it again is safe.
        resent: httpx.Response = self._send(self._build(now, method, path, kwargs), stream=stream)
        return resent

    def _node_of(self, sandbox_id: str) -> Node:
        tag = tag_of(sandbox_id)
        if tag is None:
            raise SandboxNotFound(
                f"no sandbox {sandbox_id!r} on the cluster at {self.directory.address}: "
                "the ids of its sandboxes look like sb-<node>-<hex> (`corral ls` lists them)",
                details={"sandbox_id": sandbox_id},
            )
        cached = self.directory.cached(tag)
        if cached is not None:
            return cached
        return SyncBackend.run_blocking(self.directory.by_tag, tag, sandbox_id)

    # ------------------------------------------------------------- placement

    def _create(self, kwargs: dict[str, Any], node: str | None, stream: bool) -> httpx.Response:
        body = kwargs.get("json") or {}
        if node is None and body.get("volumes"):  # a volume mounted rw: on its home
            node = _travel.rw_home(self, body["volumes"])
        if node is not None:
            target = SyncBackend.run_blocking(self.directory.pinned, node)
            if body.get("snapshot"):
                _travel.bring_snapshot(self, target, str(body["snapshot"]))
            else:
                _travel.bring_image(self, target, str(body.get("image") or DEFAULT_IMAGE))
            _travel.bring_volumes(self, target, body.get("volumes"))
            _leases.take_where_placed(self, target, body)
            return self._on(target, *request_line("create_sandbox"), kwargs, stream, None)
        memory_mb = int(body.get("memory_mb") or DEFAULT_MEMORY_MB)
        snapshot = body.get("snapshot")
        gpus = body.get("gpus")  # a count, "all" or a list: nodes with that many GPUs
        target = self.place(memory_mb, gpus=(1 if isinstance(gpus, str) else len(gpus)
                                                   if isinstance(gpus, list) else int(gpus or 0)))
        flight = object()
        self._in_flight[flight] = (target.node_id, memory_mb)
        try:
            if snapshot:  # taken on any node: its layers come to this one first
                _travel.bring_snapshot(self, target, str(snapshot))
            else:
                target = _travel.bring_image(
                    self, target, str(body.get("image") or DEFAULT_IMAGE))
            _travel.bring_volumes(self, target, body.get("volumes"))
            _leases.take_where_placed(self, target, body)
            return self._on(target, *request_line("create_sandbox"), kwargs, stream, None)
        except BaseException:  # no sandbox made there: take it off the count
            count, mb = self._placed.get(target.node_id, (0, 0))
            self._placed[target.node_id] = (max(0, count - 1), max(0, mb - memory_mb))
            raise
        finally:
            self._in_flight.pop(flight, None)

    def place(self, memory_mb: int = DEFAULT_MEMORY_MB, image: str | None = None,
                    gpus: int = 0) -> Node:
        """The node a new sandbox of ``memory_mb`` goes to (counted as sent there):
        among the nodes that have ``image``, if any has it (``None``: any node; a create
        places by room and brings the image there, see :mod:`._travel`).
        If none has room, waits for some (:meth:`_wait_for_room`)."""
        nodes, rooms = self._rooms(image)
        if not any(has_room(r, memory_mb, gpus) for r in rooms.values()):
            # no node with that many GPUs at all waits too: Ray's autoscaler, shown the
            # GPUs it asks for, may add a GPU node
            nodes, rooms = self._wait_for_room(memory_mb, image, gpus)
        chosen = choose(rooms, memory_mb=memory_mb, local=self.directory.local_node(),
                        gpus=gpus)
        count, mb = self._placed.get(chosen, (0, 0))
        self._placed[chosen] = (count + 1, mb + memory_mb)
        return next(n for n in nodes if n.node_id == chosen)

    def _rooms(self, image: str | None) -> tuple[list[Node], dict[str, Room]]:
        nodes = self._refresh_loads()
        rooms: dict[str, Room] = {}
        for n in nodes:
            if n.node_id in self._loads:
                placed, placed_mb = self._placed.get(n.node_id, (0, 0))
                rooms[n.node_id] = room(self._loads[n.node_id], placed=placed, placed_mb=placed_mb)
        if not rooms:
            raise DaemonUnavailable(
                f"no corral daemon of the Ray cluster at {self.directory.address} answers: "
                f"see `corral cluster status --address {self.directory.address}`"
            )
        if image is not None:
            rooms = having_image(rooms, self._images, image)
        return nodes, rooms

    def _wait_for_room(
        self, memory_mb: int, image: str | None, gpus: int = 0
    ) -> tuple[list[Node], dict[str, Room]]:
        """Every node is full (or none has ``gpus`` GPUs): wait (at most
        :attr:`placement_wait` s) until one has room, with this create (and its GPUs)
        shown to Ray's autoscaler meanwhile."""
        deadline = time.monotonic() + self.placement_wait
        gcs = SyncBackend.run_blocking(self.directory.gcs)
        self._count_waiting(+1, memory_mb, gpus)
        try:
            published = -autoscale.REFRESH_S
            while (remaining := deadline - time.monotonic()) > 0:
                if gcs is not None and time.monotonic() - published >= autoscale.REFRESH_S:
                    waiting, waiting_mb, by_gpus = self._count_waiting(0, 0)
                    SyncBackend.run_blocking(
                        autoscale.publish, gcs, self._id, waiting, waiting_mb, by_gpus)
                    published = time.monotonic()
                SyncBackend.sleep(min(WAIT_POLL_S, remaining))
                nodes, rooms = self._rooms(image)
                if any(has_room(r, memory_mb, gpus) for r in rooms.values()):
                    return nodes, rooms
        finally:
            waiting, waiting_mb, by_gpus = self._count_waiting(-1, memory_mb, gpus)
            if gcs is None:  # a client outside Ray (cluster+http://) publishes nothing
                pass
            elif waiting:
                SyncBackend.run_blocking(
                    autoscale.publish, gcs, self._id, waiting, waiting_mb, by_gpus)
            else:
                SyncBackend.run_blocking(autoscale.withdraw, gcs, self._id)
        raise autoscale.no_room(self.directory.address, memory_mb, self.placement_wait, gpus)

    def _count_waiting(self, delta: int, memory_mb: int, gpus: int = 0
                       ) -> tuple[int, int, dict[float, int]]:
        """Count ``delta`` more creates of ``memory_mb`` and ``gpus`` waiting; how many
        wait now, their MB, and how many of them ask for how many GPUs."""
        with self._waiting_lock:
            self._waiting[0] += delta
            self._waiting[1] += delta * memory_mb
            if gpus and delta:
                self._waiting_gpus[float(gpus)] += delta
                self._waiting_gpus = +self._waiting_gpus
            return self._waiting[0], self._waiting[1], dict(self._waiting_gpus)

    def _refresh_loads(self) -> list[Node]:
        nodes = SyncBackend.run_blocking(self.directory.nodes)
        if time.monotonic() - self._loaded_at <= LOAD_TTL_S and set(self._loads) <= {
            n.node_id for n in nodes
        }:
            return nodes
        with self._lock:  # one refresh at a time; the others use its result
            if time.monotonic() - self._loaded_at > LOAD_TTL_S:
                flying = dict(self._in_flight)  # the infos may not count these yet
                quick = {"timeout": INFO_TIMEOUT_S}
                infos = self._each(nodes, *request_line("info"), quick)
                images = self._each(nodes, *request_line("list_images"), quick)
                self._loads = {
                    n.node_id: r.json() for n, r in zip(nodes, infos, strict=True)
                    if isinstance(r, httpx.Response)
                }
                self._images = {
                    n.node_id: {i["name"] for i in r.json()["images"]}
                    for n, r in zip(nodes, images, strict=True) if isinstance(r, httpx.Response)
                }
                # the daemons count the creates answered before the infos were asked;
                # not those in flight then or since (on a loaded host, a create placed
                # just before a refresh would be forgotten: the next went to the same node)
                self._placed = {}
                for node_id, mb in {**flying, **self._in_flight}.values():
                    count, placed_mb = self._placed.get(node_id, (0, 0))
                    self._placed[node_id] = (count + 1, placed_mb + mb)
                self._loaded_at = time.monotonic()
        return nodes

    def alive_nodes(self) -> list[Node]:
        nodes: list[Node] = SyncBackend.run_blocking(self.directory.nodes)
        return nodes

    def home_node(self) -> Node:
        home: Node = SyncBackend.run_blocking(self.directory.home)
        return home

    def _holder_of(self, ref: str) -> Node:
        """The node holding the snapshot ``ref``; if none does, the home node (which
        then says it is not found)."""
        nodes = SyncBackend.run_blocking(self.directory.nodes)
        replies = self._each(nodes, *request_line("get_snapshot", id_or_name=ref), {})
        for n, r in zip(nodes, replies, strict=True):
            if isinstance(r, httpx.Response):
                return n
        return SyncBackend.run_blocking(self.directory.home)

    # ------------------------------------------------------------- every node

    def _each(
        self, nodes: list[Node], method: str, path: str, kwargs: dict[str, Any]
    ) -> list[httpx.Response | BaseException]:
        def one(n: Node) -> httpx.Response:
            reply: httpx.Response = self._send(self._build(n, method, path, kwargs), stream=False)
            return reply

        return SyncBackend.gather([partial(one, n) for n in nodes])

    def _merged_list(self, path: str, key: str, kwargs: dict[str, Any]) -> httpx.Response:
        nodes = SyncBackend.run_blocking(self.directory.nodes)
        items: list[Any] = []
        for n, reply in zip(nodes, self._each(nodes, "GET", path, kwargs), strict=True):
            if isinstance(reply, DaemonUnavailable):
                SyncBackend.run_blocking(self.directory.forget, n)
                continue  # a node that just died: its sandboxes are gone with it
            if isinstance(reply, BaseException):
                raise reply
            items.extend(reply.json()[key])
        items.sort(key=lambda item: item.get("created_at", 0))
        if key == "snapshots":
            items = _travel.once_each(items)
        return _reply(path, {key: items})

    def _merged_info(self, kwargs: dict[str, Any]) -> httpx.Response:
        nodes = SyncBackend.run_blocking(self.directory.nodes)
        infos = []
        replies = self._each(nodes, *request_line("info"), kwargs)
        for n, reply in zip(nodes, replies, strict=True):
            if isinstance(reply, httpx.Response):
                infos.append({"node": n.node_id, "url": n.url, **reply.json()})
        if not infos:
            raise DaemonUnavailable(
                f"no corral daemon of the Ray cluster at {self.directory.address} answers: "
                f"see `corral cluster status --address {self.directory.address}`"
            )
        return _reply(url("info"), merge_infos(infos))

    def _exchange(self, kwargs: dict[str, Any], stream: bool) -> httpx.Response:
        exchange = request_line("exchange_many")
        body = kwargs.get("json") or {}
        items = body.get("items") or []
        groups: dict[str, list[int]] = {}
        targets: dict[str, Node] = {}
        for index, item in enumerate(items):
            target = self._node_of(str(item.get("sandbox_id")))
            targets[target.node_id] = target
            groups.setdefault(target.node_id, []).append(index)
        if len(groups) <= 1:
            if targets:
                (target,) = targets.values()
            else:
                target = SyncBackend.run_blocking(self.directory.home)
            return self._on(target, *exchange, kwargs, stream, None)

        def part(node_id: str) -> httpx.Response:
            sub = {**kwargs, "json": {**body, "items": [items[i] for i in groups[node_id]]}}
            return self._on(targets[node_id], *exchange, sub, False, None)

        replies = SyncBackend.gather([partial(part, k) for k in groups])
        results: list[Any] = [None] * len(items)
        for node_id, reply in zip(groups, replies, strict=True):
            if isinstance(reply, BaseException):
                raise reply
            for index, result in zip(groups[node_id], reply.json()["results"], strict=True):
                results[index] = result
        return _reply(exchange[1], {"results": results})


def merge_infos(infos: list[dict[str, Any]]) -> dict[str, Any]:
    """One ``/v1/info`` for the cluster: capacities, counts and loads summed; per node
    under ``nodes``."""
    first = infos[0]
    capacity = {k: sum(i["capacity"][k] for i in infos) for k in first["capacity"]}
    capacity["queue_timeout"] = max(i["capacity"]["queue_timeout"] for i in infos)
    counts: dict[str, int] = {}
    for i in infos:
        for state, n in i["counts"].items():
            counts[state] = counts.get(state, 0) + n
    return {
        "version": first["version"], "cgroup_version": first["cgroup_version"],
        "capacity": capacity,
        "committed_memory_mb": sum(i["committed_memory_mb"] for i in infos),
        "starting": sum(i["starting"] for i in infos),
        "queued": sum(i["queued"] for i in infos),
        "counts": counts,
        "pools": [p for i in infos for p in i["pools"]],
        # the shortest of the nodes' --default-lease (a session takes it on every node)
        "default_lease": min((i["default_lease"] for i in infos if i.get("default_lease")),
                             default=None),
        "nodes": infos,
    }


_DISPATCH: dict[Routing, Callable[..., Any]] = {
    Routing.SANDBOX: Router._to_sandbox,
    Routing.PLACE: Router._to_placed,
    Routing.HOLDER: Router._to_holder,
    Routing.EVERYWHERE: Router._to_every_copy,
    Routing.POOL: Router._to_pool,
    Routing.POOL_CREATE: Router._to_new_pool,
    Routing.MERGE: Router._to_all_merged,
    Routing.SUM: Router._to_all_summed,
    Routing.SPLIT: Router._to_split,
    Routing.LEASE: Router._to_lease_nodes,
    Routing.HOME: Router._to_home,
    Routing.VOLUME: Router._to_volume_home,
    Routing.NODE: Router._to_home,  # a node's own routes: the node this client calls home
}
"""Each :class:`~corral.api.Routing` the declarations use, and how it is done."""


def _done(call: Call) -> httpx.Response:
    return httpx.Response(204, request=httpx.Request(call.method, f"http://cluster{call.path}"))


def _reply(path: str, data: Any) -> httpx.Response:
    return httpx.Response(200, json=data, request=httpx.Request("GET", f"http://cluster{path}"))


def _sandbox(what: str | None) -> str | None:
    return what.removeprefix("sandbox ") if what and what.startswith("sandbox ") else None
