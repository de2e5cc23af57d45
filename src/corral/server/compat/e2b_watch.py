"""envd's directory watching (``files.watch_dir``): ``WatchDir`` (a server stream, the
async SDK) and ``CreateWatcher`` / ``GetWatcherEvents`` / ``RemoveWatcher`` (unary,
the sync SDK's polling handle), on inotify inside the sandbox.

A watcher is one small process in the sandbox (:mod:`corral.guest.e2b_watcher`, standard library
only, so any image with ``python3`` serves), started as the sandbox's user: it watches
the directory (and, ``recursive``, its subdirectories, new ones too, at most
:data:`MAX_DIRS`) and writes one JSON line per event: ``{"name"}`` relative to the
watched directory and ``{"type"}`` among ``create``, ``write``, ``remove``,
``rename``, ``chmod`` (fsnotify's, as envd reports them); with ``include_entry``,
also ``{"entry"}``: the entry's ``lstat`` in the sandbox when the event is read (none
once it is gone: removed, renamed away). The watcher never follows a symlink (an
entry that is one describes the link: its own size, mode and target text), and it
runs in the sandbox's own mount namespace as its user: nothing of the host is ever
stat-ed, so a symlink swapped in under the watched directory names only what the
sandbox itself could read. The daemon trusts none of it
(the sandbox's own code could write to that pipe): every line is parsed by the bounded
parser, checked, and kept in a bounded queue (:data:`MAX_EVENTS` a watcher, the oldest
dropped first); a sandbox has at most :data:`MAX_WATCHERS`. A watcher ends with its
stream (the client's timeout or ``stop()``), with ``RemoveWatcher``, or with its
sandbox.
"""

from __future__ import annotations

import asyncio
import secrets
import stat
from collections import deque
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Any

from starlette.requests import Request
from starlette.responses import JSONResponse, Response

from corral.errors import CorralError, FileNotFound, InvalidArgument
from corral.guest import program
from corral.runtime.processes import Process, ProcessState
from corral.schema import FileInfo
from corral.server import context as ctx
from corral.server.compat.e2b_connect import (
    ConnectError,
    check_user,
    end_stream,
    entry_json,
    envelope,
    sandbox_id,
    stream_message,
    stream_reply,
    unary_message,
)
from corral.server.limits import parse_json

MAX_WATCHERS = 16  # per sandbox
MAX_EVENTS = 4096  # kept per watcher until read; older ones are dropped
MAX_DIRS = 4096  # directories one recursive watcher watches
MAX_LINE = 16 << 10
MAX_NAME = 4096
START_TIMEOUT_S = 30.0
KEEPALIVE_S = 30.0
TYPES = {"create": "EVENT_TYPE_CREATE", "write": "EVENT_TYPE_WRITE",
         "remove": "EVENT_TYPE_REMOVE", "rename": "EVENT_TYPE_RENAME",
         "chmod": "EVENT_TYPE_CHMOD"}

WATCHER = program("e2b_watcher")


@dataclass
class Watcher:
    id: str
    proc: Process
    with_entry: bool = False
    events: deque[dict[str, Any]] = field(default_factory=lambda: deque(maxlen=MAX_EVENTS))
    changed: asyncio.Event = field(default_factory=asyncio.Event)
    task: asyncio.Task[None] | None = None
    ended: bool = False

    async def pump(self) -> None:
        """Read its events until the process ends."""
        try:
            while True:
                raw = await self.proc.readline(MAX_LINE)
                if not raw:
                    return
                event = _event(raw, self.with_entry)
                if event is not None:
                    self.events.append(event)
                    self.changed.set()
        except CorralError:
            return
        finally:
            self.ended = True
            self.changed.set()

    def drain(self) -> list[dict[str, Any]]:
        out = list(self.events)
        self.events.clear()
        self.changed.clear()
        return out


def _event(raw: bytes, with_entry: bool = False) -> dict[str, Any] | None:
    """A validated event line of a watcher, as envd's FilesystemEvent, or None."""
    try:
        msg = parse_json(raw, "watcher event")
    except CorralError:
        return None
    if not isinstance(msg, dict):
        return None
    name, kind = msg.get("name"), msg.get("type")
    if not isinstance(name, str) or len(name) > MAX_NAME or kind not in TYPES:
        return None
    out: dict[str, Any] = {"name": name, "type": TYPES[kind]}
    if with_entry and msg.get("entry") is not None:
        entry = _entry(msg["entry"])
        if entry is not None:
            out["entry"] = entry
    return out


def _entry(raw: Any) -> dict[str, Any] | None:
    """A watcher's ``lstat`` of an entry as envd's EntryInfo, or None if any field is
    missing or out of range."""
    if not isinstance(raw, dict):
        return None
    path, size, mode, mtime = (raw.get(k) for k in ("path", "size", "mode", "mtime"))
    target = raw.get("target")
    if (not isinstance(path, str) or not path.startswith("/") or len(path) > MAX_NAME
            or "\0" in path or not _int(size, 1 << 63) or not _int(mode, 1 << 16)
            or isinstance(mtime, bool) or not isinstance(mtime, (int, float))
            or not 0 <= mtime < 1 << 40
            or target is not None and (not isinstance(target, str) or len(target) > MAX_NAME)):
        return None
    info = FileInfo(path=path, name=path.rsplit("/", 1)[-1] or "/", size=size,
                    mode=stat.S_IMODE(mode), mtime=float(mtime), is_dir=stat.S_ISDIR(mode),
                    is_symlink=stat.S_ISLNK(mode))
    entry = entry_json(info)
    if info.is_symlink and target is not None:
        entry["symlinkTarget"] = target
    return entry


