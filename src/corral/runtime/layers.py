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
lower layer's path goes into one page of overlay mount options. A snapshot's new layer
is the exception (:meth:`LayerStore.install_unsealed`): it is named at random when
committed and hashed and made durable just after (:meth:`LayerStore.settle`), off the
commit's path; until then its registry digest is :data:`PENDING` plus the boot it was
made in (:mod:`corral.runtime.snapshots` says who waits for it).

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
import stat
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Iterable, Sequence

from corral.errors import InternalError, Unsupported
from corral.runtime import streamhash, syscalls
from corral.runtime.streamhash import Hasher
from corral.runtime.treecopy import (
    ENTER,
    LEAVE,
    Budget,
    CopyState,
    Place,
    Walk,
    copy_meta,
    copy_node,
    copy_tree,
    fd_path,
    file_hash,
    remove_tree,
    sweep,
)
from corral.runtime.treedelta import Record, sync_delta

TREE = "tree"
MANIFEST = "manifest.json"
ID_HEX = 16
FORMAT = 1
OPAQUE = "trusted.overlay.opaque"
_TMP = ".tmp-"
_TRASH = ".trash-"
_UNSQUASHABLE_XATTRS = ("trusted.overlay.redirect", "trusted.overlay.metacopy")
_O_READ = os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC
_O_CREATE = os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC
PENDING = "pending:"  # a layer's digest until it is settled: PENDING + the boot's id
SETTLE_ENV = "CORRAL_SNAPSHOT_SETTLE"  # "sync": snapshots hash and sync within the commit


def settle_later() -> bool:
    """Whether snapshot commits settle their layer after returning (the default;
    :mod:`corral.runtime.snapshots`)."""
    return os.environ.get(SETTLE_ENV, "").strip().lower() != "sync"


def is_pending(digest: str) -> bool:
    """Whether a registry digest is that of a layer not yet hashed nor durable."""
    return digest.startswith(PENDING)


