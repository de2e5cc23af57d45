"""A cluster's directory read from one of its daemons, for clients that are not Ray
members: ``CORRAL_URL=cluster+http://HOST:PORT`` with ``CORRAL_TOKEN`` (a tenant's).

The daemon at ``HOST:PORT`` lists every alive node's daemon (``GET /v1/cluster/nodes``,
any valid token); after that, every call goes straight to the right node's daemon with
that token, as with ``ray://``. If that daemon stops answering, the daemons it listed
are asked instead. Ray's KV and the cluster's own token are never touched; the
autoscaler is not shown this client's waiting creates (a Ray member's are).
"""

from __future__ import annotations

import time
from typing import Any

import httpx

from corral.api.operations import url as api_url
from corral.cluster import proof
from corral.cluster.directory import Directory, Node
from corral.errors import DaemonUnavailable, Unauthorized

TIMEOUT_S = 5.0


class HttpDirectory(Directory):
    """The daemons of the cluster behind the daemon at ``url``, as it lists them."""

    def __init__(self, url: str, token: str) -> None:
        super().__init__(url.rstrip("/"), token)
        self._given = token
        self._known: dict[str, Node] = {}  # every node listed once: asked if ``url`` is not

    def gcs(self) -> Any:
        """None: this client reaches no GCS (its waiting creates are not published)."""
        return None

    def local_node(self) -> str | None:
        """This process's node if it runs in a Ray task or actor of that cluster."""
        if self._local is None:
            try:
                from corral.cluster import _ray

                self._local = (_ray.worker_node(),)
            except Exception:  # no Ray here: no node is local
                self._local = (None,)
        return self._local[0]

    def _load(self) -> None:
        listing = self._ask()
        nodes = {}
        for item in listing:
            node = Node(str(item["node_id"]), str(item["tag"]), str(item["url"]), self._given,
                        str(item.get("key") or ""))
            nodes[node.node_id] = node
        for node_id, node in {**self._nodes, **self._known}.items():
            if node_id not in nodes:  # listed before, not now: its node died
                self._dead[node.tag] = node
        self._known.update(nodes)
        self._nodes = nodes
        self.pins.replace((n.url, n.node_id, n.key) for n in nodes.values())
        self._loaded_at = time.monotonic()

    def _ask(self) -> list[dict[str, Any]]:
        headers = {"Authorization": f"Bearer {self._given}"}
        # The daemons listed last time (proven); the configured address too, proven if it
        # was listed, and trusted as configured only before anything was ever listed.
        urls = [*(n.url for n in self._nodes.values() if n.url != self.address), self.address]
        first = not self._known
        failures = []
        with (httpx.Client(timeout=TIMEOUT_S, headers=headers) if first else
              proof.proven_client(self.pins, timeout=TIMEOUT_S, headers=headers)) as http:
            for url in urls:
                try:
                    reply = http.get(url + api_url("cluster_nodes"))
                except httpx.HTTPError as exc:
                    failures.append(f"{url}: {type(exc).__name__}")
                    continue
                if reply.status_code == 401:
                    raise Unauthorized(f"the daemon at {url} refused this token (CORRAL_TOKEN): "
                                       "ask the cluster's admin for a valid one")
                if reply.status_code != 200:
                    failures.append(f"{url}: HTTP {reply.status_code} "
                                    f"{reply.text[:200]}")
                    continue
                nodes = reply.json().get("nodes")
                if isinstance(nodes, list):
                    return nodes
                failures.append(f"{url}: no node list")
        raise DaemonUnavailable(
            f"no daemon of the cluster at cluster+{self.address} lists its nodes "
            f"({'; '.join(failures)}): is it a daemon that `corral cluster up` started?",
            details={"url": f"cluster+{self.address}"},
        )

    def nodes(self) -> list[Node]:
        nodes = self._fresh()
        if not nodes:
            nodes = self._fresh(force=True)
        if not nodes:
            raise DaemonUnavailable(f"the cluster at cluster+{self.address} lists no daemons",
                                    details={"url": f"cluster+{self.address}"})
        return sorted(nodes.values(), key=lambda n: n.node_id)


def open_directory(cluster: str, token: str | None) -> Directory:
    """The directory of ``cluster``: a Ray address (``ray://``), or a daemon's URL
    (``cluster+http://``, with a ``token``)."""
    if cluster.startswith(("http://", "https://")):
        if not token:
            raise Unauthorized(f"cluster+{cluster} needs a token: set CORRAL_TOKEN")
        return HttpDirectory(cluster, token)
    return Directory(cluster, token)
