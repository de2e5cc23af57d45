"""The peer credential: what another daemon of the cluster may do here, and nothing more.

Daemons of a cluster fetch snapshots' and images' layers from each other
(:mod:`corral.server.peer_layers`). They do it with the cluster's peer credential
(``CORRAL_PEER_TOKEN``, which ``corral cluster up`` sets; never a command-line option),
not with an admin token: a daemon accepts it only for the operations declared
``Access.PEER`` (:mod:`corral.api.operations`: a snapshot's or an image's description,
one layer's stream, and "read the cluster's tenant registry again now", which changes
nothing by itself), and refuses it (403) everywhere else, before any route runs. So the credential every
daemon holds reads layers and descriptions, and cannot create, exec, delete or list.

Each daemon's admin token is its own (``CORRAL_TOKEN``, one per node on a cluster,
:mod:`corral.cluster.auth`).
"""

from __future__ import annotations

import hashlib
import hmac

from starlette.types import Scope

from corral.api.operation import Access
from corral.api.operations import match
from corral.errors import Forbidden


class PeerCredential:
    """The daemon's peer credential (None: it accepts none), checked in constant time."""

    def __init__(self, token: str | None) -> None:
        self._digest = hashlib.sha256(token.encode()).digest() if token else None

    def matches(self, given: str) -> bool:
        if self._digest is None:
            return False
        digest = hashlib.sha256(given.encode("utf-8", "surrogatepass")).digest()
        return hmac.compare_digest(digest, self._digest)

    @staticmethod
    def refusal(scope: Scope) -> Forbidden | None:
        """None if the peer credential may make this request, else why not."""
        found = match(str(scope.get("method")), scope.get("path") or "")
        if found is not None and found[0].access is Access.PEER:
            return None
        return Forbidden(
            f"{scope.get('method')} {str(scope.get('path'))[:200]} is not a peer read: the cluster's "
            "peer credential only fetches layers, snapshot and image descriptions; use "
            "this node's own token (the cluster client reads it from Ray's KV)"
        )