def boot_id() -> str:
    """This boot of the kernel: its page cache (a layer not yet durable) survives a
    crash of the daemon, never a crash or restart of the machine."""
    try:
        with open("/proc/sys/kernel/random/boot_id") as f:
            return f.read().strip()
    except OSError:
        return "unknown"


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

    # Hash large files behind their copy (streamhash): None, when a CPU is spare (on a
    # saturated host the hashing would only slow the frozen copy down); True, False.
    stream_hash: bool | None = None

    def __init__(self, root: Path) -> None:
        self.root = Path(root)
        self._hashers: dict[str, Hasher] = {}  # staged tmp name -> its files' hashes

    def open(self, known: Iterable[str]) -> list[str]:
        """Remove what crashed commits and removals left behind, and layer directories
        the registry does not know (a crash after the rename, before the row)."""
        self.root.mkdir(mode=0o700, parents=True, exist_ok=True)
        known = set(known)
        return sweep(self.root, lambda n: n.startswith((_TMP, _TRASH)) or n not in known)

    def path(self, layer_id: str) -> Path:
        return self.root / layer_id / TREE

    def stage(self, upper: Path, *, skip: Iterable[str] = (), budget: Budget | None = None,
              ids: dict[int, int] | None = None, record: Record | None = None,
              writeback: bool = True) -> Path:
        """Copy an overlay upper directory (but its top-level entries in ``skip``) into a
        new temporary directory; returns it, for :meth:`seal` or :meth:`discard`. With a
        ``budget`` (the sandbox's limits), stops with SnapshotTooLarge before exceeding
        it; a failed copy leaves nothing behind. ``ids`` translates owners (the
        sandbox's own uid to the canonical one: :func:`.uids.canonical_owner`).
        ``record``: each entry's signature, for :meth:`restage`. ``writeback``: start
        writing large files back as they are copied (not for a layer settled later)."""
        tmp = self._new_tmp()
        streamed = streamhash.spare_cpu() if self.stream_hash is None else self.stream_hash
        hasher = Hasher() if streamed else None  # seal finds the large files hashed
        if hasher is not None:
            self._hashers[tmp.name] = hasher
        try:
            copy_tree(str(upper), str(tmp / TREE), skip=frozenset(skip), budget=budget, ids=ids,
                      hasher=hasher, record=record, writeback=writeback)
        except BaseException:
            self.discard(tmp)
            raise
        return tmp

    def restage(self, tmp: Path, upper: Path, record: Record, *, skip: Iterable[str] = (),
                budget: Budget | None = None, ids: dict[int, int] | None = None,
                suspect_since_ns: int | None = None) -> int:
        """Bring a tree staged from ``upper`` with ``record`` up to date with it
        (:func:`.treedelta.sync_delta`); returns the entries copied or removed."""
        return sync_delta(str(upper), str(tmp / TREE), record, skip=frozenset(skip),
                          budget=budget, ids=ids, hasher=self._hashers.get(tmp.name),
                          suspect_since_ns=suspect_since_ns)

    def stage_squashed(self, trees: Sequence[Path]) -> Path:
        """Fold layer trees (top first) into one new temporary tree (see the module
        docstring); the trees are only read."""
        for tree in trees:
            _refuse_unsquashable(str(tree))
        tmp = self._new_tmp()
        try:
            copy_tree(str(trees[-1]), str(tmp / TREE))
            for tree in reversed(trees[:-1]):
                _apply_dir(str(tree), str(tmp / TREE))
        except BaseException:
            self.discard(tmp)
            raise
        return tmp

    def usage(self, tmp: Path) -> int:
        """The disk usage of a staged tree (:func:`tree_usage`)."""
        return tree_usage(tmp / TREE)

    def install_unsealed(self, tmp: Path, size: int) -> Layer:
        """Move a staged tree (``size``: its :meth:`usage`) to a new random name,
        neither hashed nor durable yet: :meth:`settle` it. Its digest is :data:`PENDING`
        + :func:`boot_id`. A crash of the daemon loses nothing (the page cache stays);
        one of the machine may tear it, which the boot in its digest tells."""
        while True:
            lid = secrets.token_hex(ID_HEX // 2)
            try:
                os.rename(tmp, self.root / lid)  # onto an existing, non-empty directory: fails
                break
            except OSError as exc:
                if exc.errno not in (errno.EEXIST, errno.ENOTEMPTY):
                    raise
        hasher = self._hashers.pop(tmp.name, None)
        if hasher is not None:  # its hashes are by inode: the rename keeps them
            self._hashers[lid] = hasher
        return Layer(lid, PENDING + boot_id(), size, self.path(lid))

    def settle(self, layer_id: str) -> str:
        """Hash a layer installed unsealed and make it durable (its data and name by a
        ``syncfs`` overlapping the hashing, then its manifest); returns its digest,
        which the caller records. Raises OSError if it was removed meanwhile."""
        where = self.root / layer_id
        digest, size = self._digest_synced(where, self._hashers.pop(layer_id, None))
        self._write_manifest(where, layer_id, digest, size, again=True)
        _fsync_dir(where)
        return digest

    @staticmethod
    def _digest_synced(where: Path, hasher: Hasher | None) -> tuple[str, int]:
        """``tree_digest`` of ``where``'s tree while a ``syncfs`` writes it back (the
        hashing reads the page cache)."""
        try:
            with ThreadPoolExecutor(max_workers=1) as pool:
                synced = pool.submit(syscalls.syncfs, str(where))
                if hasher is not None:
                    hasher.wait()
                found = tree_digest(where / TREE, hashed=hasher)
                synced.result()
        finally:
            if hasher is not None:
                hasher.close()
        return found

    def seal(self, tmp: Path) -> Sealed:
        """Checksum a staged tree and make it durable, the disk's writeback overlapping
        the hashing (which reads the page cache)."""
        digest, size = self._digest_synced(tmp, self._hashers.pop(tmp.name, None))
        self._write_manifest(tmp, layer_id(digest), digest, size)
        return Sealed(tmp, digest, size)

    @staticmethod
    def _write_manifest(where: Path, lid: str, digest: str, size: int, *,
                        again: bool = False) -> None:
        manifest = {"format": FORMAT, "id": lid, "digest": digest,
                    "size_bytes": size, "created_at": time.time()}
        # a settle again after a crash (``again``) may find the manifest it wrote
        flags = _O_CREATE & ~os.O_EXCL | os.O_TRUNC if again else _O_CREATE
        fd = os.open(where / MANIFEST, flags, 0o600)
        try:
            os.write(fd, json.dumps(manifest, indent=1).encode())
            os.fsync(fd)
        finally:
            os.close(fd)

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
        self.forget(layer_id)
        trash = self.root / f"{_TRASH}{layer_id}-{secrets.token_hex(4)}"
        try:
            os.rename(self.root / layer_id, trash)
        except FileNotFoundError:
            return
        sweep(self.root, trash.name.__eq__)  # what cannot go now goes at the next open

    def discard(self, tmp: Path | None) -> None:
        if tmp is not None:
            self.forget(Path(tmp).name)
            sweep(Path(tmp).parent, Path(tmp).name.__eq__)

    def forget(self, name: str) -> None:
        """Drop the hashes kept for a staged tree or an unsettled layer."""
        hasher = self._hashers.pop(name, None)
        if hasher is not None:
            hasher.close()

    def new_tmp(self) -> Path:
        """A fresh temporary directory of the store, for a tree built elsewhere (a
        layer fetched from a peer: :mod:`corral.runtime.layer_wire`); seal or discard it."""
        return self._new_tmp()

    def _new_tmp(self) -> Path:
        tmp = self.root / f"{_TMP}{secrets.token_hex(6)}"
        tmp.mkdir(mode=0o700)
        return tmp


# -------------------------------------------------------------------- squashing


def _apply_dir(src: str, dst: str) -> None:
    """Lay the directory ``src`` of a higher layer over the directory ``dst`` of the
    squash so far: their entries merge and ``src``'s attributes win. Iterative; paths
    (the layers are the store's own copies, bounded in depth by :data:`MAX_DEPTH`)."""
    links = CopyState(None)
    stack = [(src, dst, os.lstat(src), _entries(src))]
    while stack:
        src, dst, st, entries = stack[-1]
        if not entries:
            stack.pop()
            was_opaque = _is_opaque(dst)
            for name in os.listxattr(dst, follow_symlinks=False):
                os.removexattr(dst, name, follow_symlinks=False)
            copy_meta(src, dst, st)
            if was_opaque:  # what it hid below is still hidden
                os.setxattr(dst, OPAQUE, b"y", follow_symlinks=False)
            continue
        e = entries.pop()
        est = e.stat(follow_symlinks=False)
        target = os.path.join(dst, e.name)
        try:
            below = os.lstat(target)
        except FileNotFoundError:
            below = None
        if stat.S_ISDIR(est.st_mode):
            opaque = _is_opaque(e.path)
            if below is not None and stat.S_ISDIR(below.st_mode) and not opaque:
                stack.append((e.path, target, est, _entries(e.path)))
                continue
            if below is not None:
                remove_tree(target)
            copy_tree(e.path, target)
            if below is not None and not opaque:
                os.setxattr(target, OPAQUE, b"y", follow_symlinks=False)
        else:
            if below is not None:
                remove_tree(target)
            copy_node(None, e.path, None, target, est, links, target)


def _entries(path: str) -> list[os.DirEntry[str]]:
    with os.scandir(path) as it:
        return list(it)


def _is_opaque(path: str) -> bool:
    try:
        return os.getxattr(path, OPAQUE, follow_symlinks=False) == b"y"
    except OSError:
        return False


def _refuse_unsquashable(tree: str) -> None:
    for kind, parent, name, _st, fd in Walk(tree):
        if kind == LEAVE:
            continue
        names = os.listxattr(fd) if kind == ENTER else os.listxattr(
            fd_path(parent, name), follow_symlinks=False)
        found = set(names) & set(_UNSQUASHABLE_XATTRS)
        if found:
            raise Unsupported(
                f"cannot squash snapshot layers: {tree} holds a file carrying "
                f"{sorted(found)[0]}; mount overlayfs with redirect_dir=off and "
                "metacopy=off (the module's defaults) to take deep snapshot chains"
            )


# ---------------------------------------------------------------------- digest


ROOT_DROPPED_BITS = stat.S_ISUID | stat.S_ISGID


def root_form_mode(st: os.stat_result) -> int | None:
    """The mode of an entry of a root image's tree as it travels between nodes, or None
    for an entry that does not travel: device nodes and sockets are dropped and the
    setuid/setgid bits cleared. Sandboxes mount their lower layers ``nosuid,nodev`` and
    get ``/dev`` from the launcher, so neither ever counts inside one; a root image
    received from a peer therefore never has them (:mod:`corral.runtime.layer_wire`)."""
    if stat.S_ISCHR(st.st_mode) or stat.S_ISBLK(st.st_mode) or stat.S_ISSOCK(st.st_mode):
        return None
    return st.st_mode & ~ROOT_DROPPED_BITS


def root_form_xattr(name: str) -> bool:
    """Whether an extended attribute of a root image travels (``user.*`` only)."""
    return name.startswith("user.")


def tree_digest(root: Path, *, root_form: bool = False,
                hashed: Hasher | None = None) -> tuple[str, int]:
    """The canonical digest (``sha256:<hex>``) of a tree, and its disk usage in bytes.
    Iterative and sparse-aware: a file's holes are never read (:func:`file_hash`).
    With ``root_form``: of the tree as a root image travels (:func:`root_form_mode`).
    ``hashed``: files of this tree already hashed as they were copied (the same
    content hash, read from these very files: :mod:`.streamhash`)."""
    h = hashlib.sha256(b"corral-layer-%d\n" % FORMAT)
    seen: dict[tuple[int, int], Place] = {}
    size = 0
    walk = Walk(root)
    for event, parent, name, st, fd in walk:
        if event == LEAVE:
            continue
        rel = walk.rel() if event == ENTER else walk.rel(name)
        mode = st.st_mode
        if root_form:
            kept = root_form_mode(st)
            if kept is None:
                continue
            mode = kept
        size += st.st_blocks * 512
        mtime = b"%d" % st.st_mtime_ns
        if event == ENTER:
            kind, data, mtime = b"d", b"", b""  # a directory's size and mtime are noise
        elif stat.S_ISREG(mode):
            key = (st.st_dev, st.st_ino)
            if st.st_nlink > 1 and key in seen:
                kind, data = b"h", b"./" + os.fsencode(seen[key].path())
            else:
                f = os.open(name, _O_READ, dir_fd=parent)
                try:
                    known = hashed.lookup(f, st) if hashed is not None else None
                    kind, data = (b"f", known) if known else file_hash(f, st.st_size)
                finally:
                    os.close(f)
                if st.st_nlink > 1:  # its place, not its path: megabytes deep down
                    seen[key] = walk.place(name)
        elif stat.S_ISLNK(mode):
            kind, data = b"l", os.fsencode(os.readlink(name, dir_fd=parent))
        else:
            kind, data = b"n", b"%d:%d" % (os.major(st.st_rdev), os.minor(st.st_rdev))
        xpath = fd if event == ENTER else fd_path(parent, name)
        nofollow = {} if event == ENTER else {"follow_symlinks": False}
        xattrs = b";".join(
            name.encode() + b"=" + os.getxattr(xpath, name, **nofollow).hex().encode()
            for name in sorted(os.listxattr(xpath, **nofollow))
            if not root_form or root_form_xattr(name)
        )
        fields = [rel, kind, b"%o" % mode, b"%d" % st.st_uid, b"%d" % st.st_gid,
                  b"%d" % (0 if kind == b"d" else st.st_size), mtime, data, xattrs]
        h.update(b"\0".join(fields) + b"\n")
    return "sha256:" + h.hexdigest(), size


def tree_usage(root: Path) -> int:
    """A tree's disk usage in bytes, as :func:`tree_digest` counts it, without reading
    a file (the walk's metadata only)."""
    return sum(st.st_blocks * 512 for event, _p, _n, st, _fd in Walk(root) if event != LEAVE)


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