def _int(value: Any, bound: int) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and 0 <= value < bound


class Watchers:
    """The watchers of every sandbox, by sandbox id, then watcher id."""

    def __init__(self) -> None:
        self.by_sandbox: dict[str, dict[str, Watcher]] = {}

    def of(self, sid: str) -> dict[str, Watcher]:
        mine = self.by_sandbox.setdefault(sid, {})
        for ident in [k for k, w in mine.items() if w.ended and not w.events]:
            del mine[ident]
        return mine

    async def start(self, request: Request, sid: str, msg: dict[str, Any]) -> Watcher:
        path, recursive = msg.get("path"), msg.get("recursive", False)
        if not isinstance(path, str) or not path or "\0" in path:
            raise InvalidArgument("path must be a non-empty string")
        if not isinstance(recursive, bool):
            raise InvalidArgument("recursive must be a boolean")
        with_entry = msg.get("includeEntry", msg.get("include_entry", False))
        if not isinstance(with_entry, bool):
            raise InvalidArgument("include_entry must be a boolean")
        mine = self.of(sid)
        if len(mine) >= MAX_WATCHERS:
            raise ConnectError("resource_exhausted", f"sandbox {sid} has {MAX_WATCHERS} "
                               "directory watchers already: stop one first")
        proc = await ctx.sandboxes(request).spawn(
            sid, ["python3", "-u", "-c", WATCHER, path, "1" if recursive else "0",
                  str(MAX_DIRS), "1" if with_entry else "0"], max_buffer=MAX_LINE * 4)
        try:
            first = await asyncio.wait_for(proc.readline(MAX_LINE), START_TIMEOUT_S)
            msg = parse_json(first, "watcher start") if first else {}
            if not isinstance(msg, dict) or msg.get("ready") is not True:
                why = msg.get("error") if isinstance(msg, dict) else None
                if why == "not_found":
                    raise FileNotFound(f"{path}: no such directory to watch")
                if why == "not_a_directory":
                    raise ConnectError("invalid_argument", f"{path} is not a directory")
                raise ConnectError("internal", f"cannot watch {path}: "
                                   f"{str(why)[:200] if why else 'the watcher did not start'}")
        except BaseException:
            await asyncio.shield(_stop(proc))
            raise
        watcher = Watcher(secrets.token_hex(8), proc, with_entry)
        watcher.task = asyncio.get_running_loop().create_task(watcher.pump())
        mine[watcher.id] = watcher
        return watcher

    def get(self, sid: str, ident: Any) -> Watcher:
        watcher = self.of(sid).get(ident) if isinstance(ident, str) else None
        if watcher is None:
            raise ConnectError("not_found", f"watcher {ident!r} not found in sandbox {sid} "
                               "(stopped, ended, or never made)")
        return watcher

    async def remove(self, sid: str, watcher: Watcher) -> None:
        self.by_sandbox.get(sid, {}).pop(watcher.id, None)
        await _stop(watcher.proc)
        if watcher.task is not None:
            watcher.task.cancel()

    def forget(self, sid: str) -> None:
        """Its sandbox ended (and its watchers with it)."""
        for watcher in self.by_sandbox.pop(sid, {}).values():
            if watcher.task is not None:
                watcher.task.cancel()


async def _stop(proc: Process) -> None:
    if proc.state == ProcessState.RUNNING:
        try:
            await proc.kill()
        except CorralError:
            pass  # it ended meanwhile


def _watchers(request: Request) -> Watchers:
    return request.app.state.e2b_watchers


async def create_watcher(request: Request) -> Response:
    sid = sandbox_id(request)
    check_user(request)
    watcher = await _watchers(request).start(request, sid, await unary_message(
        request, "CreateWatcher"))
    return JSONResponse({"watcherId": watcher.id})


def _watcher_id(msg: dict[str, Any]) -> Any:
    return msg.get("watcherId", msg.get("watcher_id"))


async def get_watcher_events(request: Request) -> Response:
    sid = sandbox_id(request)
    msg = await unary_message(request, "GetWatcherEvents")
    watchers = _watchers(request)
    return JSONResponse({"events": watchers.get(sid, _watcher_id(msg)).drain()})


async def remove_watcher(request: Request) -> Response:
    sid = sandbox_id(request)
    msg = await unary_message(request, "RemoveWatcher")
    watchers = _watchers(request)
    await watchers.remove(sid, watchers.get(sid, _watcher_id(msg)))
    return JSONResponse({})


async def watch_dir(request: Request) -> Response:
    try:
        sid = sandbox_id(request)
        check_user(request)
        watchers = _watchers(request)
        watcher = await watchers.start(request, sid, await stream_message(request, "WatchDir"))
    except (CorralError, ConnectError) as exc:
        return stream_reply(_only(end_stream(exc)))
    return stream_reply(_stream(watchers, sid, watcher))


async def _only(chunk: bytes) -> AsyncIterator[bytes]:
    yield chunk


async def _stream(watchers: Watchers, sid: str, watcher: Watcher) -> AsyncIterator[bytes]:
    """``start``, then each event as it comes (``keepalive`` when none does), until the
    client leaves (its timeout, ``stop()``) or the sandbox ends; the watcher goes too."""
    try:
        yield envelope({"start": {}})
        while True:
            for event in watcher.drain():
                yield envelope({"filesystem": event})
            if watcher.ended:
                yield end_stream()
                return
            try:
                await asyncio.wait_for(watcher.changed.wait(), KEEPALIVE_S)
            except asyncio.TimeoutError:
                yield envelope({"keepalive": {}})
    finally:
        await asyncio.shield(watchers.remove(sid, watcher))
