"""What a route is, for the route table (:mod:`corral.server.endpoints`) and the
OpenAPI document (:mod:`corral.server.openapi`).

An endpoint whose ``body`` is a pydantic model gets it parsed and validated before its
handler runs (:func:`handler_of`): the handler is ``async def h(request, body)`` and
never reads the request's JSON itself. Bounded parsing and the error shape are those
of :func:`corral.server.wire.read_json` and :func:`corral.schema.validate_model`.
"""

from __future__ import annotations

import re
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Any

from pydantic import BaseModel
from starlette.requests import Request
from starlette.responses import Response

from corral.schema import validate_model
from corral.server.wire import read_json

RAW = "application/octet-stream"  # a body or reply of raw bytes
NDJSON = "application/x-ndjson"  # a reply of one JSON object per line
TEXT = "text/plain"  # a reply of plain text (GET /metrics: Prometheus's format)
Handler = Callable[..., Awaitable[Response]]  # (request) or (request, body)


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
    body_optional: bool = False  # an empty body is {} (every field has a default)
    body_name: str | None = None  # the body's name in errors (default: from its model)
    parse_body: bool = True  # False: the handler reads a model body itself (multipart)

    @property
    def takes_model(self) -> bool:
        """Whether the handler is given the validated body as its second argument."""
        return self.parse_body and isinstance(self.body, type) and issubclass(self.body, BaseModel)

    @property
    def body_label(self) -> str:
        """``StopRequest`` → ``"stop request"``: how errors name the body."""
        if self.body_name:
            return self.body_name
        name = getattr(self.body, "__name__", "body")
        return re.sub(r"(?<!^)(?=[A-Z])", " ", name).lower()


def handler_of(endpoint: Endpoint) -> Handler:
    """The Starlette handler: the endpoint's own, given its validated body if it takes one."""
    if not endpoint.takes_model:
        return endpoint.handler
    inner: Callable[[Request, Any], Awaitable[Response]] = endpoint.handler  # type: ignore[assignment]
    model, what, required = endpoint.body, endpoint.body_label, not endpoint.body_optional

    async def handler(request: Request) -> Response:
        data = await read_json(request, what, required=required)
        return await inner(request, validate_model(model, data, what))

    handler.__name__ = getattr(inner, "__name__", "handler")
    handler.__doc__ = inner.__doc__
    return handler
