"""envd's filesystem: the ``filesystem.Filesystem`` service and the ``/files`` and
``/health`` HTTP endpoints, on corral's file operations.

What the ``e2b`` SDK's ``sandbox.files`` calls:

- ``GET /files?path=P`` reads a file (text, bytes or a stream, all one download);
  ``POST /files?path=P`` writes one, as ``application/octet-stream`` or as
  ``multipart/form-data`` (one part per file, the part's filename its path);
  the reply lists what was written. Bodies are bounded by the daemon's
  ``max_upload_bytes``; a failed upload leaves no half-written file.
- ``Stat``, ``ListDir`` (with ``depth``: a bounded breadth-first walk), ``MakeDir``
  (``already_exists`` if it does), ``Move`` (``mv`` in the sandbox, as its user) and
  ``Remove`` (recursive) are unary Connect calls (:mod:`.e2b_connect`).
- ``WatchDir`` and the watcher calls (``files.watch_dir``): :mod:`.e2b_watch`.

Paths are the sandbox's own: relative ones start at its workdir. With ``user="root"``
reads, writes, ``MakeDir``, ``Move`` and ``Remove`` run as root of the sandbox's user
namespace (``cat``, ``mkdir``, ``mv``, ``rm`` run by the agent as root: docs/users.md);
``Stat``, ``ListDir`` and watchers read as the sandbox user whoever asks.
"""

from __future__ import annotations

from collections import deque
from collections.abc import AsyncIterator
from typing import Any

from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

from corral.errors import (
    CorralError,
    FileError,
    FileNotFound,
    InvalidArgument,
    OutputBudgetExceeded,
)
from corral.runtime.output_budget import OutputHold
from corral.server import context as ctx
from corral.server.compat import e2b_watch
from corral.server.compat.e2b_connect import (
    ConnectError,
    caught,
    check_user,
    entry_json,
    error_reply,
    sandbox_id,
    unary_message,
)
from corral.server.multipart import boundary_of, file_parts
from corral.server.wire import HeldResponse, body_pieces, file_response

SERVICE = "/filesystem.Filesystem/"
MAX_LISTED = 10_000  # entries a ListDir returns at most
MAX_PARTS = 100  # files in one multipart upload


def _http_error(exc: CorralError | ConnectError) -> JSONResponse:
    """An envd HTTP endpoint's error: ``{"code": status, "message"}``."""
    if isinstance(exc, ConnectError):
        return error_reply(exc)
    return JSONResponse({"code": exc.status, "message": exc.message}, status_code=exc.status)


def _path(msg: dict[str, Any], key: str = "path") -> str:
    value = msg.get(key)
    if not isinstance(value, str) or not value or "\0" in value:
        raise ConnectError("invalid_argument", f"{key} must be a non-empty path")
    return value


# ------------------------------------------------------------------ rpc


async def stat(request: Request) -> Response:
    sid = sandbox_id(request)
    check_user(request)
    info = await ctx.sandboxes(request).stat(sid, _path(await unary_message(request, "Stat")))
    return JSONResponse({"entry": entry_json(info)})


async def list_dir(request: Request) -> Response:
    sid = sandbox_id(request)
    check_user(request)
    msg = await unary_message(request, "ListDir")
    root = _path(msg)
    depth = msg.get("depth", 1) or 1
    if not isinstance(depth, int) or depth < 1:
        raise ConnectError("invalid_argument", "depth must be at least 1")
    engine = ctx.sandboxes(request)
    if not (await engine.stat(sid, root)).is_dir:
        raise ConnectError("invalid_argument", f"{root} is not a directory")
    out: list[dict[str, Any]] = []
    todo: deque[tuple[str, int]] = deque([(root, 1)])
    while todo and len(out) < MAX_LISTED:  # breadth first, bounded
        path, level = todo.popleft()
        try:
            children = await engine.list_dir(sid, path)
        except FileError:
            continue  # unreadable below the top, or gone meanwhile
        for child in children[: MAX_LISTED - len(out)]:
            out.append(entry_json(child))
            if child.is_dir and not child.is_symlink and level < depth:
                todo.append((child.path, level + 1))
    return JSONResponse({"entries": out})


async def make_dir(request: Request) -> Response:
    sid = sandbox_id(request)
    user = check_user(request)
    path = _path(await unary_message(request, "MakeDir"))
    engine = ctx.sandboxes(request)
    try:
        await engine.stat(sid, path)
    except FileNotFound:
        if user:
            await _as_user(engine, sid, user, ["mkdir", "-p", "--", path], path)
        else:
            await engine.mkdir(sid, path, parents=True)
        return JSONResponse({"entry": entry_json(await engine.stat(sid, path))})
    raise ConnectError("already_exists", f"{path} already exists")


async def move(request: Request) -> Response:
    sid = sandbox_id(request)
    user = check_user(request)
    msg = await unary_message(request, "Move")
    source, dest = _path(msg, "source"), _path(msg, "destination")
    engine = ctx.sandboxes(request)
    await engine.stat(sid, source)  # FileNotFound: not_found
    result = await engine.exec(sid, ["mv", "-T", "--", source, dest], timeout=60, user=user)
    if result.returncode != 0:
        raise ConnectError("invalid_argument", f"cannot move {source} to {dest}: "
                           + result.stderr.decode(errors="replace").strip()[:500])
    return JSONResponse({"entry": entry_json(await engine.stat(sid, dest))})


async def remove(request: Request) -> Response:
    sid = sandbox_id(request)
    user = check_user(request)
    path = _path(await unary_message(request, "Remove"))
    engine = ctx.sandboxes(request)
    if user:
        await engine.stat(sid, path)  # FileNotFound: not_found
        await _as_user(engine, sid, user, ["rm", "-rf", "--", path], path)
    else:
        await engine.remove(sid, path, recursive=True)
    return JSONResponse({})


