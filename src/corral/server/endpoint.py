"""What the daemon serves: an :class:`~corral.api.operation.Operation` (the shared
declaration, :mod:`corral.api.operations`) bound to its handler.

:func:`bind` resolves the operation's models (a :class:`~corral.api.operation.Ref`
names one that still lives in a daemon module) and wraps the handler: the caller's
access is checked first (:class:`~corral.api.operation.Access`), then a body that is a
pydantic model is parsed and validated, so the handler is ``async def h(request,
body)`` and never reads the request's JSON itself. Bounded parsing and the error shape
are those of :func:`corral.server.wire.read_json` and
:func:`corral.schema.validate_model`.
"""

from __future__ import annotations

import re
from collections.abc import Awaitable, Callable
from dataclasses import dataclass

from pydantic import BaseModel
from starlette.requests import Request
from starlette.responses import Response

from corral.api.operation import NDJSON, RAW, TEXT, Access, Operation, Query
from corral.schema import validate_model
from corral.server.caller import require_admin, require_image_rights, require_peer
from corral.server.wire import read_json

__all__ = ["NDJSON", "RAW", "TEXT", "Endpoint", "Handler", "Query", "bind"]

Handler = Callable[..., Awaitable[Response]]  # (request) or (request, body)


@dataclass(frozen=True)
class Endpoint:
    """A served route: its operation (models resolved) and its handler."""

    op: Operation
    handler: Handler

    @property
    def takes_model(self) -> bool:
        """Whether the handler is given the validated body as its second argument."""
        body = self.op.body
        return self.op.parse_body and isinstance(body, type) and issubclass(body, BaseModel)

    @property
    def body_label(self) -> str:
        """``StopRequest`` → ``"stop request"``: how errors name the body."""
        if self.op.body_name:
            return self.op.body_name
        name = getattr(self.op.body, "__name__", "body")
        return re.sub(r"(?<!^)(?=[A-Z])", " ", name).lower()


def bind(op: Operation, handler: Handler) -> Endpoint:
    """``op`` served by ``handler`` (its models resolved)."""
    return Endpoint(op,
                    handler)


def _check_access(op: Operation, request: Request) -> None:
    what = f"{op.method} {op.path}"
    if op.access is Access.ADMIN:
        require_admin(request, what)
    elif op.access is Access.PEER:
        require_peer(request)
    elif op.access is Access.IMAGES:
        require_image_rights(request, what)


def handler_of(endpoint: Endpoint) -> Handler:
    """The Starlette handler: access checked, then the endpoint's own handler, given its
    validated body if it takes one."""
    op, inner = endpoint.op, endpoint.handler
    if endpoint.takes_model:
        model, what, required = op.body, endpoint.body_label, not op.body_optional

        async def handler(request: Request) -> Response:
            _check_access(op, request)
            data = await read_json(request, what, required=required)
            return await inner(request, validate_model(model, data, what))
    elif op.access in (Access.ANYONE, Access.CALLER):
        return inner  # nothing to add: the exec path stays one call
    else:

        async def handler(request: Request) -> Response:
            _check_access(op, request)
            return await inner(request)

    handler.__name__ = getattr(inner, "__name__", "handler")
    handler.__doc__ = inner.__doc__
    return handler
