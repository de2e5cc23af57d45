# Generated from _async/_spread.py by scripts/gen_sync.py: edit that file, not this one.
# ruff: noqa: I001  (the imports keep the source's order, sorted for _async)
"""Pools spread across a cluster, for :class:`~._router.Router`.

``corral.Pool(..., spread=True)`` on ``ray://`` makes one pool of that name on every
alive node, each keeping its share of ``min_ready`` and ``max_size`` (rounded up, at
least one). An acquire goes to the node whose pool has the most sandboxes ready (this
worker's own node first while it has one ready), so it is served at once where it can
be; the pool's stats add the nodes' up (``ready_ids``, ``acquired_ids`` and the counts
summed, the median wait the largest); deleting it deletes every node's. A pool made
with ``node=`` (or neither) lives on one node, as before.
"""

from __future__ import annotations

import math
from typing import Any

import httpx

from corral.api.operations import request_line
from corral.client._sync._cluster_view import Call, ClusterView
from corral.cluster.directory import Node
from corral.errors import DaemonUnavailable, NotFound

SPREAD = "*"
"""The ``node`` a pool is made on to spread it over every node."""
_SUMMED = ("ready", "starting", "acquired", "waiting", "created", "failed", "discarded",
           "acquires", "min_ready", "max_size")


def create(router: ClusterView, kwargs: dict[str, Any]) -> httpx.Response:
    """Make the pool on every alive node, each with its share; all or nothing."""
    nodes = router.alive_nodes()
    body = dict(kwargs.get("json") or {})
    share = {k: max(1, math.ceil(int(body[k]) / len(nodes))) for k in ("min_ready", "max_size")
             if k in body}
    made: list[Node] = []
    try:
        for n in nodes:
            router._on(n, *request_line("create_pool"),
                             {**kwargs, "json": {**body, **share}}, False, None)
            made.append(n)
    except BaseException:
        router._each(made, *request_line("delete_pool", name=str(body.get("name"))), {})
        raise
    method, path = request_line("get_pool", name=str(body.get("name")))
    return merged(router, method, path, {}, made, status=201)


def holders(router: ClusterView, name: str) -> list[tuple[Node, dict[str, Any]]]:
    """The nodes whose daemon has the pool ``name``, with its details there."""
    nodes = router.alive_nodes()
    out = []
    replies = router._each(nodes, *request_line("get_pool", name=name), {})
    for n, reply in zip(nodes, replies, strict=True):
        if isinstance(reply, httpx.Response):
            out.append((n, reply.json()))
        elif not isinstance(reply, (NotFound, DaemonUnavailable)):
            raise reply
    return out


def on_pool(router: ClusterView, call: Call) -> httpx.Response:
    """A call on a pool, sent to the node that holds it, or, for a pool spread over
    several nodes: an acquire to the best one, a delete to all, its details added up."""
    method, path, kwargs, stream = call.method, call.path, call.kwargs, call.stream
    found = holders(router, call.ids["name"])
    if not found:  # the home node says it is not found
        home = router.home_node()
        return router._on(home, method, path, kwargs, stream, None)
    if len(found) > 1 and call.name == "acquire_from_pool":
        local = router.directory.local_node()
        best = max(found, key=lambda f: (f[1]["ready"] > 0 and f[0].node_id == local,
                                         f[1]["ready"] - f[1]["waiting"], -f[1]["acquired"]))
        return router._on(best[0], method, path, kwargs, stream, None)
    if len(found) > 1 and call.name == "delete_pool":
        for reply in router._each([n for n, _ in found], method, path, kwargs):
            if isinstance(reply, BaseException) and not isinstance(reply, NotFound):
                raise reply
        return httpx.Response(204, request=httpx.Request(method, f"http://cluster{path}"))
    if len(found) > 1 and call.name == "get_pool":
        return merged(router, method, path, kwargs, [n for n, _ in found])
    return router._on(found[0][0], method, path, kwargs, stream, None)


def merged(router: ClusterView, method: str, path: str, kwargs: dict[str, Any],
                 nodes: list[Node], status: int = 200) -> httpx.Response:
    """One pool's details, added up over ``nodes``."""
    parts = []
    for reply in router._each(nodes, method, path, kwargs):
        if isinstance(reply, BaseException):
            raise reply
        parts.append(reply.json())
    out = dict(parts[0])
    for key in _SUMMED:
        out[key] = sum(int(p.get(key) or 0) for p in parts)
    for key in ("ready_ids", "acquired_ids"):
        out[key] = [i for p in parts for i in p.get(key) or []]
    waits = [p["acquire_wait_ms_p50"] for p in parts if p.get("acquire_wait_ms_p50") is not None]
    out["acquire_wait_ms_p50"] = max(waits) if waits else None
    out["last_error"] = next((p["last_error"] for p in parts if p.get("last_error")), None)
    out["nodes"] = [n.node_id for n in nodes]
    return httpx.Response(status, json=out, request=httpx.Request(method, f"http://cluster{path}"))