async def _as_user(engine: Any, sid: str, user: str, argv: list[str], path: str, *,
                   stdin: bytes | memoryview | None = None, max_output: int = 1 << 16,
                   output_hold: OutputHold | None = None) -> bytes:
    """Run a file operation as ``user`` (root: the agent's own file operations are
    the sandbox user's, docs/users.md); its stdout, or :class:`FileError`."""
    result = await engine.exec(sid, argv, timeout=300, user=user, max_output=max_output,
                               stdin=bytes(stdin) if stdin is not None else None,
                               output_hold=output_hold)
    if output_hold is not None and output_hold.limited and result.stdout_truncated:
        raise OutputBudgetExceeded(
            f"{path}: the daemon's memory for commands' output is taken by replies not "
            f"yet sent ({output_hold.max_output} bytes left for this one): retry when "
            "some downloads have ended", details={"path": path, "sandbox_id": sid})
    if result.returncode != 0 or result.stdout_truncated:
        text = result.stderr.decode(errors="replace").strip()[:500]
        if "No such file" in text:
            raise FileNotFound(f"{path}: no such file in the sandbox", details={"path": path})
        raise FileError(f"{path}: {text or 'the file is too large'}", details={"path": path})
    return bytes(result.stdout)


async def unimplemented(request: Request) -> Response:
    name = request.url.path.rsplit("/", 1)[-1]
    return error_reply(ConnectError(
        "unimplemented", f"{name} is not an envd filesystem call corral's E2B front-end "
        "serves"))


# ----------------------------------------------------------------- http


async def health(request: Request) -> Response:
    sandbox_id(request)
    return Response(status_code=204)


def _query_user(request: Request) -> str | None:
    return check_user(request, request.query_params.get("username"))


async def download(request: Request) -> Response:
    sid = sandbox_id(request)
    user = _query_user(request)
    path = request.query_params.get("path", "")
    if not path:
        raise InvalidArgument("path is required")
    limit = ctx.settings(request).max_upload_bytes
    if user:  # as root: `cat` run by the agent as root (bounded like the agent's read)
        # The file is in this process's memory until the reply is written: it holds its
        # room in the output budget until then, as a native exec's result does.
        verbs = ctx.sandboxes(request)
        hold = verbs.reserve_output(sid, limit)
        try:
            data = await _as_user(verbs, sid, user, ["cat", "--", path], path,
                                  max_output=limit, output_hold=hold)
            return HeldResponse(data, hold, media_type="application/octet-stream")
        except BaseException:
            hold.release()
            raise
    return file_response(await ctx.sandboxes(request).open_read(sid, path, max_bytes=limit))


async def upload(request: Request) -> Response:
    sid = sandbox_id(request)
    user = _query_user(request)
    engine = ctx.sandboxes(request)
    path = request.query_params.get("path")
    if request.headers.get("content-encoding"):
        raise InvalidArgument("compressed uploads (gzip=True) are not served: leave out gzip")
    if any(k.lower().startswith("x-metadata-") for k in request.headers):
        raise InvalidArgument("file metadata (files.write(metadata=...)) is not kept by "
                              "corral's E2B front-end: leave out metadata")
    pieces = body_pieces(request, ctx.settings(request).max_upload_bytes, "upload")
    kind = request.headers.get("content-type", "")
    written = []

    async def write(name: str, data: AsyncIterator[bytes]) -> None:
        if user:  # as root, like envd: parents made, the file root's. Held whole here
            # (bounded by max_upload_bytes) and fed to `cat` run by the agent as root
            whole = b"".join([piece async for piece in data])
            try:
                await _as_user(engine, sid, user, ["sh", "-c", 'mkdir -p -- "$(dirname -- '
                               '"$1")" && cat > "$1"', "sh", name], name, stdin=whole)
            except CorralError:
                await ctx.remove_partial(engine, sid, name)
                raise
        else:
            await ctx.write_whole(request, sid, name, data)
        info = await engine.stat(sid, name)
        written.append({"name": info.name, "type": "file", "path": info.path})

    if kind.startswith("multipart/form-data"):
        boundary = boundary_of(kind)
        async for name, data in file_parts(pieces, boundary, max_parts=MAX_PARTS):
            if name is None:
                continue
            if path is not None and written:
                raise InvalidArgument("one file per upload with ?path=: leave out path to "
                                      "name each file by its part's filename")
            await write(path if path is not None else name, data)
    else:
        if not path:
            raise InvalidArgument("path is required")
        await write(path, pieces)
    return JSONResponse(written)


async def no_route(scope: Any, receive: Any, send: Any) -> None:
    path = scope.get("path", "")
    reply = error_reply(ConnectError("unimplemented", f"{path} is not an envd call corral's "
                                     "E2B front-end serves"))
    await reply(scope, receive, send)


def routes() -> list[Route]:
    rpc = {"Stat": stat, "ListDir": list_dir, "MakeDir": make_dir, "Move": move,
           "Remove": remove, "CreateWatcher": e2b_watch.create_watcher,
           "GetWatcherEvents": e2b_watch.get_watcher_events,
           "RemoveWatcher": e2b_watch.remove_watcher}
    out = [Route(SERVICE + name, caught(h), methods=["POST"])
           for name, h in rpc.items()]
    out.append(Route(SERVICE + "WatchDir", e2b_watch.watch_dir, methods=["POST"]))
    out.append(Route(SERVICE + "{name}", unimplemented, methods=["POST"]))
    out += [
        Route("/health", caught(health, _http_error), methods=["GET"]),
        Route("/files", caught(download, _http_error), methods=["GET"]),
        Route("/files", caught(upload, _http_error), methods=["POST"]),
    ]
    return out
