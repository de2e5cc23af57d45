"""The files of a stopped sandbox: its writable layer, kept until it is deleted.

A sandbox's files live on a tmpfs in its own mount namespace, which goes when it stops.
When a sandbox stops (by request, its lifetime or idle timeout; not when deleted, nor
when the engine shuts down), :meth:`KeptFiles.keep` copies its writable layer out, its
processes frozen meanwhile, with the snapshot machinery (:meth:`Snapshots.stage`:
bounded by its ``disk_mb`` and ``inodes``, descriptor-relative, no symlink followed)
to ``<state_dir>/stopped/<id>`` — unless its ``disk_mb`` could take that disk below
its reserve (:meth:`KeptFiles.has_room`: 10 % of the filesystem, at least 1 GiB,
:func:`~corral.runtime.storage.room_above_reserve`).
``read``, ``stat`` and ``list_dir`` then serve the files the sandbox wrote; files of
its image that it never changed are not kept.

A tenant's kept files count with its snapshots against its ``max_snapshot_mb``
(:meth:`Snapshots.check_quota`): past it a stopping sandbox's files are not kept (and a
snapshot is refused while they are), so a loop of create, fill, stop cannot take the
disk from the other tenants. Each tree's size and owner are written beside it
(``kept.json``), so a restart counts them again.

The kept tree is hostile data, read by root: every path is walked from the tree's
root descriptor one component at a time with ``O_NOFOLLOW``; a symlink is resolved
*inside* the tree (an absolute target restarts at the tree's root, ``..`` never climbs
above it), at most :data:`MAX_SYMLINKS` deep; only regular files are read, with
``O_NONBLOCK`` (a FIFO never blocks). Deleting the sandbox removes the tree.
"""

from __future__ import annotations

import asyncio
import contextlib
import errno
import json
import logging
import os
import stat as st
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING

from corral.errors import CorralError, FileError, FileNotFound, FileTooLarge
from corral.runtime.events import Events, SandboxDeleted
from corral.runtime.layers import TREE
from corral.runtime.storage import room_above_reserve
from corral.runtime.treecopy import LEAVE, Walk, remove_tree
from corral.schema import FileInfo

if TYPE_CHECKING:
    from corral.runtime.live import Live
    from corral.runtime.snapshots import Snapshots

log = logging.getLogger("corral.runtime")

MAX_SYMLINKS = 40
RECORD = "kept.json"  # beside the tree: {"owner": tenant or null, "bytes": allocated}
# Stops whose sandbox's files are not kept: a delete, and the engine or daemon ending
# (copying every sandbox's files would hold up the shutdown).
NOT_KEPT = ("deleted", "engine closed", "the daemon shut down")
_O_DIR = os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC
_O_FILE = os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC
_O_PATH = os.O_PATH | os.O_NOFOLLOW | os.O_CLOEXEC


def keeps_files(reason: str) -> bool:
    """Whether a sandbox stopped for ``reason`` keeps its files."""
    return reason not in NOT_KEPT


