"""Layers: sandboxes' writable layers, committed as immutable overlayfs lower layers.

A sandbox writes into an overlayfs *upper* directory: new and changed files, plus the
markers overlayfs uses for what is gone (a whiteout, a 0/0 character device, for a
deleted file; the xattr ``trusted.overlay.opaque=y`` on a directory that hides
everything below it). Copied faithfully, that directory works as a *lower* layer of
later sandboxes, its markers included, so what was deleted stays deleted::

    <root>/<id>/tree/           the files, owners, modes, times, xattrs and markers
    <root>/<id>/manifest.json   {"digest": "sha256:…", "size_bytes": …}
    <root>/.tmp-*/              being built; a crash leaves only these (see open)
    <root>/.trash-*/            being removed

``<id>`` is the first 16 hex digits of the digest: layers are content-addressed (a
tree already stored is not stored twice) and their paths stay short, because every
lower layer's path goes into one page of overlay mount options.

The digest is sha256 over a canonical walk (names sorted as bytes): for each entry its
relative path, type, mode, owner, size, mtime (directories excepted), content hash or
link target or device number, and xattrs. Hardlinks are kept and hashed as links to
the first path. Overlay bookkeeping that means nothing below another overlay
(``trusted.overlay.origin`` and friends, which name inodes of the old lower layers) is
dropped on copy, so equal trees from different sandboxes hash equal.

Squash: a chain of layers (top first) folds into one with the same meaning *above the
image*. Mounting the chain and copying the merged view would not do: a merged view
shows no whiteouts, so files of the image deleted in a layer would come back. Instead
the layers are applied bottom-up, as overlayfs resolves them: an entry of a higher
layer replaces what is below (whiteouts included, and kept: the image below may still
hold the path); an opaque directory replaces the whole subtree; a plain directory
merges with a directory below and takes its attributes, and becomes opaque if what it
covers was not a directory (overlayfs stops merging there, so the image's directory
must stay hidden). Redirects and metacopy (``redirect_dir``/``metacopy`` on) refer to
paths in lower layers and cannot be squashed this way: such layers are refused.
"""

from __future__ import annotations

import errno
import hashlib
import json
import os
import secrets
import shutil
import stat
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Iterable, Sequence

from corral.errors import InternalError, Unsupported
from corral.runtime import syscalls

TREE = "tree"
MANIFEST = "manifest.json"
ID_HEX = 16
FORMAT = 1
OPAQUE = "trusted.overlay.opaque"
_TMP = ".tmp-"
_TRASH = ".trash-"
_DROPPED_XATTRS = frozenset({
    "trusted.overlay.origin", "trusted.overlay.impure", "trusted.overlay.uuid",
    "trusted.overlay.nlink",
})
_UNSQUASHABLE_XATTRS = ("trusted.overlay.redirect", "trusted.overlay.metacopy")
_O_READ = os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC
_O_CREATE = os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC
_SENDFILE_CHUNK = 1 << 30

Links = dict[tuple[int, int], str]  # (st_dev, st_ino) of a source file -> its copy


@dataclass(frozen=True)
class Layer:
    """A committed layer: ``path`` is its tree, to be used as an overlay lowerdir."""

    id: str
    digest: str
    size_bytes: int
    path: Path


@dataclass(frozen=True)
class Sealed:
    """A staged tree, checksummed and on disk, not yet under its final name."""

    tmp: Path
    digest: str
    size_bytes: int

    @property
    def id(self) -> str:
        return layer_id(self.digest)


def layer_id(digest: str) -> str:
    return digest.removeprefix("sha256:")[:ID_HEX]


