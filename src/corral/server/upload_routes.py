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
most :data:`MAX_UPLOADS` open per sandbox; the sizes of a sandbox's open uploads add
up to at most its ``disk_mb`` (sixteen of them each as large would stage 16x its disk
on the host), and all open uploads fit above the state directory's disk reserve
(:func:`~corral.runtime.storage.room_above_reserve`, ``storage_full`` else); uploads of
a sandbox that ended go with it, and any idle for :data:`IDLE_S` are dropped.

The same uploads go into a volume (:mod:`corral.server.volume_uploads`): their key is
``volume:NAME`` instead of a sandbox id, and the last byte writes the file into the
volume.

Uploads survive a restart of the daemon: each has a record next to its bytes
(``<uid>.json``: owner, sandbox, path, size, mode, done; written atomically), and the
next daemon takes them back at its first upload request, each at the offset its staged
bytes reach (what a killed daemon had received and written). A record that does not
parse, or whose bytes are gone, is dropped, and so is one whose sandbox ended before
that request (its end was not heard: the bytes would stay on disk for good).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import mmap
import os
import secrets
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

from starlette.requests import ClientDisconnect, Request
from starlette.responses import JSONResponse, Response

from corral.api.models import UploadCreate
from corral.errors import (
    CorralError,
    FileTooLarge,
    InvalidArgument,
    InvalidState,
    StorageFull,
    UploadNotFound,
    VolumeNotFound,
)
from corral.runtime.events import SandboxEnded
from corral.runtime.pathutil import resolve_path
from corral.runtime.storage import room_above_reserve
from corral.server import context as ctx
from corral.server.caller import caller_of
from corral.server.wire import paced

if TYPE_CHECKING:
    from corral.runtime.engine import Engine

MAX_UPLOADS = 16  # open at once per sandbox
IDLE_S = 24 * 3600.0
DONE_KEPT_S = 600.0  # a finished upload still answers GET (its last reply may be lost)
LOCK_WAIT_S = 10.0  # a PATCH waits this long for one still being received to end
VOLUME_KEY = "volume:"  # an upload into a volume: its key, in place of a sandbox id


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

    @property
    def volume(self) -> str | None:
        """The volume it goes into (its key ``volume:NAME``), else None (a sandbox)."""
        return self.sandbox_id.removeprefix(VOLUME_KEY) if self.sandbox_id.startswith(
            VOLUME_KEY) else None

    def state(self) -> dict[str, object]:
        where = ({"volume": self.volume} if self.volume is not None
                 else {"sandbox_id": self.sandbox_id})
        return {"upload_id": self.id, **where, "path": self.path,
                "size": self.size, "offset": self.offset, "done": self.done}

    def save(self) -> None:
        """Its record, next to its bytes (a temporary file renamed into place)."""
        record = {"id": self.id, "sandbox_id": self.sandbox_id, "owner": self.owner,
                  "path": self.path, "size": self.size, "mode": self.mode, "done": self.done}
        tmp = self.part.with_suffix(".json.tmp")
        tmp.write_text(json.dumps(record))
        os.replace(tmp, self.part.with_suffix(".json"))

    @classmethod
    def load(cls, record: Path) -> Upload | None:
        """The upload a previous daemon left (its offset: the bytes it staged), or None."""
        try:
            r = json.loads(record.read_text())
            up = cls(str(r["id"]), str(r["sandbox_id"]), r["owner"], str(r["path"]),
                     int(r["size"]), int(r["mode"]), record.with_suffix(".part"),
                     done=bool(r["done"]))
            if up.id != record.stem or not (up.owner is None or isinstance(up.owner, str)):
                return None
            up.offset = up.size if up.done else up.part.stat().st_size
        except (OSError, ValueError, KeyError, TypeError):
            return None
        return up if 0 <= up.offset <= up.size else None


