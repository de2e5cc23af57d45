"""What every compatibility front-end needs: errors in the other service's shape.

Native corral routes answer errors as ``{"error": {"code", "message", "details"}}``
(see :mod:`corral.server.wire`). Clients written for other services look for the code
and message at the top level of the body (Tensorlake's ``RemoteAPIError.code`` reads
``body["code"]``), so a front-end's handlers answer the same error flat:
``{"code", "message", "details"}``, with the same HTTP status. The status is what those
clients map to their own exception types (404 → "not found", 401 → auth error, ...).
"""

from __future__ import annotations

import functools
from collections.abc import Awaitable, Callable, Mapping

from starlette.requests import Request
from starlette.responses import JSONResponse, Response

from corral.errors import CorralError, InvalidArgument, Unsupported
from corral.schema import NetworkMode

Handler = Callable[[Request], Awaitable[Response]]


def flat_error_response(err: CorralError) -> JSONResponse:
    """The reply for an error: its HTTP status and ``err.to_dict()`` at the top level."""
    # A refused upload may still be arriving: hang up rather than read it all.
    headers = {"Connection": "close"} if err.status == 413 else None
    return JSONResponse(err.to_dict(), status_code=err.status, headers=headers)


def flat_errors(handler: Handler) -> Handler:
    """Wrap a handler so that a :class:`CorralError` it raises is answered flat.

    Anything else propagates to the daemon's guard (logged, answered 500)."""

    @functools.wraps(handler)
    async def wrapped(request: Request) -> Response:
        try:
            return await handler(request)
        except CorralError as exc:
            return flat_error_response(exc)

    return wrapped


def unsupported(service: str) -> Handler:
    """A handler for the parts of ``service``'s API that corral does not implement:
    501 ``unsupported`` naming the call, instead of a bare 404 that reads like a bug."""

    async def handler(request: Request) -> Response:
        err = Unsupported(
            f"{request.method} {request.url.path} is part of the {service} API that "
            f"corral's {service} front-end does not implement; see corral's docs "
            f"(docs/) on {service} compatibility for what is supported",
            details={"method": request.method, "path": request.url.path},
        )
        return flat_error_response(err)

    return handler


def name_pairs(environ: Mapping[str, str], var: str, example: str) -> dict[str, str]:
    """A front-end's ``name=image,...`` setting (``var``), parsed; :class:`InvalidArgument`
    naming the malformed entry (the daemon then refuses to start)."""
    out = {}
    for pair in filter(None, (p.strip() for p in environ.get(var, "").split(","))):
        name, sep, image = (s.strip() for s in pair.partition("="))
        if not sep or not name or not image:
            raise InvalidArgument(
                f"invalid {var} entry {pair!r}: use name=corral-image pairs separated by "
                f"commas, e.g. {example!r}"
            )
        out[name] = image
    return out


def compat_network(environ: Mapping[str, str]) -> NetworkMode:
    """``CORRAL_COMPAT_NETWORK``: the network a front-end's sandbox gets when its client
    asks for internet access (``none``, the default, or ``host``)."""
    raw = environ.get("CORRAL_COMPAT_NETWORK", "").strip() or NetworkMode.NONE.value
    try:
        return NetworkMode(raw)
    except ValueError:
        raise InvalidArgument(
            f"invalid CORRAL_COMPAT_NETWORK {raw!r}: use 'none' (no network, the "
            "default) or 'host'"
        ) from None