class LayerStore:
    """The layers under ``root`` (``Layout.layers_dir``). Methods block: call them in a
    thread. Reference counting lives in the registry, not here."""

    def __init__(self, root: Path) -> None:
        self.root = Path(root)

    def open(self, known: Iterable[str]) -> list[str]:
        """Remove what crashed commits and removals left behind, and layer directories
        the registry does not know (a crash after the rename, before the row)."""
        self.root.mkdir(mode=0o700, parents=True, exist_ok=True)
        known = set(known)
        removed = []
        for p in self.root.iterdir():
            if p.name.startswith((_TMP, _TRASH)) or p.name not in known:
                shutil.rmtree(p, ignore_errors=True)
                removed.append(p.name)
        return removed

    def path(self, layer_id: str) -> Path:
        return self.root / layer_id / TREE

    def stage(self, upper: Path, *, skip: Iterable[str] = ()) -> Path:
        """Copy an overlay upper directory (but its top-level entries in ``skip``) into a
        new temporary directory; returns it, for :meth:`seal` or :meth:`discard`."""
        tmp = self._new_tmp()
        try:
            copy_tree(str(upper), str(tmp / TREE), skip=frozenset(skip))
        except BaseException:
            self.discard(tmp)
            raise
        return tmp

    def stage_squashed(self, trees: Sequence[Path]) -> Path:
        """Fold layer trees (top first) into one new temporary tree (see the module
        docstring); the trees are only read."""
        for tree in trees:
            _refuse_unsquashable(str(tree))
        tmp = self._new_tmp()
        try:
            copy_tree(str(trees[-1]), str(tmp / TREE))
            for tree in reversed(trees[:-1]):
                _apply_dir(str(tree), str(tmp / TREE), os.lstat(tree), {})
        except BaseException:
            self.discard(tmp)
            raise
        return tmp

    def seal(self, tmp: Path) -> Sealed:
        """Checksum a staged tree and make it durable, the disk's writeback overlapping
        the hashing (which reads the page cache)."""
        with ThreadPoolExecutor(max_workers=1) as pool:
            synced = pool.submit(syscalls.syncfs, str(tmp))
            digest, size = tree_digest(tmp / TREE)
            synced.result()
        manifest = {"format": FORMAT, "id": layer_id(digest), "digest": digest,
                    "size_bytes": size, "created_at": time.time()}
        fd = os.open(tmp / MANIFEST, _O_CREATE, 0o600)
        try:
            os.write(fd, json.dumps(manifest, indent=1).encode())
            os.fsync(fd)
        finally:
            os.close(fd)
        return Sealed(tmp, digest, size)

    def install(self, sealed: Sealed) -> tuple[Layer, bool]:
        """Move a sealed tree to its final name, atomically; if that layer exists (same
        content), drop the copy. Returns the layer and whether it is new."""
        final = self.root / sealed.id
        try:
            os.rename(sealed.tmp, final)  # onto an existing, non-empty directory: fails
        except OSError as exc:
            if exc.errno not in (errno.EEXIST, errno.ENOTEMPTY):
                raise
            existing = json.loads((final / MANIFEST).read_text())["digest"]
            self.discard(sealed.tmp)
            if existing != sealed.digest:
                raise InternalError(
                    f"layer id {sealed.id} is taken by another digest ({existing})"
                ) from None
            return Layer(sealed.id, sealed.digest, sealed.size_bytes, self.path(sealed.id)), False
        _fsync_dir(self.root)
        return Layer(sealed.id, sealed.digest, sealed.size_bytes, self.path(sealed.id)), True

    def verify(self, layer_id: str, digest: str) -> bool:
        """Whether the layer's files still match ``digest`` (a full re-read)."""
        try:
            return tree_digest(self.path(layer_id))[0] == digest
        except OSError:  # a file gone, or turned into something unreadable
            return False

    def remove(self, layer_id: str) -> None:
        """Delete a layer: renamed away first, so that it is never seen half removed."""
        trash = self.root / f"{_TRASH}{layer_id}-{secrets.token_hex(4)}"
        try:
            os.rename(self.root / layer_id, trash)
        except FileNotFoundError:
            return
        shutil.rmtree(trash, ignore_errors=True)

    def discard(self, tmp: Path) -> None:
        shutil.rmtree(tmp, ignore_errors=True)

    def _new_tmp(self) -> Path:
        tmp = self.root / f"{_TMP}{secrets.token_hex(6)}"
        tmp.mkdir(mode=0o700)
        return tmp