class Uploads:
    """The daemon's open uploads (in memory; their bytes under ``root``)."""

    def __init__(self, root: Path) -> None:
        self.root = root
        self._by_id: dict[str, Upload] = {}
        for record in sorted(root.glob("up-*.json")) if root.is_dir() else []:
            up = Upload.load(record)
            if up is None:
                record.unlink(missing_ok=True)
                record.with_suffix(".part").unlink(missing_ok=True)
            else:
                self._by_id[up.id] = up
        for stray in root.glob("*.tmp") if root.is_dir() else []:
            stray.unlink(missing_ok=True)

    def add(self, owner: str | None, sandbox_id: str, path: str, size: int, mode: int,
            disk_bytes: int) -> Upload:
        mine = [u for u in self._by_id.values() if u.sandbox_id == sandbox_id and not u.done]
        if len(mine) >= MAX_UPLOADS:
            raise InvalidState(f"sandbox {sandbox_id} has {MAX_UPLOADS} uploads open: finish "
                               "or abandon some (DELETE .../uploads/ID)",
                               details={"sandbox_id": sandbox_id})
        held = sum(u.size for u in mine)
        if held + size > disk_bytes:
            raise FileTooLarge(
                f"sandbox {sandbox_id}'s open uploads already declare {held} bytes: {size} more "
                f"do not fit its disk_mb ({disk_bytes >> 20}); finish or abandon some first",
                details={"size": size, "open_bytes": held, "disk_mb": disk_bytes >> 20})
        self.root.mkdir(parents=True, exist_ok=True, mode=0o700)
        owed = sum(u.size - u.offset for u in self._by_id.values() if not u.done)
        room = room_above_reserve(self.root)
        if owed + size > room:
            raise StorageFull(
                f"no room for {size} more bytes of uploads under {self.root} (the host's disk "
                "keeps its reserve free): finish or abandon open uploads, or free space there",
                details={"path": str(self.root), "size": size, "room": max(0, room - owed)})
        uid = "up-" + secrets.token_hex(16)
        part = self.root / f"{uid}.part"
        part.touch(mode=0o600)
        up = Upload(uid, sandbox_id, owner, path, size, mode, part)
        try:
            up.save()
        except OSError:
            part.unlink(missing_ok=True)
            raise
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
        up.part.with_suffix(".json").unlink(missing_ok=True)
        up.part.unlink(missing_ok=True)

    def ended(self, event: SandboxEnded) -> None:
        """A sandbox ended: its uploads go, whoever's (a revoked tenant never comes back
        to sweep its own; a PATCH still receiving finds its upload gone)."""
        for up in [u for u in self._by_id.values() if u.sandbox_id == event.sandbox_id]:
            self.drop(up)

    def keep_only(self, alive: set[str], has_volume: Callable[[Upload], bool]) -> None:
        """Drop every upload of a sandbox not in ``alive``, or into a volume that
        ``has_volume`` says is gone, whoever's."""
        for up in list(self._by_id.values()):
            if not (has_volume(up) if up.volume is not None else up.sandbox_id in alive):
                self.drop(up)

    def sweep(self, owner: str | None, alive: set[str]) -> None:
        """Drop ``owner``'s uploads of sandboxes not in ``alive`` (its running ones) and
        those idle too long."""
        now = time.monotonic()
        for up in list(self._by_id.values()):
            if up.owner != owner or up.lock.locked():
                continue
            idle = now - up.touched
            gone = up.volume is None and up.sandbox_id not in alive
            if gone or idle > IDLE_S or (up.done and idle > DONE_KEPT_S):
                self.drop(up)


def uploads(request: Request) -> Uploads:
    state = request.app.state
    if getattr(state, "uploads", None) is None:
        engine = ctx.engine(request)
        reg = Uploads(engine.layout.state_dir / "uploads")
        engine.events.subscribe(SandboxEnded, reg.ended)
        # taken back from the previous daemon: those of sandboxes that ended before this
        # first upload request (no SandboxEnded was heard for them) go now, whoever's
        reg.keep_only({i.id for i in engine.list(owner=None) if not i.state.terminal},
                      lambda up: _volume_exists(engine, up))
        state.uploads = reg
    return state.uploads  # type: ignore[no-any-return]


def _volume_exists(engine: Engine, up: Upload) -> bool:
    try:
        engine.get_volume(str(up.volume), owner=up.owner)
    except VolumeNotFound:
        return False
    return True


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
    up = reg.add(caller_of(request).name, sid, path, body.size, int(body.mode, 8),
                 info.spec.disk_mb << 20)
    return JSONResponse(up.state(), status_code=201)


async def upload_state(request: Request) -> Response:
    return JSONResponse(_find(request).state())


async def abandon_upload(request: Request) -> Response:
    uploads(request).drop(_find(request))
    return Response(status_code=204)


def _offset(request: Request) -> int:
    raw = request.headers.get("upload-offset", "")
    if not raw.isdecimal():
        raise InvalidArgument("send the header Upload-Offset: N (the upload's offset, from "
                              "GET .../uploads/ID)")
    return int(raw)


async def patch_upload(request: Request) -> Response:
    return await receive_patch(request, _find(request), _finish)


async def receive_patch(request: Request, up: Upload,
                        finish: Callable[[Request, Upload], Awaitable[None]]) -> Response:
    """A PATCH of ``up``'s bytes; ``finish`` once the last one is here."""
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
        # abandoned (DELETE) while its bytes came: UploadNotFound, not a traceback
        uploads(request).get(caller_of(request).name, up.sandbox_id, up.id)
        if up.offset == up.size and not up.done:
            await finish(request, up)
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
    await finished(up)


async def finished(up: Upload) -> None:
    """Its file is in place: its record answers GET a while (done), its bytes go."""
    up.done = True
    await asyncio.to_thread(up.save)
    up.part.unlink(missing_ok=True)
