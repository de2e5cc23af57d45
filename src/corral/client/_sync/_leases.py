# Generated from _async/_leases.py by scripts/gen_sync.py: edit that file, not this one.
# ruff: noqa: I001  (the imports keep the source's order, sorted for _async)
"""Client leases across a cluster (``Session(lease=S)`` on ``ray://``), for
:class:`~._router.Router`.

A daemon knows only its own leases, and ends only its own sandboxes. So on a cluster
the client takes one lease under one id (its own choice, ``lease-<hex>``) on every
alive node, and a session's sandboxes may be placed on any of them:

- a renewal goes to every node, and counts if any node renewed it (one that lacks it
  answers ``lease_not_found``); a release goes to every node;
- a create carrying the lease's tag on a node that lacks it (one that joined since)
  takes the lease there first;
- when the client dies, every node's copy expires ``ttl`` after its last renewal, and
  each daemon ends that lease's sandboxes: none is left on any node.
"""

from __future__ import annotations

import secrets
from typing import Any

import httpx

from corral.api.operations import request_line
from corral.client._sync._cluster_view import Call, ClusterView
from corral.cluster.directory import Node
from corral.errors import DaemonUnavailable

LEASE_TAG_KEY = "lease"


def call(router: ClusterView, sent: Call) -> httpx.Response:
    """A lease call (taking, renewing, releasing one: ``Routing.LEASE``), on every alive
    node: the first node's answer that succeeded."""
    method, path, kwargs = sent.method, sent.path, sent.kwargs
    taking = sent.name == "create_lease"
    if taking:
        body = {**(kwargs.get("json") or {})}
        body.setdefault("id", "lease-" + secrets.token_hex(8))
        kwargs = {**kwargs, "json": body}
    nodes = router.alive_nodes()
    replies = router._each(nodes, method, path, kwargs)
    done = [(n, r) for n, r in zip(nodes, replies, strict=True) if isinstance(r, httpx.Response)]
    if not done:
        errors = [r for r in replies if isinstance(r, BaseException)]
        raise next((e for e in errors if not isinstance(e, DaemonUnavailable)), errors[0])
    if taking:  # which nodes have it, to take it where a sandbox goes later
        router.leases[body["id"]] = (body["ttl"], {n.node_id for n, _ in done})
    return done[0][1]


def take_where_placed(router: ClusterView, target: Node, body: dict[str, Any]) -> None:
    """Before a create on ``target``: the leases its tags name, taken there if it lacks them."""
    for tag in body.get("tags") or ():
        key, _, lease_id = str(tag).partition("=")
        known = router.leases.get(lease_id) if key == LEASE_TAG_KEY else None
        if known is not None and target.node_id not in known[1]:
            router._on(target, *request_line("create_lease"),
                             {"json": {"ttl": known[0], "id": lease_id}}, False, None)
            known[1].add(target.node_id)
