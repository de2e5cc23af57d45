"""Sandbox ids that name their node, so a client routes a call without a lookup.

A cluster's daemon gives its sandboxes ids ``sb-<tag>-<hex>``, where ``<tag>`` is the
first :data:`TAG_LEN` hex digits of its Ray node id (Ray draws node ids at random).
A daemon outside a cluster keeps plain ``sb-<hex>`` ids.

>>> node_tag("064e3ebd758db2dfcb8ea4527923f4d80b512293fe3ca812d7d58b0f")
'064e3ebd75'
>>> tag_of("sb-064e3ebd75-a1b2c3d4e5f6")
'064e3ebd75'
>>> tag_of("sb-a1b2c3d4e5f6") is None
True
"""

from __future__ import annotations

import re

TAG_LEN = 10
_NODE_ID = re.compile(r"[0-9a-f]{16,}")
_TAGGED = re.compile(r"sb-([0-9a-f]{%d})-[0-9a-f]+" % TAG_LEN)


def is_node_id(text: str) -> bool:
    """Whether ``text`` looks like a Ray node id (hex)."""
    return bool(_NODE_ID.fullmatch(text))


def node_tag(node_id: str) -> str:
    """The short tag of a Ray node id that its sandboxes' ids carry."""
    return node_id[:TAG_LEN]


def id_prefix(node_id: str) -> str:
    """What the ids of the sandboxes of the daemon on ``node_id`` start with."""
    return f"sb-{node_tag(node_id)}-"


def tag_of(sandbox_id: str) -> str | None:
    """The node tag in a sandbox id, or None for an id made outside a cluster."""
    match = _TAGGED.fullmatch(sandbox_id)
    return match.group(1) if match else None
