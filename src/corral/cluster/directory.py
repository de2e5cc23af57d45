"""Where a client finds the cluster's daemons: Ray's internal KV, read over the GCS.

Each :class:`Node` carries its daemon's own admin token (:mod:`corral.cluster.auth`).

Blocking calls (the SDK runs them on a thread with asyncio). The entries are cached
and read again when :data:`TTL_S` old, when an id names a node not in the cache, and
after a node failed a call (:meth:`Directory.forget`).
"""

from __future__ import annotations

import json
import threading
import time
from dataclasses import dataclass, field
from typing import Any

from corral.cluster import _ray, auth, proof
from corral.errors import DaemonUnavailable, InvalidArgument, SandboxLost

TTL_S = 5.0
NODE_KEY = "node:"  # + the node id: its daemon's entry (node.py writes it)


@dataclass(frozen=True)
class Node:
    """One node's daemon, as the directory lists it."""

    node_id: str
    tag: str
    url: str
    token: str = field(default="", repr=False, compare=False)  # its daemon's admin token
    key: str = ""  # the public key its daemon proves itself with (cluster/proof.py)


class Directory:
    """The daemons of the cluster at ``address`` (``auto`` or ``host:port``). With a
    ``token`` (a tenant's, say), every node is sent that one: no node's own token is
    ever read from the KV, only where the nodes are."""

    def __init__(self, address: str, token: str | None = None, *, tokens: bool = True) -> None:
        self.address = address
        self.token = token  # sent to every node instead of its own admin token
        self._with_tokens = tokens and token is None  # False: no node's admin token read
        self._lock = threading.Lock()
        self._gcs: Any = None
        self._nodes: dict[str, Node] = {}  # node_id -> Node, alive ones only
        self._dead: dict[str, Node] = {}  # tag -> Node: registered once, now dead
        self._loaded_at = -TTL_S - 1.0
        self._local: tuple[str | None] | None = None
        # the addresses listed now, each with its node's key: connections anywhere else,
        # or to a daemon that cannot prove it is that node, carry no credential
        self.pins = proof.Pins()

    # ---------------------------------------------------------------- reading

    def _client(self) -> Any:
        if self._gcs is None:
            self._gcs = _ray.gcs(_ray.resolve(self.address))
        return self._gcs

    def gcs(self) -> Any:
        """The cluster's GCS client (blocking to make)."""
        return self._client()

    def _load(self) -> None:
        gcs = self._client()
        states = _ray.node_states(gcs)
        tokens = auth.node_tokens(gcs) if self._with_tokens else None
        nodes = {}
        for key in _ray.kv_keys(gcs, NODE_KEY):
            raw = _ray.kv_get(gcs, key)
            if not raw:
                continue
            entry = json.loads(raw)
            token = tokens.get(entry["node_id"], "") if tokens is not None else (
                self.token or "")
            node = Node(entry["node_id"], entry["tag"], entry["url"], token,
                        str(entry.get("key") or ""))
            if not states.get(node.node_id, {}).get("alive"):
                self._dead[node.tag] = node
            elif token or tokens is None:  # (its token is made before its entry)
                nodes[node.node_id] = node
        self._nodes = nodes
        self.pins.replace((n.url, n.node_id, n.key) for n in nodes.values())
        self._loaded_at = time.monotonic()

    def _fresh(self, force: bool = False) -> dict[str, Node]:
        with self._lock:
            if force or time.monotonic() - self._loaded_at > TTL_S:
                self._load()
            return self._nodes

    def nodes(self) -> list[Node]:
        """The alive nodes with a daemon; :class:`DaemonUnavailable` (saying to run
        ``corral cluster up``) if there are none."""
        nodes = self._fresh()
        if not nodes:
            nodes = self._fresh(force=True)
        if not nodes:
            raise DaemonUnavailable(
                f"the Ray cluster at {self.address} runs no corral daemons: run "
                f"`corral cluster up --address {self.address}`",
                details={"url": f"ray://{self.address}"},
            )
        return sorted(nodes.values(), key=lambda n: n.node_id)

    def cached(self, tag: str) -> Node | None:
        """The node of ``tag`` as last read, without asking the cluster (None if unknown)."""
        for node in self._nodes.values():
            if node.tag == tag:
                return node
        return None

    def by_tag(self, tag: str, sandbox_id: str) -> Node:
        """The node whose daemon made ``sandbox_id``; :class:`SandboxLost` if that node
        is gone."""
        for fresh in (False, True):
            for node in self._fresh(force=fresh).values():
                if node.tag == tag:
                    return node
        if tag in self._dead:
            raise self.lost(self._dead[tag], f"sandbox {sandbox_id}", sandbox_id)
        raise SandboxLost(
            f"sandbox {sandbox_id} is lost: its node ({tag}...) is not alive in the Ray "
            f"cluster at {self.address}, or its daemon was stopped (`corral cluster status` "
            "lists the nodes); create a new sandbox",
            details={"sandbox_id": sandbox_id, "node": tag},
        )

    def pinned(self, node: str) -> Node:
        """The node ``node`` (a node id, or its tag) names; InvalidArgument if none."""
        for fresh in (False, True):
            for n in self._fresh(force=fresh).values():
                if node in (n.node_id, n.tag):
                    return n
        raise InvalidArgument(
            f"no alive node with a corral daemon has the id {node!r}: "
            f"`corral cluster status --address {self.address}` lists the nodes",
            details={"node": node},
        )

    def home(self) -> Node:
        """Where what is not a sandbox yet goes (pools, images): this worker's own node
        if it has a daemon, else the first node."""
        nodes = self.nodes()
        local = self.local_node()
        return next((n for n in nodes if n.node_id == local), nodes[0])

    def local_node(self) -> str | None:
        """This process's node if it is a Ray task or actor (a worker stays on its node)."""
        if self._local is None:
            self._local = (_ray.worker_node(),)
        return self._local[0]

    # ---------------------------------------------------------------- failures

    def forget(self, node: Node) -> Node | None:
        """``node`` failed a call: read the directory again; the node's new entry if it
        is still alive (its daemon may have moved to another port), else None."""
        nodes = self._fresh(force=True)
        return nodes.get(node.node_id)

    def lost(self, node: Node, what: str, sandbox_id: str | None) -> SandboxLost:
        return SandboxLost(
            f"{what} is lost: its Ray node {node.node_id} died (its daemon was at "
            f"{node.url}); create a new sandbox (corral.rl retries such episodes)",
            details={"sandbox_id": sandbox_id, "node": node.node_id},
        )