# --------------------------------------------------------------------- copying


def copy_tree(
    src: str, dst: str, *, st: os.stat_result | None = None,
    skip: frozenset[str] = frozenset(), links: Links | None = None,
) -> None:
    """Copy the directory ``src`` to ``dst`` (which must not exist) as overlayfs needs:
    owners, modes, times, xattrs, symlinks, hardlinks and device nodes (whiteouts)."""
    links = {} if links is None else links
    st = st or os.lstat(src)
    os.mkdir(dst, 0o700)  # its real mode once its entries are in
    with os.scandir(src) as it:
        entries = [e for e in it if e.name not in skip]
    for e in entries:
        est = e.stat(follow_symlinks=False)
        target = os.path.join(dst, e.name)
        if stat.S_ISDIR(est.st_mode):
            copy_tree(e.path, target, st=est, links=links)
        else:
            _copy_node(e.path, target, est, links)
    _copy_meta(src, dst, st)


def _copy_node(src: str, dst: str, st: os.stat_result, links: Links) -> None:
    """Copy one entry that is not a directory."""
    mode = st.st_mode
    if stat.S_ISREG(mode):
        key = (st.st_dev, st.st_ino)
        if st.st_nlink > 1 and key in links:
            os.link(links[key], dst)
            return
        fin = os.open(src, _O_READ)
        try:
            fout = os.open(dst, _O_CREATE, 0o600)
            try:
                # sendfile, not copy_file_range: the latter refuses tmpfs -> ext4 (EXDEV)
                while st.st_size and os.sendfile(fout, fin, None, _SENDFILE_CHUNK):
                    pass
                _copy_meta(fin, fout, st)
            finally:
                os.close(fout)
        finally:
            os.close(fin)
        if st.st_nlink > 1:
            links[key] = dst
        return
    if stat.S_ISLNK(mode):
        os.symlink(os.readlink(src), dst)
    else:  # whiteouts (0/0 character devices), other devices, fifos, sockets
        os.mknod(dst, mode, st.st_rdev)
    _copy_meta(src, dst, st)


def _copy_meta(src: str | int, dst: str | int, st: os.stat_result) -> None:
    """Owner, then mode (a chown clears set-id bits), xattrs (it also clears
    security.capability), times last. ``src``/``dst`` are paths or open fds."""
    nofollow = {} if isinstance(dst, int) else {"follow_symlinks": False}
    os.chown(dst, st.st_uid, st.st_gid, **nofollow)
    if not stat.S_ISLNK(st.st_mode):
        os.chmod(dst, stat.S_IMODE(st.st_mode), **nofollow)
    for name in os.listxattr(src, **nofollow):
        if name not in _DROPPED_XATTRS:
            os.setxattr(dst, name, os.getxattr(src, name, **nofollow), **nofollow)
    os.utime(dst, ns=(st.st_atime_ns, st.st_mtime_ns), **nofollow)


# -------------------------------------------------------------------- squashing


def _apply_dir(src: str, dst: str, st: os.stat_result, links: Links) -> None:
    """Lay the directory ``src`` of a higher layer over the directory ``dst`` of the
    squash so far: their entries merge and ``src``'s attributes win."""
    with os.scandir(src) as it:
        entries = list(it)
    for e in entries:
        est = e.stat(follow_symlinks=False)
        target = os.path.join(dst, e.name)
        try:
            below = os.lstat(target)
        except FileNotFoundError:
            below = None
        if stat.S_ISDIR(est.st_mode):
            opaque = _is_opaque(e.path)
            if below is not None and stat.S_ISDIR(below.st_mode) and not opaque:
                _apply_dir(e.path, target, est, links)
                continue
            if below is not None:
                _remove(target, below)
            copy_tree(e.path, target, st=est, links=links)
            if below is not None and not opaque:
                os.setxattr(target, OPAQUE, b"y", follow_symlinks=False)
        else:
            if below is not None:
                _remove(target, below)
            _copy_node(e.path, target, est, links)
    was_opaque = _is_opaque(dst)
    for name in os.listxattr(dst, follow_symlinks=False):
        os.removexattr(dst, name, follow_symlinks=False)
    _copy_meta(src, dst, st)
    if was_opaque:  # what it hid below is still hidden
        os.setxattr(dst, OPAQUE, b"y", follow_symlinks=False)