class KeptFiles:
    """``<state_dir>/stopped``: one tree per stopped sandbox."""

    def __init__(self, root: Path, snapshots: Snapshots, events: Events) -> None:
        self.root = root
        self.snapshots = snapshots
        root.mkdir(mode=0o700, exist_ok=True)
        events.subscribe(SandboxDeleted, self._deleted)
        self._tasks: set[asyncio.Task[None]] = set()
        self._held: dict[str, tuple[str | None, int]] = {}  # id -> (owner, bytes)
        for entry in os.listdir(root):  # counted again after a restart
            with contextlib.suppress(OSError, ValueError, TypeError, KeyError):
                record = json.loads((root / entry / RECORD).read_text())
                self._held[entry] = (record["owner"], int(record["bytes"]))
        if snapshots is not None:  # they share the owner's max_snapshot_mb
            snapshots.also_held = self.bytes_of

    def bytes_of(self, owner: str | None) -> int:
        """Bytes the kept files of ``owner``'s stopped sandboxes take."""
        return sum(n for o, n in self._held.values() if o == owner)

    def has(self, sandbox_id: str) -> bool:
        return (self.root / sandbox_id / TREE).is_dir()

    async def keep(self, live: Live, upper: Path) -> None:
        """Copy the stopping sandbox's writable layer (``upper``, reached through its
        launcher) out. Never raises: a sandbox whose files cannot be kept (too many,
        its namespace already gone) is logged and stops anyway."""
        frozen = live.cgroup is not None and live.cgroup.frozen()
        if not self.has_room(live.spec.disk_mb << 20):
            log.warning("the files of sandbox %s are not kept after it stops: its disk_mb "
                        "(%d MiB) would take the disk under %s below its reserve",
                        live.id, live.spec.disk_mb, self.root)
            return
        staged = None
        try:
            staged = await self.snapshots.stage(
                upper, None if frozen else live.cgroup, source=live.id, spec=live.spec)
            size = await asyncio.to_thread(_allocated, staged)
            self.snapshots.check_quota(live.spec.tenant, {f"kept:{live.id}": size})
            # counted at once, with no await since the check: the next check sees it
            self._held[live.id] = (live.spec.tenant, size)
            record = json.dumps({"owner": live.spec.tenant, "bytes": size})
            await asyncio.to_thread((staged / RECORD).write_text, record)
            await asyncio.to_thread(os.rename, staged, self.root / live.id)
        except BaseException as exc:
            if not (self.root / live.id).exists():
                self._held.pop(live.id, None)
            if not isinstance(exc, (CorralError, OSError)):
                raise
            if staged is not None and staged.exists():
                await asyncio.to_thread(remove_tree, staged)
            message = exc.message if isinstance(exc, CorralError) else str(exc)
            log.warning("the files of sandbox %s are not kept after it stops: %s",
                        live.id, message)

    def has_room(self, need: int) -> bool:
        """Whether ``need`` more bytes leave the disk under :attr:`root` its reserve: a
        stream of stopped sandboxes (each filled up to its ``disk_mb``) cannot fill the
        host's disk; past the reserve their files are simply not kept."""
        return room_above_reserve(self.root) >= need

    def _deleted(self, ev: SandboxDeleted) -> None:
        self._held.pop(ev.sandbox_id, None)
        path = self.root / ev.sandbox_id
        if not path.exists():
            return
        with contextlib.suppress(RuntimeError):  # no loop: removed at the next sweep
            task = asyncio.get_running_loop().create_task(asyncio.to_thread(remove_tree, path))
            self._tasks.add(task)
            task.add_done_callback(self._tasks.discard)

    def sweep(self, exists: Callable[[str], bool]) -> None:
        """Remove the trees of sandboxes the registry no longer has (deleted while no
        engine ran, or a copy cut short)."""
        for entry in os.listdir(self.root):
            if not exists(entry) or not (self.root / entry / TREE).is_dir():
                remove_tree(self.root / entry)
                self._held.pop(entry, None)

    # ---------------------------------------------------------------- reading

    def _open(self, sandbox_id: str, path: str, flags: int) -> int:
        """A descriptor of ``path`` (absolute, normal) in the kept tree; a final
        symlink is followed (inside the tree) unless ``flags`` holds ``O_PATH``."""
        root = os.open(self.root / sandbox_id / TREE, _O_DIR)
        try:
            return _walk(root, path, flags)
        except OSError as exc:
            raise _error(sandbox_id, path, exc) from None
        finally:
            os.close(root)

    def read_at(
        self, sandbox_id: str, path: str, offset: int, length: int, max_bytes: int
    ) -> tuple[int, bytes]:
        """``(size, up to length bytes from offset)`` of a kept regular file, like the
        agent's ``FREAD``; :class:`FileTooLarge` if it is bigger than ``max_bytes``."""
        fd = self._open(sandbox_id, path, _O_FILE)
        try:
            info = os.fstat(fd)
            if not st.S_ISREG(info.st_mode):
                raise FileError(f"{path} in stopped sandbox {sandbox_id} is not a regular file",
                                details={"path": path, "sandbox_id": sandbox_id})
            if info.st_size > max_bytes:
                raise FileTooLarge(
                    f"{path} in sandbox {sandbox_id} is {info.st_size} bytes, over the "
                    f"{max_bytes}-byte read limit: raise max_bytes or read it in parts",
                    details={"path": path, "size": info.st_size, "limit": max_bytes})
            return info.st_size, os.pread(fd, length, offset)
        finally:
            os.close(fd)

    def read(self, sandbox_id: str, path: str, max_bytes: int) -> bytes:
        """A whole kept file (see :meth:`read_at`)."""
        size, data = self.read_at(sandbox_id, path, 0, max_bytes, max_bytes)
        return data[:size]

    def stat(self, sandbox_id: str, path: str) -> FileInfo:
        fd = self._open(sandbox_id, path, _O_PATH)
        try:
            return _info(path, os.fstat(fd))
        finally:
            os.close(fd)

    def list_dir(self, sandbox_id: str, path: str) -> list[FileInfo]:
        fd = self._open(sandbox_id, path, _O_DIR)
        try:
            infos = []
            for name in os.listdir(fd):
                with contextlib.suppress(OSError):
                    s = os.stat(name, dir_fd=fd, follow_symlinks=False)
                    if _whiteout(s):
                        continue
                    infos.append(_info(path.rstrip("/") + "/" + name, s))
            return sorted(infos, key=lambda i: i.name)
        finally:
            os.close(fd)


