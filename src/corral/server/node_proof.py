"""``GET /v1/cluster/proof?nonce=N``: a node's daemon proves who it is, before any
credential reaches it (:mod:`corral.cluster.proof` says why and how).

Served ahead of every guard, without credentials, by a daemon that ``corral cluster
up`` started with a node key (``CORRAL_NODE_KEY``); it signs its node id, the address
and port the connection arrived at, and the client's nonce. Nothing else is answered
here, and the key never leaves the process.
"""

from __future__ import annotations

import re

from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.types import ASGIApp, Receive, Scope, Send

from corral.cluster.proof import NONCE_BYTES, PROOF_PATH, sign
from corral.errors import InvalidArgument, NotFound
from corral.server.settings import ServerSettings
from corral.server.wire import error_response

_NONCE = re.compile(rb"nonce=([0-9a-f]{%d})" % (2 * NONCE_BYTES))


class NodeProof:
    """ASGI middleware answering :data:`~corral.cluster.proof.PROOF_PATH` itself."""

    def __init__(self, app: ASGIApp, *, node_id: str, key: str) -> None:
        self.app = app
        self.node_id = node_id
        self._key = key

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or scope.get("path") != PROOF_PATH:
            await self.app(scope, receive, send)
            return
        found = _NONCE.fullmatch(scope.get("query_string") or b"")
        server = scope.get("server") or ("", None)
        if scope.get("method") != "GET" or found is None or server[1] is None:
            refusal = InvalidArgument(
                f"GET {PROOF_PATH}?nonce=<{2 * NONCE_BYTES} hex digits>, over TCP, is a "
                "node's proof of identity (corral.cluster.proof)")
            await error_response(refusal)(scope, receive, send)
            return
        nonce = found.group(1).decode()
        signature = sign(self._key, self.node_id, str(server[0]), int(server[1]), nonce)
        await JSONResponse({"node_id": self.node_id, "signature": signature})(
            scope, receive, send)


async def node_proof(request: Request) -> Response:
    """The declared route behind :class:`NodeProof`: reached only on a daemon that
    answers no proofs (a daemon with a node key answers them before any route)."""
    raise NotFound(
        f"this daemon proves no node identity: {PROOF_PATH} is answered by a daemon that "
        "`corral cluster up` started with a node key (CORRAL_NODE_KEY)")


def mount(app: Starlette, settings: ServerSettings) -> None:
    """Answer proofs on ``app`` if this daemon serves a node with a key."""
    if settings.node is not None and settings.node_key:
        app.add_middleware(NodeProof, node_id=settings.node, key=settings.node_key)
