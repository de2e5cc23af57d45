"""What :mod:`._spread` and :mod:`._travel` use of the cluster router: a Protocol, so
they need not import :class:`~._router.AsyncRouter` (which imports them)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Protocol

import httpx

from corral.api.operation import Operation
from corral.cluster.directory import Directory, Node


@dataclass(frozen=True)
class Call:
    """One request to route: as sent, and the operation it is (None: none declared)."""

    method: str
    path: str
    kwargs: dict[str, Any]
    stream: bool
    op: Operation | None
    ids: dict[str, str]  # the path's parameters, decoded

    @property
    def name(self) -> str | None:
        return None if self.op is None else self.op.name


class ClusterView(Protocol):
    directory: Directory
    snapshots_at: set[tuple[str, str]]  # (node id, snapshot) known there
    volumes_at: set[tuple[str, str]]  # (node id, volume) brought there
    leases: dict[str, tuple[float, set[str]]]  # lease id -> (ttl, nodes that have it)
    _images: dict[str, set[str]]  # node id -> the images it has
    _loaded_at: float

    async def alive_nodes(self) -> list[Node]: ...

    async def home_node(self) -> Node: ...

    async def _refresh_loads(self) -> list[Node]: ...

    async def _holder_of(self, ref: str) -> Node: ...

    async def _on(
        self, target: Node, method: str, path: str, kwargs: dict[str, Any], stream: bool,
        what: str | None,
    ) -> httpx.Response: ...

    async def _each(
        self, nodes: list[Node], method: str, path: str, kwargs: dict[str, Any]
    ) -> list[httpx.Response | BaseException]: ...
