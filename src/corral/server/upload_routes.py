"""Resumable uploads into a sandbox (tus's idea: an upload id and an offset).

::

    POST   /v1/sandboxes/{id}/uploads         {"path", "size", "mode"} -> {"upload_id", "offset": 0}
    PATCH  /v1/sandboxes/{id}/uploads/{uid}   Upload-Offset: N, the bytes from N -> {"offset", "done"}
    GET    /v1/sandboxes/{id}/uploads/{uid}   -> {"offset", "size", "done"}
    DELETE /v1/sandboxes/{id}/uploads/{uid}   abandon it

The bytes are staged on the host (``<state>/uploads/<uid>.part``) as they arrive: a
connection dropped at byte N leaves the upload at N (whatever was received), and the
next PATCH says ``Upload-Offset: N`` and sends the rest (another offset: 409
``invalid_state`` with ``details.offset``, the one to resume from). When the last byte
arrives the file is written into the sandbox (parents made, the given mode) and the
staged copy removed (the upload still answers GET with ``done`` for a while, in case
that reply was lost); a file is never seen half-written at its path.

An upload belongs to its caller's tenant and its sandbox: an id used by anyone else, or
with another sandbox, is answered exactly as an unknown one (``upload_not_found``). At
most :data:`MAX_UPLOADS` open per sandbox; ``size`` at most the sandbox's ``disk_mb``;
uploads of a sandbox that ended, and any idle for :data:`IDLE_S`, are dropped.
"""

from __future__ import annotations

import asyncio
import contextlib
import mmap
import os
import secrets
import shutil
import time
from dataclasses import dataclass, field
from pathlib import Path

from starlette.requests import ClientDisconnect, Request
from starlette.responses import JSONResponse, Response

from corral.api.models import UploadCreate
from corral.errors import (
    CorralError,
    FileTooLarge,
    InvalidArgument,
    InvalidState,
    UploadNotFound,
)
from corral.runtime.pathutil import resolve_path
from corral.server import context as ctx
from corral.server.caller import caller_of
from corral.server.wire import paced

MAX_UPLOADS = 16  # open at once per sandbox
IDLE_S = 24 * 3600.0
DONE_KEPT_S = 600.0  # a finished upload still answers GET (its last reply may be lost)
LOCK_WAIT_S = 10.0  # a PATCH waits this long for one still being received to end


@dataclass(eq=False)
class Upload:
    id: str
    sandbox_id: str
    owner: str | None
    path: str
    size: int
    mode: int
    part: Path
    offset: int = 0
    done: bool = False
    touched: float = field(default_factory=time.monotonic)
    lock: asyncio.Lock = field(default_factory=asyncio.Lock)

    def state(self) -> dict[str, object]:
        return {"upload_id": self.id, "sandbox_id": self.sandbox_id, "path": self.path,
                "size": self.size, "offset": self.offset, "done": self.done}


class Uploads:
    """The daemon's open uploads (in memory; their bytes under ``root``)."""

    def __init__(self, root: Path) -> None:
        self.root = root
        shutil.rmtree(root, ignore_errors=True)  # a previous daemon's: nobody can resume them
        self._by_id: dict[str, Upload] = {}

    def add(self, owner: str | None, sandbox_id: str, path: str, size: int, mode: int) -> Upload:
        if sum(u.sandbox_id == sandbox_id and not u.done
               for u in self._by_id.values()) >= MAX_UPLOADS:
            raise InvalidState(f"sandbox {sandbox_id} has {MAX_UPLOADS} uploads open: finish "
                               "or abandon some (DELETE .../uploads/ID)",
                               details={"sandbox_id": sandbox_id})
        self.root.mkdir(parents=True, exist_ok=True, mode=0o700)
        uid = "up-" + secrets.token_hex(16)
        part = self.root / f"{uid}.part"
        part.touch(mode=0o600)
        up = Upload(uid, sandbox_id, owner, path, size, mode, part)
        self._by_id[uid] = up
        return up

    def get(self, owner: str | None, sandbox_id: str, uid: str) -> Upload:
        up = self._by_id.get(uid)
        if up is None or up.owner != owner or up.sandbox_id != sandbox_id:
            raise UploadNotFound(f"no upload {uid[:64]!r} of sandbox {sandbox_id}: start one "
                                 "with POST .../uploads", details={"upload_id": uid[:64]})
        up.touched = time.monotonic()
        return up

    def drop(self, up: Upload) -> None:
        self._by_id.pop(up.id, None)
        up.part.unlink(missing_ok=True)

    def sweep(self, owner: str | None, alive: set[str]) -> None:
        """Drop ``owner``'s uploads of sandboxes not in ``alive`` (its running ones) and
        those idle too long."""
        now = time.monotonic()
        for up in list(self._by_id.values()):
            if up.owner != owner or up.lock.locked():
                continue
            idle = now - up.touched
            if up.sandbox_id not in alive or idle > IDLE_S or (up.done and idle > DONE_KEPT_S):
                self.drop(up)


