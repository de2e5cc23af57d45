"""The Connect protocol as E2B's envd speaks it, over HTTP/1.1, JSON codec only.

The ``e2b`` client reaches envd (processes, filesystem) through ``connectrpc`` with a
JSON codec and no compression (``e2b.envd.client_shared``):

- a **unary** call is ``POST /<service>/<Method>`` with ``Content-Type:
  application/json`` and the request message as the body; the reply is ``200`` with
  the response message, or an error status with ``{"code", "message"}`` (``code`` one
  of Connect's names, e.g. ``not_found``);
- a **server stream** (``Start``, ``Connect``) sends ``application/connect+json``: its
  body is one *envelope* (1 flag byte, a 4-byte big-endian length, the JSON message).
  The reply is ``200`` and a sequence of envelopes, ending with one whose flag is
  ``0x02`` (end of stream) holding ``{}`` or ``{"error": {"code", "message"}}``.

The request's deadline (``Connect-Timeout-Ms``) is :func:`deadline`. Bodies are read
bounded (:data:`MAX_MESSAGE`), and a malformed one is ``invalid_argument``.
"""

from __future__ import annotations

import base64
import functools
import json
import struct
from collections.abc import AsyncIterator, Awaitable, Callable
from datetime import datetime, timezone
from typing import Any

from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse

from corral.errors import CorralError, InvalidArgument, SandboxNotFound
from corral.schema import FileInfo, SandboxState
from corral.server import context as ctx
from corral.server.limits import parse_json
from corral.server.wire import read_body

MAX_MESSAGE = 8 << 20  # a request message (SendInput carries stdin chunks)
END_STREAM = 0x02
STREAM_TYPE = "application/connect+json"
MAX_TIMEOUT_MS = 10**10
SANDBOX_TAG = "e2b"  # on every sandbox the E2B front-end made
USERS = ("user", "sandbox")  # E2B's default user; corral's one user

# corral's HTTP status -> Connect's error code (what the client maps to its exceptions).
CODES = {
    400: "invalid_argument",
    401: "unauthenticated",
    403: "permission_denied",
    404: "not_found",
    408: "deadline_exceeded",
    409: "failed_precondition",
    413: "resource_exhausted",
    429: "resource_exhausted",
    501: "unimplemented",
    503: "unavailable",
    507: "resource_exhausted",
}
STATUS = {  # Connect's code -> the HTTP status of a unary error reply
    "invalid_argument": 400, "unauthenticated": 401, "permission_denied": 403,
    "not_found": 404, "already_exists": 409, "failed_precondition": 412,
    "deadline_exceeded": 504, "resource_exhausted": 429, "unimplemented": 501,
    "unavailable": 502, "internal": 500, "unknown": 500,
}


class ConnectError(Exception):
    """An error with a Connect code; a :class:`CorralError` is turned into one by
    :func:`connect_error`."""

    def __init__(self, code: str, message: str) -> None:
        super().__init__(message)
        self.code, self.message = code, message


def connect_error(exc: CorralError | ConnectError) -> ConnectError:
    if isinstance(exc, ConnectError):
        return exc
    return ConnectError(CODES.get(exc.status, "internal"), exc.message)


def error_reply(exc: CorralError | ConnectError) -> JSONResponse:
    """A unary call's error: its status and ``{"code", "message"}``."""
    err = connect_error(exc)
    return JSONResponse({"code": err.code, "message": err.message},
                        status_code=STATUS.get(err.code, 500))


def envelope(message: dict[str, Any], flags: int = 0) -> bytes:
    data = json.dumps(message, separators=(",", ":")).encode()
    return struct.pack(">BI", flags, len(data)) + data


def end_stream(exc: CorralError | ConnectError | None = None) -> bytes:
    if exc is None:
        return envelope({}, END_STREAM)
    err = connect_error(exc)
    return envelope({"error": {"code": err.code, "message": err.message}}, END_STREAM)


def _json_object(raw: bytes | bytearray, what: str) -> dict[str, Any]:
    # The daemon's one bounded parser: depth and value counts capped before parsing.
    data = parse_json(raw, f"{what} message") if raw else {}
    if not isinstance(data, dict):
        raise InvalidArgument(f"{what}: the message must be a JSON object")
    return data


async def unary_message(request: Request, what: str) -> dict[str, Any]:
    """The JSON message of a unary call."""
    kind = request.headers.get("content-type", "").split(";")[0].strip().lower()
    if kind != "application/json":
        raise ConnectError("invalid_argument", f"{what}: only the JSON codec is served "
                           f"(Content-Type application/json), not {kind or 'none'!r}")
    return _json_object(await read_body(request, MAX_MESSAGE, what), what)


