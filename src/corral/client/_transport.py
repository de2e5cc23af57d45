"""The one place where HTTP failures become corral errors.

- A reply with an error status carries ``{"error": {"code", "message", "details"}}``;
  :func:`corral.errors.error_from_dict` rebuilds the typed exception from it.
- A transport failure (nothing listening, connection lost, no answer in time) is a
  :class:`~corral.errors.DaemonUnavailable` that says how to get a daemon.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import httpx

from corral.client._config import Endpoint
from corral.errors import CorralError, DaemonUnavailable, error_from_dict

# The code to assume when a reply has an error status but no corral error body
# (a proxy in between, or a server bug).
_STATUS_CODES = {
    400: "invalid_argument",
    401: "unauthorized",
    403: "unauthorized",
    404: "not_found",
    408: "sandbox_timeout",
    413: "file_too_large",
    503: "daemon_unavailable",
}


def error_from_response(response: httpx.Response) -> CorralError:
    """The typed error of a reply with an error status (its body must be read)."""
    payload: Any = None
    try:
        payload = response.json().get("error")
    except (ValueError, AttributeError):
        pass
    if not isinstance(payload, dict) or "code" not in payload:
        text = response.text.strip()[:300] or response.reason_phrase
        request = response.request
        payload = {
            "code": _STATUS_CODES.get(response.status_code, "internal"),
            "message": f"{request.method} {request.url.path}: HTTP {response.status_code}: {text}",
            "details": {"status": response.status_code},
        }
    return error_from_dict(payload)


def raise_for_status(response: httpx.Response) -> None:
    """Raise the typed error of ``response`` if it has an error status."""
    if response.is_error:
        raise error_from_response(response)


def unavailable(endpoint: Endpoint, exc: httpx.TransportError) -> DaemonUnavailable:
    """The :class:`DaemonUnavailable` for a transport failure, with what to do about it."""
    if isinstance(exc, (httpx.ConnectError, httpx.ConnectTimeout)):
        if endpoint.uds:
            hint = (
                "start one with `corral serve` (as root), or set CORRAL_URL to a running "
                "daemon (unix:///path/to.sock or http://host:port)"
            )
        else:
            hint = "check that `corral serve --tcp HOST:PORT` runs there and CORRAL_URL is right"
        message = f"cannot reach the corral daemon at {endpoint.url} ({exc or type(exc).__name__}): {hint}"
    elif isinstance(exc, httpx.TimeoutException):
        message = (
            f"the corral daemon at {endpoint.url} did not answer in time ({type(exc).__name__}): "
            "it may be overloaded; pass a larger timeout= to the client"
        )
    else:
        message = (
            f"lost the connection to the corral daemon at {endpoint.url} "
            f"({type(exc).__name__}: {exc}): it may have exited; check its log"
        )
    return DaemonUnavailable(message, details={"url": endpoint.url})


@contextmanager
def daemon_errors(endpoint: Endpoint) -> Iterator[None]:
    """Turn httpx's transport errors raised inside the block into ``DaemonUnavailable``."""
    try:
        yield
    except httpx.TransportError as exc:
        raise unavailable(endpoint, exc) from exc


def is_connect_error(exc: BaseException) -> bool:
    """True if the request never reached a daemon (so retrying it is safe)."""
    return isinstance(exc.__cause__, (httpx.ConnectError, httpx.ConnectTimeout))