def _is_opaque(path: str) -> bool:
    try:
        return os.getxattr(path, OPAQUE, follow_symlinks=False) == b"y"
    except OSError:
        return False


def _remove(path: str, st: os.stat_result) -> None:
    if stat.S_ISDIR(st.st_mode):
        shutil.rmtree(path)
    else:
        os.unlink(path)


def _refuse_unsquashable(tree: str) -> None:
    for dirpath, dirnames, filenames in os.walk(tree):
        for name in [*dirnames, *filenames]:
            path = os.path.join(dirpath, name)
            found = set(os.listxattr(path, follow_symlinks=False)) & set(_UNSQUASHABLE_XATTRS)
            if found:
                raise Unsupported(
                    f"cannot squash snapshot layers: {path} carries {sorted(found)[0]}; "
                    "mount overlayfs with redirect_dir=off and metacopy=off "
                    "(the module's defaults) to take deep snapshot chains"
                )


# ---------------------------------------------------------------------- digest


def tree_digest(root: Path) -> tuple[str, int]:
    """The canonical digest (``sha256:<hex>``) of a tree, and its disk usage in bytes."""
    h = hashlib.sha256(b"corral-layer-%d\n" % FORMAT)
    seen: dict[tuple[int, int], bytes] = {}
    size = 0
    pending = [(str(root), b".", os.lstat(root))]
    while pending:
        path, rel, st = pending.pop()
        size += st.st_blocks * 512
        mode = st.st_mode
        mtime = b"%d" % st.st_mtime_ns
        if stat.S_ISDIR(mode):
            kind, data, mtime = b"d", b"", b""  # a directory's size and mtime are noise
            with os.scandir(path) as it:
                children = sorted(it, key=lambda e: os.fsencode(e.name), reverse=True)
            for e in children:  # reversed onto a stack: visited in sorted order
                pending.append((e.path, rel + b"/" + os.fsencode(e.name),
                                e.stat(follow_symlinks=False)))
        elif stat.S_ISREG(mode):
            key = (st.st_dev, st.st_ino)
            if st.st_nlink > 1 and key in seen:
                kind, data = b"h", seen[key]
            else:
                kind, data = b"f", _file_sha256(path)
                if st.st_nlink > 1:
                    seen[key] = rel
        elif stat.S_ISLNK(mode):
            kind, data = b"l", os.fsencode(os.readlink(path))
        else:
            kind, data = b"n", b"%d:%d" % (os.major(st.st_rdev), os.minor(st.st_rdev))
        xattrs = b";".join(
            name.encode() + b"=" + os.getxattr(path, name, follow_symlinks=False).hex().encode()
            for name in sorted(os.listxattr(path, follow_symlinks=False))
        )
        fields = [rel, kind, b"%o" % mode, b"%d" % st.st_uid, b"%d" % st.st_gid,
                  b"%d" % (0 if kind == b"d" else st.st_size), mtime, data, xattrs]
        h.update(b"\0".join(fields) + b"\n")
    return "sha256:" + h.hexdigest(), size


def _file_sha256(path: str) -> bytes:
    with open(os.open(path, _O_READ), "rb", buffering=0) as f:
        return hashlib.file_digest(f, "sha256").hexdigest().encode()


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
