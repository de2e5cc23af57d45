"""What one endpoint of the HTTP API is, declared once for the daemon and the SDK.

An :class:`Operation` says everything both sides need to agree on: the method and path
template, the request and reply models, the status of success, the query parameters,
the error codes it may answer, who may call it (:class:`Access`) and how a cluster
client routes it (:class:`Routing`). The daemon serves each one with a handler
(``corral.server.endpoints``) and documents it (``GET /openapi.json``); the SDK builds
its requests from it (:meth:`Operation.url`) and its cluster router dispatches on its
:attr:`Operation.routing` (``corral.client._async._router``).

This module needs only pydantic and the standard library: the SDK imports it on Python
3.10 without the daemon's extras.
"""

from __future__ import annotations

import enum
import re
from dataclasses import dataclass
from typing import Any
from urllib.parse import quote

from corral.errors import (
    CorralError,
    Forbidden,
    HeadersTooLarge,
    InternalError,
    RequestTimeout,
    TooManyRequests,
    Unauthorized,
)

__all__ = [
    "COMMON_ERRORS", "NDJSON", "RAW", "TEXT", "Access", "Operation", "Query", "Routing",
]

RAW = "application/octet-stream"  # a body or reply of raw bytes
NDJSON = "application/x-ndjson"  # a reply of one JSON object per line
TEXT = "text/plain"  # a reply of plain text (GET /metrics: Prometheus's format)

_PARAM = re.compile(r"{(\w+)}")

COMMON_ERRORS: tuple[type[CorralError], ...] = (
    Unauthorized, Forbidden, TooManyRequests, HeadersTooLarge, RequestTimeout, InternalError,
)
"""What any endpoint may answer: refused at the door (credentials, throttling, the
peer credential off its routes), a request too slow or too large, a daemon fault."""


class Access(enum.Enum):
    """Who may call an operation (the daemon's door resolves the caller; the handler,
    or the door for ``PEER``, refuses the others with 403 ``forbidden``)."""

    ANYONE = "anyone"  # no credential needed (is the daemon up)
    CALLER = "caller"  # the admin, or a tenant on its own things only
    IMAGES = "images"  # the admin, or a tenant whose token grants --allow-images
    ADMIN = "admin"  # the admin only (the Unix socket or the daemon's token)
    PEER = "peer"  # another daemon of the cluster (its peer credential), or the admin


class Routing(enum.Enum):
    """Where a cluster client (``ray://``) sends an operation: its router has one
    dispatch per value, so an operation without one cannot be declared."""

    SANDBOX = "sandbox"  # the node its {sandbox_id} names (sb-<node tag>-<hex>)
    PLACE = "place"  # a new sandbox: placement by room (or node=), its image brought there
    HOLDER = "holder"  # the node that holds the snapshot named in the path
    EVERYWHERE = "everywhere"  # every node (a snapshot's copies on each)
    POOL = "pool"  # the node(s) that hold the pool named in the path
    POOL_CREATE = "pool_create"  # node=, every node (spread), else the home node
    MERGE = "merge"  # every node, the replies' lists merged
    SUM = "sum"  # every node, the replies summed (GET /v1/info)
    SPLIT = "split"  # the items split by the nodes their sandbox ids name, replies joined
    LEASE = "lease"  # every alive node, one lease under one id (a create takes it there)
    HOME = "home"  # the caller's own things (tokens, leases, images, volumes): the home node
    VOLUME = "volume"  # the home of the volume named in the path (where it was made), else
    #                    the home node (which then says it is not found)
    NODE = "node"  # about one node itself (peer, cluster, metrics): only ever sent to a
    #                named node, which a cluster client treats as its home node


@dataclass(frozen=True)
class Query:
    """A query parameter (documented; the handler checks it)."""

    name: str
    type: str
    description: str
    required: bool = False
    repeat: bool = False
    enum: tuple[str, ...] = ()  # the only values it takes
    min_length: int | None = None


Model = Any  # a pydantic model class, a media type, or (media type, model of each line)


@dataclass(frozen=True)
class Operation:
    """One endpoint: what it takes, gives back and may answer (``reply`` None: 204)."""

    name: str  # the OpenAPI operationId and the daemon's handler key
    method: str
    path: str  # a template: {sandbox_id}, {name}...
    summary: str
    body: Model = None
    reply: Model = None
    status: int = 200
    query: tuple[Query, ...] = ()
    errors: tuple[type[CorralError], ...] = ()  # besides COMMON_ERRORS
    access: Access = Access.CALLER
    routing: Routing = None  # type: ignore[assignment]  # required (checked below)
    body_optional: bool = False  # an empty body is {} (every field has a default)
    body_name: str | None = None  # the body's name in errors (default: from its model)
    parse_body: bool = True  # False: the handler reads a model body itself (multipart)

    def __post_init__(self) -> None:
        if not isinstance(self.routing, Routing):
            raise TypeError(f"operation {self.name} ({self.method} {self.path}) declares no "
                            "routing: say how a cluster client sends it (corral.api.Routing)")

    @property
    def params(self) -> tuple[str, ...]:
        """The path's parameters, in order."""
        return tuple(_PARAM.findall(self.path))

    def url(self, **params: object) -> str:
        """The path with each parameter filled in (percent-encoded: an id or a name
        never adds a path segment)."""
        if set(params) != set(self.params):
            raise TypeError(f"{self.name} takes the path parameters {self.params}, "
                            f"not {tuple(params)}")
        return _PARAM.sub(lambda m: quote(str(params[m.group(1)]), safe=""), self.path)

    def codes(self) -> tuple[str, ...]:
        """The error codes it may answer (its own and every operation's), sorted."""
        return tuple(sorted({e.code for e in (*COMMON_ERRORS, *self.errors)}))

    def pattern(self) -> re.Pattern[str]:
        """A regular expression matching the paths of this operation (a parameter is
        one segment, percent-encoded)."""
        parts = _PARAM.split(self.path)
        regex = "".join(re.escape(p) if i % 2 == 0 else f"(?P<{p}>[^/]+)"
                        for i, p in enumerate(parts))
        return re.compile(regex)
