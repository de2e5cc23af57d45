"""Walking, copying and removing trees a sandbox wrote, as the threat model requires.

A sandbox's writable layer is hostile data: sparse files of terabytes, millions of
entries, trees thousands of levels deep, symlinks and hard links anywhere. Everything
the host does with such a tree goes through here, and is:

- **iterative**: an explicit stack, never recursion (no ``RecursionError``);
- **descriptor-relative**: each entry is reached from its parent directory's descriptor
  with ``O_NOFOLLOW`` (no path ever exceeds ``PATH_MAX``, no symlink is ever followed,
  a directory swapped for another is detected by its inode). Only a window of
  :data:`WINDOW` ancestors keeps its descriptor open; a closed one is reopened through
  ``..`` and checked against the inode it had;
- **sparse-aware**: a regular file is copied extent by extent (``SEEK_DATA`` /
  ``SEEK_HOLE``), so holes stay holes, and hashed the same way (:func:`file_hash`);
- **bounded**: a :class:`Budget` (the sandbox's ``disk_mb`` and ``inodes``, and
  :data:`MAX_DEPTH`) is charged *before* each entry and each extent is copied, so the
  copy stops with :class:`~corral.errors.SnapshotTooLarge` as soon as it would exceed
  what the sandbox could hold.

Hard links are copied once per inode and linked after; FIFOs and sockets are recreated
(never opened); whiteouts (0/0 character devices) are kept; other device nodes, which
no sandbox can make, are dropped.
"""

from __future__ import annotations

import errno
import hashlib
import itertools
import os
import stat
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, NamedTuple

from corral.errors import CorralError, InternalError, SnapshotTooLarge, StorageFull
from corral.runtime import streamhash, syscalls
from corral.runtime.streamhash import Hasher
from corral.runtime.uids import translate_acl

if TYPE_CHECKING:
    from corral.schema import SandboxSpec

WINDOW = 32  # ancestors whose descriptors stay open during a walk
MAX_DEPTH = 4096  # levels of directories a committed tree may have
BLOCK = 4096
# Entries of the writable layer's tmpfs besides the sandbox's own files: its root, the
# overlay upper and work directories, /.corral. The tmpfs gets ``inodes`` + this, the
# commit is charged against the same, so nothing the tmpfs held is refused.
INODE_SLACK = 16
_O_DIR = os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC
# O_NONBLOCK: a file swapped for a FIFO between its stat and its open (a copy made
# while the sandbox runs: corral.runtime.precopy) must not block the copy
_O_READ = os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC | os.O_NONBLOCK
_O_CREATE = os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC
_CHUNK = 1 << 30
DROPPED_XATTRS = frozenset({
    "trusted.overlay.origin", "trusted.overlay.impure", "trusted.overlay.uuid",
    "trusted.overlay.nlink",
})
ENTER, NODE, LEAVE = "enter", "node", "leave"


