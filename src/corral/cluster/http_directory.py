"""A cluster's directory read from one of its daemons, for clients that are not Ray
members: ``CORRAL_URL=cluster+http://HOST:PORT?key=KEY`` with ``CORRAL_TOKEN`` (a
tenant's).

The daemon at ``HOST:PORT`` lists every alive node's daemon (``GET /v1/cluster/nodes``,
any valid token); after that, every call goes straight to the right node's daemon with
that token, as with ``ray://``. If that daemon stops answering, the daemons it listed
are asked instead. Ray's KV and the cluster's own token are never touched; the
autoscaler is not shown this client's waiting creates (a Ray member's are).

The first contact is proven too: ``KEY`` is that daemon's public key (printed by
``corral cluster up`` and ``corral token create``), and the daemon must sign the
client's nonce with it (:mod:`corral.cluster.proof`) before the token is sent. One that
cannot is refused with :class:`~corral.errors.DaemonUnavailable` (``details["reason"]``
``"unproven"``): a squatter on the address, or a daemon restarted with a new key.
"""

from __future__ import annotations

import time
from typing import Any
from urllib.parse import parse_qs, urlsplit

import httpx

from corral.api.operations import url as api_url
from corral.cluster import proof
from corral.cluster.directory import Directory, Node
from corral.errors import DaemonUnavailable, InvalidArgument, Unauthorized

TIMEOUT_S = 5.0


class HttpDirectory(Directory):
    """The daemons of the cluster behind the daemon at ``url``, as it lists them."""

    def __init__(self, url: str, token: str, key: str) -> None:
        super().__init__(url.rstrip("/"), token)
        self._given = token
        self._key = key  # the configured daemon's public key: its first contact's pin
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
        # The daemons listed last time (proven); the configured address too: proven with
        # the key it was configured with before anything was ever listed, then only if
        # the directory lists it.
        urls = [*(n.url for n in self._nodes.values() if n.url != self.address), self.address]
        first = not self._known
        pins = proof.Pins([(self.address, None, self._key)]) if first else self.pins
        failures = []
        with proof.proven_client(pins, timeout=TIMEOUT_S, headers=headers) as http:
            for url in urls:
                try:
                    reply = http.get(url + api_url("cluster_nodes"))
                except httpx.HTTPError as exc:
                    if first and isinstance(exc.__cause__, proof.Unproven):
                        raise self._unproven(exc) from None
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

    def _unproven(self, exc: Exception) -> DaemonUnavailable:
        return DaemonUnavailable(
            f"the daemon at cluster+{self.address} did not prove it holds the key given "
            f"in CORRAL_URL (?key=...), so CORRAL_TOKEN was not sent: check the address "
            "and the key against what `corral cluster up` or `corral token create` printed "
            "(a restarted daemon has a new port and key); if they match, something else "
            f"answers on that address ({exc})",
            details={"url": f"cluster+{self.address}", "reason": "unproven"},
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
    """The directory of ``cluster``: a Ray address (``ray://``), or a daemon's URL with
    its key (``cluster+http://HOST:PORT?key=KEY``, with a ``token``)."""
    if cluster.startswith(("http://", "https://")):
        if not token:
            raise Unauthorized(f"cluster+{cluster} needs a token: set CORRAL_TOKEN")
        parts = urlsplit(cluster)
        given = parse_qs(parts.query).get("key", [""])[0]
        key = proof.parse_key(given) if given else None
        if key is None:
            raise InvalidArgument(
                f"cluster+{parts.scheme}://{parts.netloc} needs the key of that daemon, to "
                "check it before the token is sent: "
                f"CORRAL_URL=cluster+{parts.scheme}://{parts.netloc}?key=KEY, as `corral "
                "cluster up` and `corral token create` print it")
        return HttpDirectory(f"{parts.scheme}://{parts.netloc}", token, key)
    return Directory(cluster, token)
