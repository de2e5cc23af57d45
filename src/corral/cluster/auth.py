"""Who may do what on a corral cluster: Ray's token auth, and corral's own tokens.

Two layers:

- **Ray's GCS.** corral keeps its tokens in Ray's internal KV, so whoever reaches the
  GCS port reads them, unless the cluster runs with Ray's token authentication
  (``RAY_AUTH_MODE=token`` and the cluster's token in ``RAY_AUTH_TOKEN``,
  ``RAY_AUTH_TOKEN_PATH`` or ``~/.ray/auth_token`` on every node and client).
  :func:`~corral.cluster._ray.gcs_authenticated` asks the GCS, as a client without a token, whether it
  refuses; ``corral cluster up`` and ``corral doctor`` warn (:data:`OPEN_WARNING`)
  when it does not. A client without the token gets :class:`~corral.errors.Unauthorized`.
- **corral's daemons.** Each node's daemon accepts only its own admin token
  (``token:<node_id>``, made by its node actor and kept while the cluster is up: a
  daemon Ray restarts gets it again), so a token leaked from one node is admin on that
  node only. Daemons fetch layers from each other with the cluster's peer credential
  (``peer-token``), which a daemon accepts on its read-only peer routes only
  (:mod:`corral.server.peer_auth`). ``corral cluster down`` forgets them all.
"""

from __future__ import annotations

import secrets
from typing import Any

from corral.cluster import _ray

NODE_TOKEN_KEY = "token:"  # + the node id: the admin token of that node's daemon
PEER_TOKEN_KEY = "peer-token"  # the peer credential: read-only layer fetches between daemons
LEGACY_TOKEN_KEY = "token"  # one token for every daemon (before per-node tokens): forgotten
OPEN_WARNING = (
    "warning: this Ray cluster does not authenticate its clients: anyone who reaches its "
    "GCS port ({address}) can read corral's daemon tokens from Ray's KV and run code on "
    "every node; turn on Ray's token authentication (start every node with "
    "RAY_AUTH_MODE=token and a token made by `ray get-auth-token --generate`)"
)


def open_warning(address: str) -> str | None:
    """:data:`OPEN_WARNING` if the GCS at ``address`` lets anyone in, else None."""
    return None if _ray.gcs_authenticated(address) else OPEN_WARNING.format(address=address)


def _made(gcs: Any, key: str) -> str:
    """The token at ``key``, made now if there is none (a concurrent maker's wins)."""
    _ray.kv_put(gcs, key, secrets.token_urlsafe(32).encode(), overwrite=False)
    raw = _ray.kv_get(gcs, key)
    assert raw, f"the KV lost {key} as it was made"
    return raw.decode()


def node_token(gcs: Any, node_id: str) -> str:
    """The admin token of ``node_id``'s daemon (made on its first start)."""
    return _made(gcs, NODE_TOKEN_KEY + node_id)


def peer_token(gcs: Any) -> str:
    """The cluster's peer credential (made on the first daemon's start)."""
    return _made(gcs, PEER_TOKEN_KEY)


def node_tokens(gcs: Any) -> dict[str, str]:
    """``{node_id: token}`` of every node whose daemon was started."""
    out = {}
    for key in _ray.kv_keys(gcs, NODE_TOKEN_KEY):
        raw = _ray.kv_get(gcs, key)
        if raw:
            out[key[len(NODE_TOKEN_KEY):]] = raw.decode()
    return out


def forget(gcs: Any) -> None:
    """Drop every token of the cluster (``corral cluster down``)."""
    for key in _ray.kv_keys(gcs, NODE_TOKEN_KEY):
        _ray.kv_del(gcs, key)
    _ray.kv_del(gcs, PEER_TOKEN_KEY)
    _ray.kv_del(gcs, LEGACY_TOKEN_KEY)