async def stream_message(request: Request, what: str) -> dict[str, Any]:
    """The one JSON message a server-streaming call sends, out of its envelope."""
    kind = request.headers.get("content-type", "").split(";")[0].strip().lower()
    if kind != STREAM_TYPE:
        raise ConnectError("invalid_argument", f"{what}: only {STREAM_TYPE} is served")
    raw = await read_body(request, MAX_MESSAGE + 5, what)
    if len(raw) < 5:
        raise InvalidArgument(f"{what}: no message envelope")
    flags, size = struct.unpack(">BI", raw[:5])
    if flags != 0 or size != len(raw) - 5:
        raise InvalidArgument(f"{what}: a malformed or compressed message envelope")
    return _json_object(raw[5:], what)


def deadline(request: Request) -> float | None:
    """Seconds the client gives the call (``Connect-Timeout-Ms``), or None."""
    raw = request.headers.get("connect-timeout-ms", "")
    if not (raw.isdecimal() and len(raw) <= 11 and 0 < int(raw) <= MAX_TIMEOUT_MS):
        return None
    return int(raw) / 1000


def stream_reply(chunks: AsyncIterator[bytes]) -> Response:
    return StreamingResponse(chunks, media_type=STREAM_TYPE)


Handler = Callable[[Request], Awaitable[Response]]


def caught(handler: Handler, reply: Callable[[Any], Response] = error_reply) -> Handler:
    """``handler``, its :class:`CorralError` or :class:`ConnectError` answered by
    ``reply`` (the shape of its client); anything else goes on to the guard (500)."""

    @functools.wraps(handler)
    async def wrapped(request: Request) -> Response:
        try:
            return await handler(request)
        except (CorralError, ConnectError) as exc:
            return reply(exc)

    return wrapped


def iso(ts: float) -> str:
    """A unix time as E2B writes it (RFC 3339, UTC)."""
    return datetime.fromtimestamp(ts, timezone.utc).isoformat().replace("+00:00", "Z")


def entry_json(info: FileInfo) -> dict[str, Any]:
    """A file's envd EntryInfo (``Stat``, ``ListDir``, a watch event's ``entry``)."""
    kind = "FILE_TYPE_DIRECTORY" if info.is_dir else "FILE_TYPE_FILE"
    perms = "".join(c if info.mode & (1 << (8 - i)) else "-" for i, c in enumerate("rwxrwxrwx"))
    return {
        "name": info.name,
        "type": kind,
        "path": info.path,
        "size": info.size,
        "mode": info.mode,
        "permissions": ("d" if info.is_dir else "-") + perms,
        "owner": "user",
        "group": "user",
        "modifiedTime": iso(info.mtime),
        "isSymlink": info.is_symlink,
    }


# ----------------------------------------------------- what every envd call needs


def sandbox_id(request: Request) -> str:
    """The running sandbox an envd call is for (``E2b-Sandbox-Id``, whose access
    token the guard checked); ``not_found`` unless the E2B front-end made it."""
    sid = request.headers.get("e2b-sandbox-id", "")
    try:
        info = ctx.sandboxes(request).get(sid)
    except SandboxNotFound:
        info = None
    if info is None or SANDBOX_TAG not in info.spec.tags or info.state.terminal:
        # E2B's proxy words it so, and its client then raises SandboxNotRunningException.
        raise ConnectError("unavailable", f"The sandbox {sid} was not found: it was killed "
                           "or reached its timeout")
    if info.state == SandboxState.PAUSED:
        raise ConnectError("unavailable", f"sandbox {sid} is paused: Sandbox.connect() "
                           "resumes it")
    return info.id


def check_user(request: Request, query_user: str | None = None) -> str | None:
    """The user an E2B call names (``Authorization: Basic base64(user:)`` or
    ``?username=``): ``"root"`` for root of the sandbox's user namespace
    (docs/users.md), ``None`` for E2B's default ``user`` (corral's sandbox user, uid
    1000). Any other is refused, not ignored."""
    user = query_user
    auth = request.headers.get("authorization", "")
    if user is None and auth.lower().startswith("basic "):
        try:
            user = base64.b64decode(auth[6:].strip(), validate=True).decode().partition(":")[0]
        except (ValueError, UnicodeDecodeError):
            raise ConnectError("invalid_argument", "malformed Authorization header") from None
    if user == "root":
        return "root"
    if user and user not in USERS:
        raise ConnectError(
            "permission_denied",
            f"user {user[:64]!r}: a corral sandbox has two users, E2B's default 'user' "
            "(corral's sandbox user, uid 1000) and 'root' (root of the sandbox's user "
            "namespace): use one of them",
        )
    return None