def uploads(request: Request) -> Uploads:
    state = request.app.state
    if getattr(state, "uploads", None) is None:
        state.uploads = Uploads(ctx.engine(request).layout.state_dir / "uploads")
    return state.uploads  # type: ignore[no-any-return]


def _find(request: Request) -> Upload:
    sid = request.path_params["sandbox_id"]
    ctx.sandboxes(request).get(sid)  # SandboxNotFound for another tenant's
    return uploads(request).get(caller_of(request).name, sid, request.path_params["upload_id"])


async def create_upload(request: Request, body: UploadCreate) -> Response:
    sid = request.path_params["sandbox_id"]
    info = ctx.sandboxes(request).get(sid)
    if info.state.terminal:
        raise InvalidState(f"sandbox {sid} is {info.state.value}: upload into a running one",
                           details={"sandbox_id": sid})
    if body.size > info.spec.disk_mb << 20:
        raise FileTooLarge(f"{body.size} bytes do not fit sandbox {sid}'s disk_mb "
                           f"({info.spec.disk_mb}): create it with a larger disk_mb",
                           details={"size": body.size, "disk_mb": info.spec.disk_mb})
    path = resolve_path(info.spec.workdir, body.path)  # a bad path now, not at the end
    reg = uploads(request)
    reg.sweep(caller_of(request).name,
              {i.id for i in ctx.engine(request).list(owner=ctx.owner(request))
               if not i.state.terminal})
    up = reg.add(caller_of(request).name, sid, path, body.size, int(body.mode, 8))
    return JSONResponse(up.state(), status_code=201)


async def upload_state(request: Request) -> Response:
    return JSONResponse(_find(request).state())


async def abandon_upload(request: Request) -> Response:
    uploads(request).drop(_find(request))
    return Response(status_code=204)


def _offset(request: Request) -> int:
    raw = request.headers.get("upload-offset", "")
    if not raw.isdigit():
        raise InvalidArgument("send the header Upload-Offset: N (the upload's offset, from "
                              "GET .../uploads/ID)")
    return int(raw)


async def patch_upload(request: Request) -> Response:
    up = _find(request)
    offset = _offset(request)
    try:
        async with asyncio.timeout(LOCK_WAIT_S):
            await up.lock.acquire()
    except TimeoutError:
        raise InvalidState("another request is sending this upload's bytes: retry",
                           details={"offset": up.offset}) from None
    try:
        if offset != up.offset or up.done:
            raise InvalidState(f"the upload is at byte {up.offset} of {up.size}, not {offset}: "
                               "resume from there", details={"offset": up.offset})
        await _receive(request, up)
        if up.offset == up.size and not up.done:
            await _finish(request, up)
    finally:
        up.lock.release()
    return JSONResponse(up.state())


async def _receive(request: Request, up: Upload) -> None:
    """Append the body at the offset, as it comes; a dropped connection keeps what came."""
    fd = await asyncio.to_thread(os.open, up.part, os.O_WRONLY | os.O_CLOEXEC)
    try:
        async for chunk in paced(request):
            if up.offset + len(chunk) > up.size:
                raise InvalidArgument(f"more bytes than the upload's size ({up.size}): the "
                                      f"upload is at {up.offset}", details={"offset": up.offset})
            await asyncio.to_thread(os.pwrite, fd, chunk, up.offset)
            up.offset += len(chunk)
    except ClientDisconnect:
        pass  # what came is kept: the client resumes from up.offset
    finally:
        os.close(fd)


async def _finish(request: Request, up: Upload) -> None:
    """Write the staged file into the sandbox (from a mapping of it: no copy in memory)."""
    verbs = ctx.sandboxes(request)
    with open(up.part, "rb") as f:
        view = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) if up.size else b""
        try:
            await verbs.write_file(up.sandbox_id, up.path, view, mode=up.mode)
        except CorralError:
            await ctx.remove_partial(verbs, up.sandbox_id, up.path)
            uploads(request).drop(up)
            raise
        finally:
            if isinstance(view, mmap.mmap):
                with contextlib.suppress(BufferError):  # a slice still held: GC closes it
                    view.close()
    up.done = True
    up.part.unlink(missing_ok=True)  # its record answers GET a while: done