def _allocated(tree: Path) -> int:
    """Bytes the files under ``tree`` take on disk (bounded: it is a sandbox's disk_mb).
    Iterative: a sandbox makes its tree thousands of levels deep (os.walk recursed past
    Python's limit, and a stop failed with a traceback)."""
    return sum(s.st_blocks * 512 for event, parent, _name, s, _fd in Walk(tree, max_depth=None)
               if event != LEAVE and parent != -1)


def _whiteout(s: os.stat_result) -> bool:
    return st.S_ISCHR(s.st_mode) and s.st_rdev == 0


def _info(path: str, s: os.stat_result) -> FileInfo:
    if _whiteout(s):
        raise FileNotFoundError(errno.ENOENT, "removed by the sandbox")
    return FileInfo(path=path, name=path.rsplit("/", 1)[-1] or "/", size=s.st_size,
                    mode=st.S_IMODE(s.st_mode), mtime=s.st_mtime, is_dir=st.S_ISDIR(s.st_mode),
                    is_symlink=st.S_ISLNK(s.st_mode))


def _walk(root: int, path: str, flags: int) -> int:
    """Open ``path`` below ``root`` without ever leaving it (see the module docstring)."""
    todo = [p for p in path.split("/") if p not in ("", ".")]
    todo.reverse()
    stack = [os.dup(root)]  # descriptors of the directories walked through
    hops = 0
    try:
        while todo:
            name = todo.pop()
            if name == "..":
                if len(stack) > 1:
                    os.close(stack.pop())
                continue
            last = not todo
            fd = os.open(name, _O_PATH, dir_fd=stack[-1])
            s = os.fstat(fd)
            if st.S_ISLNK(s.st_mode) and not (last and flags & os.O_PATH):
                os.close(fd)
                hops += 1
                if hops > MAX_SYMLINKS:
                    raise OSError(errno.ELOOP, "too many levels of symbolic links")
                target = os.readlink(name, dir_fd=stack[-1])
                if target.startswith("/"):
                    while len(stack) > 1:
                        os.close(stack.pop())
                todo.extend(reversed([p for p in target.split("/") if p not in ("", ".")]))
                continue
            if _whiteout(s):
                os.close(fd)
                raise FileNotFoundError(errno.ENOENT, "removed by the sandbox")
            if last:
                if flags & os.O_PATH:
                    return fd
                os.close(fd)
                return os.open(name, flags, dir_fd=stack[-1])
            os.close(fd)
            stack.append(os.open(name, _O_DIR, dir_fd=stack[-1]))
        return os.dup(stack[-1])  # a directory: the root, or where ".." ended
    finally:
        for fd in stack:
            os.close(fd)


def _error(sandbox_id: str, path: str, exc: OSError) -> CorralError:
    details = {"path": path, "sandbox_id": sandbox_id}
    if exc.errno in (errno.ENOENT, errno.ENOTDIR):
        return FileNotFound(
            f"no {path} in stopped sandbox {sandbox_id}: after a sandbox stops, only the "
            "files it wrote or changed are kept (its image's files are not)", details=details)
    return FileError(f"cannot read {path} in stopped sandbox {sandbox_id}: "
                     f"{os.strerror(exc.errno or errno.EIO)}", details=details)
