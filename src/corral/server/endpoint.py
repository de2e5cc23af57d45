"""What a route is, for the route table (:mod:`corral.server.endpoints`) and the
OpenAPI document (:mod:`corral.server.openapi`)."""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Any

from starlette.requests import Request
from starlette.responses import Response

RAW = "application/octet-stream"  # a body or reply of raw bytes
NDJSON = "application/x-ndjson"  # a reply of one JSON object per line
Handler = Callable[[Request], Awaitable[Response]]


@dataclass(frozen=True)
class Query:
    """A query parameter, for the OpenAPI document."""

    name: str
    type: str
    description: str
    required: bool = False
    repeat: bool = False
    enum: tuple[str, ...] = ()  # the only values it takes (documented: the handler checks)
    min_length: int | None = None


@dataclass(frozen=True)
class Endpoint:
    """One route: what it takes and what it gives back (``reply`` None means 204)."""

    method: str
    path: str
    handler: Handler
    summary: str
    body: Any = None
    reply: Any = None
    status: int = 200
    query: tuple[Query, ...] = ()