@dataclass
class Budget:
    """What a copy may still write: bytes allocated (whole blocks) and entries."""

    max_bytes: int
    max_inodes: int
    what: str = "the sandbox"
    details: dict[str, object] = field(default_factory=dict)
    bytes: int = 0
    inodes: int = 0
    room: int | None = None  # bytes before the disk's reserve (storage.room_above_reserve)

    @classmethod
    def for_spec(cls, spec: SandboxSpec, what: str, **details: object) -> "Budget":
        return cls(spec.disk_mb << 20, spec.inodes + INODE_SLACK, what, details)

    def add_inode(self) -> None:
        self.inodes += 1
        if self.inodes > self.max_inodes:
            value = self.max_inodes - INODE_SLACK
            raise self.exceeded("inodes", value, f"more than {value} files and directories")

    def add_bytes(self, n: int) -> None:
        self.bytes += -(-n // BLOCK) * BLOCK
        if self.room is not None and self.bytes > self.room:
            raise StorageFull(
                f"the files of {self.what} do not fit on the disk under corral's state "
                "directory above its reserve (10 % of it, at least 1 GiB, kept free so "
                "snapshots cannot fill the host's disk): nothing was kept; delete "
                "snapshots or free space there and retry",
                details={**self.details, "room_bytes": max(self.room, 0)},
            )
        if self.bytes > self.max_bytes:
            raise self.exceeded("disk_mb", self.max_bytes >> 20,
                                f"more than {self.max_bytes >> 20} MB of data")

    def exceeded(self, limit: str, value: int, what: str) -> SnapshotTooLarge:
        return SnapshotTooLarge(
            f"the files of {self.what} hold {what} ({limit}={value}), more than it could "
            "have written itself: nothing was kept; remove files in it, or raise its "
            f"{limit} if the limit is meant to allow this",
            details={**self.details, "limit": limit, "value": value},
        )


def fd_path(dir_fd: int | None, name: str) -> str:
    """A short path naming ``name`` in the directory open as ``dir_fd`` (for the calls
    that take no ``dir_fd``: xattrs); ``name`` itself if ``dir_fd`` is None."""
    return name if dir_fd is None else f"/proc/self/fd/{dir_fd}/{name}"


def _ident(fd: int) -> tuple[int, int]:
    st = os.fstat(fd)
    return st.st_dev, st.st_ino


class _Fds:
    """The descriptors of the directories from a root down to the current one; only the
    last :data:`WINDOW` (and the root) stay open."""

    def __init__(self, root_fd: int) -> None:
        self.fds: list[int | None] = [root_fd]
        self.ids = [_ident(root_fd)]

    @property
    def top(self) -> int:
        return self.fds[-1]  # type: ignore[return-value]  # always open

    def parent(self) -> int:
        fd = self.fds[-2]
        if fd is None:
            fd = self.fds[-2] = self._up(self.top, self.ids[-2])
        return fd

    @staticmethod
    def _up(fd: int, ident: tuple[int, int]) -> int:
        """Open the parent of the directory open as ``fd``, checked to be ``ident``."""
        up = os.open("..", _O_DIR, dir_fd=fd)
        if _ident(up) != ident:
            os.close(up)
            raise InternalError("a directory was moved while its tree was walked")
        return up

    def push(self, fd: int) -> None:
        self.fds.append(fd)
        self.ids.append(_ident(fd))
        old = len(self.fds) - WINDOW - 1
        if old > 0 and (stale := self.fds[old]) is not None:
            os.close(stale)
            self.fds[old] = None

    def pop(self) -> None:
        fd = self.top
        self.fds.pop()
        self.ids.pop()
        try:
            if self.fds[-1] is None:
                self.fds[-1] = self._up(fd, self.ids[-1])
        finally:
            os.close(fd)

    def close(self) -> None:
        for fd in self.fds:
            if fd is not None:
                os.close(fd)
        self.fds.clear()


class Walk:
    """A pre-order walk of the tree at ``root`` (never following symlinks), names in
    byte order, as events ``(kind, parent_fd, name, st, fd)``: ``ENTER`` a directory
    (``fd`` open on it; the root has ``parent_fd`` -1 and name ""), ``NODE`` anything
    else (``fd`` -1), ``LEAVE`` a directory after its entries. Descriptors are valid
    until the next event. ``skip`` leaves out top-level names; ``budget`` is charged an
    inode per entry as directories are listed (before they are visited); a directory
    deeper than ``max_depth`` raises :class:`SnapshotTooLarge`."""

    def __init__(self, root: str | os.PathLike[str], *, skip: frozenset[str] = frozenset(),
                 budget: Budget | None = None, max_depth: int | None = MAX_DEPTH) -> None:
        self.root, self.skip, self.budget = os.fspath(root), skip, budget
        self.max_depth = max_depth
        self.names: list[str] = []  # from the root down to the current directory
        self._keys = [b"."]  # :meth:`key` of the root and each directory down to here
        self._places: list[Place | None] = [None]  # :meth:`place`'s directories, the same way

    def rel(self, name: str | None = None) -> bytes:
        """The path of ``name`` (in the current directory), relative to the root."""
        parts = [b".", *map(os.fsencode, self.names)]
        if name is not None:
            parts.append(os.fsencode(name))
        return b"/".join(parts)

    def key(self, name: str | None = None) -> bytes:
        """16 bytes naming ``name`` (in the current directory; None: the directory) by
        its path, chained from its directory's key: what a record of every entry keeps
        (:meth:`rel` is as long as the path: a tree 4096 levels of 255-byte names deep
        made a megabyte per entry, gigabytes of a commit's record)."""
        base = self._keys[-1]
        return base if name is None else _chain(base, name)

    def place(self, name: str) -> Place:
        """The :class:`Place` of ``name`` in the current directory."""
        return Place(self._places[-1], name)

    def _listing(self, fd: int, skip: frozenset[str]) -> list[str]:
        names = []
        with os.scandir(fd) as it:
            for e in it:
                if e.name in skip:
                    continue
                if self.budget is not None:
                    self.budget.add_inode()
                names.append(e.name)
        names.sort(key=os.fsencode, reverse=True)  # popped from the end: ascending
        return names

    def __iter__(self) -> Iterator[tuple[str, int, str, os.stat_result, int]]:
        fds = _Fds(os.open(self.root, _O_DIR))
        try:
            root_st = os.fstat(fds.top)
            yield ENTER, -1, "", root_st, fds.top
            pending = [self._listing(fds.top, self.skip)]
            stats = [root_st]
            while pending:
                if not pending[-1]:
                    pending.pop()
                    st = stats.pop()
                    if pending:
                        name = self.names[-1]
                        yield LEAVE, fds.parent(), name, st, fds.top
                        self.names.pop()
                        self._keys.pop()
                        self._places.pop()
                        fds.pop()
                    else:
                        yield LEAVE, -1, "", st, fds.top
                    continue
                name = pending[-1].pop()
                parent = fds.top
                st = os.stat(name, dir_fd=parent, follow_symlinks=False)
                if not stat.S_ISDIR(st.st_mode):
                    yield NODE, parent, name, st, -1
                    continue
                if self.max_depth is not None and len(pending) >= self.max_depth:
                    raise (self.budget or Budget(0, 0)).exceeded(
                        "depth", self.max_depth,
                        f"directories more than {self.max_depth} levels deep")
                fd = os.open(name, _O_DIR, dir_fd=parent)
                fds.push(fd)
                if fds.ids[-1] != (st.st_dev, st.st_ino):
                    raise InternalError(f"{name!r} changed while its tree was walked")
                self.names.append(name)
                self._keys.append(_chain(self._keys[-1], name))
                self._places.append(self.place(name))
                yield ENTER, parent, name, st, fd
                pending.append(self._listing(fd, frozenset()))
                stats.append(st)
        finally:
            fds.close()


def listings(root: str | os.PathLike[str]) -> Iterator[tuple[str, int, str, os.stat_result]]:
    """Every entry under ``root`` (not ``root`` itself) as ``(relative path, parent fd,
    name, lstat)`` in ``os.walk``'s top-down order (each directory's entries sorted by
    name, then its subdirectories' in that order), with no recursion and no path longer
    than a name: what hashed a tree's listing by ``os.walk`` keeps its digest. ``parent
    fd`` is valid until the next entry."""
    prefixes = [""]
    for event, parent, name, _st, fd in Walk(root, max_depth=None):
        if event == LEAVE:
            prefixes.pop()
            continue
        if event != ENTER:
            continue
        prefix = prefixes[-1] + name + "/" if parent != -1 else ""
        prefixes.append(prefix)
        for entry in sorted(os.listdir(fd)):
            yield prefix + entry, fd, entry, os.stat(entry, dir_fd=fd, follow_symlinks=False)


class Place(NamedTuple):
    """Where an entry is: its directory's place (None: the root) and its name. What a
    walk keeps of hard links' first names: a path would cost its length for each (a
    megabyte deep down), a place shares its directories' with every entry in them."""

    up: Place | None
    name: str

    def path(self) -> str:
        """The entry's path relative to the root (``a/b/name``)."""
        parts: list[str] = []
        place: Place | None = self
        while place is not None:
            parts.append(place.name)
            place = place.up
        return "/".join(reversed(parts))


def _chain(base: bytes, name: str) -> bytes:
    return hashlib.blake2b(base + b"/" + os.fsencode(name), digest_size=16).digest()


# ---------------------------------------------------------------------- copying


@dataclass
class CopyState:
    budget: Budget | None
    links: dict[tuple[int, int], str | Place] = field(default_factory=dict)  # inode -> first name
    link_base: int | None = None  # the descriptor link paths are relative to
    ids: dict[int, int] | None = None  # owners translated on the way (uids.canonical_owner)
    hasher: Hasher | None = None  # hashes large files' copies as they land (streamhash)
    writeback: bool = True  # start large files' writeback as they are copied


def signature(st: os.stat_result) -> tuple[int, ...]:
    """What changes whenever an entry does (but through a shared writable mapping:
    :mod:`corral.runtime.precopy`): its inode, type and mode, owners, size, link count,
    mtime and ctime (which no unprivileged process can set back)."""
    return (st.st_ino, st.st_mode, st.st_uid, st.st_gid, st.st_size, st.st_nlink,
            st.st_mtime_ns, st.st_ctime_ns)


def copy_tree(src: str | os.PathLike[str], dst: str | os.PathLike[str], *,
              skip: frozenset[str] = frozenset(), budget: Budget | None = None,
              ids: dict[int, int] | None = None, hasher: Hasher | None = None,
              record: dict[bytes, tuple[int, ...]] | None = None,
              writeback: bool = True) -> None:
    """Copy the directory ``src`` to ``dst`` (which must not exist) as overlayfs needs:
    owners, modes, times, xattrs, symlinks, hard links, holes, whiteouts. ``ids``
    translates owners (uids and gids, in ACLs too); ``hasher`` hashes the copies;
    ``record`` gets each entry's :func:`signature` (taken before it was copied) by its
    path relative to ``src`` (:meth:`Walk.key`); ``writeback``: :func:`copy_data`'s."""
    os.mkdir(dst, 0o700)  # its real mode once its entries are in
    out = _Fds(os.open(dst, _O_DIR))
    try:
        walk = Walk(src, skip=skip, budget=budget)
        ctx = CopyState(budget, link_base=out.fds[0], ids=ids, hasher=hasher,
                        writeback=writeback)
        for kind, parent, name, st, fd in walk:
            if record is not None and kind != LEAVE:
                record[walk.key(name if kind == NODE else None)] = signature(st)
            if kind == ENTER and parent != -1:
                os.mkdir(name, 0o700, dir_fd=out.top)
                out.push(os.open(name, _O_DIR, dir_fd=out.top))
            elif kind == NODE:
                copy_node(parent, name, out.top, name, st, ctx,
                          walk.place(name) if st.st_nlink > 1 else "")
            elif kind == LEAVE:
                copy_meta(fd, out.top, st, ids)
                if parent != -1:
                    out.pop()
    finally:
        out.close()


def copy_node(src_dir: int | None, src: str, dst_dir: int | None, dst: str,
              st: os.stat_result, ctx: CopyState, rel: str | Place) -> None:
    """Copy one entry that is not a directory (``src``/``dst`` relative to the
    descriptors, or paths if they are None); ``rel`` (its path or place in the copy,
    under ``ctx.link_base``) is where its hard links are linked from."""
    mode = st.st_mode
    if stat.S_ISREG(mode):
        key = (st.st_dev, st.st_ino)
        if st.st_nlink > 1 and key in ctx.links:
            _link(ctx.link_base, ctx.links[key], dst_dir, dst)
            return
        fin = os.open(src, _O_READ, dir_fd=src_dir)
        try:
            now = os.fstat(fin)
            if not stat.S_ISREG(now.st_mode) or now.st_ino != st.st_ino:  # swapped since
                raise InternalError(f"{src!r} changed while its tree was copied")
            fout = os.open(dst, _O_CREATE, 0o600, dir_fd=dst_dir)
            try:
                copy_data(fin, fout, st.st_size, ctx.budget, ctx.hasher, ctx.writeback)
                copy_meta(fin, fout, st, ctx.ids)
            finally:
                os.close(fout)
        finally:
            os.close(fin)
        if st.st_nlink > 1:
            ctx.links.setdefault(key, rel)
        return
    if stat.S_ISLNK(mode):  # its target is at most a page: bounded by the inode count
        os.symlink(os.readlink(src, dir_fd=src_dir), dst, dir_fd=dst_dir)
    elif stat.S_ISFIFO(mode) or stat.S_ISSOCK(mode) or (stat.S_ISCHR(mode) and st.st_rdev == 0):
        os.mknod(dst, mode, st.st_rdev, dir_fd=dst_dir)  # made, never opened
    else:
        return  # a device node: no sandbox can make one, and none is wanted in a layer
    copy_meta(fd_path(src_dir, src), fd_path(dst_dir, dst), st, ctx.ids)


def _link(base: int | None, where: str | Place, dst_dir: int | None, dst: str) -> None:
    """Hard-link ``where`` (under ``base``) as ``dst``; a path beyond PATH_MAX is
    reached one directory at a time."""
    rel = where if isinstance(where, str) else where.path()
    try:
        os.link(rel, dst, src_dir_fd=base, dst_dir_fd=dst_dir, follow_symlinks=False)
        return
    except OSError as exc:
        if exc.errno != errno.ENAMETOOLONG or base is None:
            raise
    *dirs, name = rel.split("/")
    fd = os.open(".", _O_DIR, dir_fd=base)
    try:
        for d in dirs:
            nxt = os.open(d, _O_DIR, dir_fd=fd)
            os.close(fd)
            fd = nxt
        os.link(name, dst, src_dir_fd=fd, dst_dir_fd=dst_dir, follow_symlinks=False)
    finally:
        os.close(fd)


def copy_data(fin: int, fout: int, size: int, budget: Budget | None,
              hasher: Hasher | None = None, writeback: bool = True) -> None:
    """Copy a file's data extents only (holes stay holes), each charged to ``budget``
    before it is written; sendfile, as copy_file_range refuses tmpfs -> ext4 (EXDEV).
    A file of one extent is handed to ``hasher`` chunk by chunk as it is written; a
    large file's chunks are sent to disk as they land (:func:`.syscalls.start_writeback`)
    unless not ``writeback``: for a copy made durable later, off the caller's path,
    starting it here only slowed the copy (measured, issue 30: 50 MB tmpfs -> ext4 at
    load ~50, medians of 7 alternating: 190 vs 69 ms, 243 vs 118 ms)."""
    spans = extents(fin, size)
    # lazily: a hostile file may have millions of extents. Its lseek also waits for a
    # write(2) under way (the inode lock): a precopy never reads a file mid-write,
    # whose times were set as that write began (tests/security/test_precopy_straddle.py)
    first = next(spans, None)
    whole = first == (0, size)  # then the only one
    streamed = hasher.start(fout, size) if hasher is not None and whole else None
    flushed = writeback and size >= streamhash.MIN_SIZE  # writeback started chunk by chunk
    chunk = streamhash.CHUNK if streamed is not None or flushed else _CHUNK
    try:
        for start, end in itertools.chain([first] if first else [], spans):
            if budget is not None:
                budget.add_bytes(end - start)
            os.lseek(fout, start, os.SEEK_SET)
            offset = start
            while offset < end:
                sent = os.sendfile(fout, fin, offset, min(end - offset, chunk))
                if sent == 0:  # the file shrank meanwhile
                    break
                if flushed:
                    syscalls.start_writeback(fout, offset, sent)
                offset += sent
                if streamed is not None:
                    hasher.feed(streamed, offset)  # type: ignore[union-attr]
    finally:
        if streamed is not None:
            hasher.finish(streamed)  # type: ignore[union-attr]
    try:
        os.ftruncate(fout, size)
    except OSError as exc:  # apparent size beyond what the host's filesystem stores
        if exc.errno != errno.EFBIG:
            raise
        raise (budget or Budget(0, 0)).exceeded(
            "file_size", size, f"a sparse file of {size} bytes, more than the host's "
            "filesystem can store") from None


def extents(fd: int, size: int) -> Iterator[tuple[int, int]]:
    """The ``(start, end)`` data ranges of an open file; the whole file if the
    filesystem cannot tell holes."""
    offset = 0
    while offset < size:
        try:
            start = os.lseek(fd, offset, os.SEEK_DATA)
        except OSError as exc:
            if exc.errno == errno.ENXIO:  # only a hole is left
                return
            if exc.errno == errno.EINVAL:
                yield offset, size
                return
            raise
        end = min(os.lseek(fd, start, os.SEEK_HOLE), size)
        if end <= start:
            return
        yield start, end
        offset = end


def copy_meta(src: str | int, dst: str | int, st: os.stat_result,
              ids: dict[int, int] | None = None) -> None:
    """Owner (translated by ``ids``), then mode (a chown clears set-id bits), xattrs
    (it also clears security.capability), times last. ``src``/``dst`` are paths or
    open fds."""
    follow = isinstance(dst, int)  # an fd takes the default (it refuses follow_symlinks=False)
    ids = ids or {}
    os.chown(dst, ids.get(st.st_uid, st.st_uid), ids.get(st.st_gid, st.st_gid),
             follow_symlinks=follow)
    mode = stat.S_IMODE(st.st_mode)
    dropped = DROPPED_XATTRS
    if ids.get(st.st_uid) == 0 or ids.get(st.st_gid) == 0:
        # a sandbox's root's file becomes host root's: never with a set-id bit or file
        # capabilities (a real set-user-id root file on the host: docs/users.md)
        mode &= ~(stat.S_ISUID | stat.S_ISGID)
        dropped = DROPPED_XATTRS | {"security.capability"}
    if not stat.S_ISLNK(st.st_mode):
        os.chmod(dst, mode, follow_symlinks=follow)
    for name in os.listxattr(src, follow_symlinks=follow):
        if name not in dropped:
            value = translate_acl(name, os.getxattr(src, name, follow_symlinks=follow), ids)
            os.setxattr(dst, name, value, follow_symlinks=follow)
    os.utime(dst, ns=(st.st_atime_ns, st.st_mtime_ns), follow_symlinks=follow)


def file_hash(fd: int, size: int) -> tuple[bytes, bytes]:
    """``(kind, hex digest)`` of a file's content: ``f`` and the sha256 of its bytes if
    it has no hole (as layers always hashed), else ``s`` and a sha256 over its data
    extents and their offsets, so that a hole is never read."""
    spans = list(extents(fd, size)) if size else []
    if spans == [(0, size)] or not size:
        with open(fd, "rb", buffering=0, closefd=False) as f:
            os.lseek(fd, 0, os.SEEK_SET)
            return b"f", hashlib.file_digest(f, "sha256").hexdigest().encode()
    h = hashlib.sha256(b"sparse %d\n" % size)
    for start, end in spans:
        h.update(b"%d:%d\n" % (start, end))
        offset = start
        while offset < end:
            chunk = os.pread(fd, min(end - offset, 1 << 20), offset)
            if not chunk:
                break
            h.update(chunk)
            offset += len(chunk)
    return b"s", h.hexdigest().encode()


# --------------------------------------------------------------------- removing


def remove_tree(path: str | os.PathLike[str]) -> None:
    """Delete a file or a whole tree, however deep; never follows a symlink. Raises
    OSError if something cannot go (e.g. a mount point)."""
    path = os.fspath(path)
    try:
        st = os.lstat(path)
    except FileNotFoundError:
        return
    if not stat.S_ISDIR(st.st_mode):
        os.unlink(path)
        return
    for kind, parent, name, _st, _fd in Walk(path, max_depth=None):
        if kind == NODE:
            os.unlink(name, dir_fd=parent)
        elif kind == LEAVE and parent != -1:
            os.rmdir(name, dir_fd=parent)
    os.rmdir(path)


def discard_tree(path: str | os.PathLike[str]) -> None:
    """:func:`remove_tree`, never raising (work left over, a retired tree: a hostile
    one is thousands of levels deep, where ``shutil.rmtree`` recursed past Python's
    limit and raised RecursionError, which its ``ignore_errors`` does not cover)."""
    try:
        remove_tree(path)
    except (OSError, CorralError):
        pass


def sweep(root: str | os.PathLike[str], match: Callable[[str], bool]) -> list[str]:
    """Remove every entry of ``root`` whose name ``match``es (what crashed work left);
    an entry that cannot be removed is skipped, never raised: a start-up must not fail
    on debris. Returns the names removed."""
    removed: list[str] = []
    try:
        names = os.listdir(root)
    except FileNotFoundError:
        return removed
    for name in names:
        if match(name):
            try:
                remove_tree(os.path.join(root, name))
                removed.append(name)
            except (OSError, CorralError):
                continue
    return removed
