"""A layer on the wire: one daemon streams a layer's tree, another rebuilds it, checked.

Layers (:mod:`corral.runtime.layers`) are content-addressed: the digest is the name,
so a layer fetched from a peer is accepted only if the tree it rebuilds hashes to the
digest it was asked for (:func:`~corral.runtime.layers.tree_digest`, the same walk that
named it). The stream is a POSIX tar (pax headers), in the order of that walk, carrying
what the digest covers and tar does not: ``CORRAL.mtime_ns`` (exact times),
``CORRAL.xattr.<name>`` (hex values), and for a sparse file ``CORRAL.extents``
(``start:end,...``; the member's data is those extents only) and ``CORRAL.size``.

The stream is untrusted (any token holder, or a broken peer, may send it), so
:func:`receive` builds the tree in a fresh temporary directory of the layer store and:

- accepts only relative names without ``..``, each once, whose parent is a directory
  the same stream already made (so nothing is ever written through a symlink and no
  path leaves the tree); hard links only to files the stream made;
- makes only directories, files, symlinks, FIFOs and whiteouts (0/0 character
  devices); any other device node is refused, as are extended attributes other than
  ``trusted.overlay.opaque`` and ``user.*`` (a redirect or metacopy xattr would make
  overlayfs follow paths below);
- for a root image (``root_form``: :func:`~corral.runtime.layers.root_form_mode`),
  refuses every device node (whiteouts too), setuid and setgid bits, and every
  extended attribute but ``user.*``: a root image travels without them;
- stops at ``max_bytes`` of stream and when the disk's free space falls below
  :data:`RESERVE_BYTES` (:class:`~corral.errors.StorageFull`);
- on any failure (a truncated stream, a bad entry, a digest mismatch) deletes the
  temporary tree, so nothing half-written is left, and raises
  :class:`~corral.errors.LayerTransferError`.
"""

from __future__ import annotations

import errno
import os
import re
import stat
import tarfile
from collections.abc import Iterable, Iterator
from pathlib import Path

from corral.errors import CorralError, InvalidArgument, LayerTransferError, StorageFull
from corral.runtime.layers import (
    ROOT_DROPPED_BITS,
    TREE,
    Layer,
    LayerStore,
    Sealed,
    root_form_mode,
    root_form_xattr,
)
from corral.runtime.treecopy import ENTER, LEAVE, Walk, extents, fd_path

DIGEST_RE = re.compile(r"sha256:[0-9a-f]{64}")
RESERVE_BYTES = 64 << 20  # free space a transfer never eats into
_BLOCK = tarfile.BLOCKSIZE
_READ = 1 << 20
_CHECK_EVERY = 64 << 20  # bytes written between two looks at the free space
_XATTR = "CORRAL.xattr."
_ALLOWED_XATTRS = ("trusted.overlay.opaque",)
_O_READ = os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC
_O_CREATE = os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC


def check_digest(digest: object) -> str:
    """``digest`` if it is a layer digest (``sha256:`` and 64 hex digits), else
    :class:`InvalidArgument`: a digest is never a path."""
    if not isinstance(digest, str) or not DIGEST_RE.fullmatch(digest):
        raise InvalidArgument(
            f"not a layer digest: {str(digest)[:80]!r} (expected sha256: and 64 lowercase "
            "hex digits)", details={"digest": str(digest)[:80]},
        )
    return digest


# --------------------------------------------------------------------- sending


def stream(tree: Path, *, root_form: bool = False) -> Iterator[bytes]:
    """The tar stream of the layer tree ``tree`` (blocking; run it in a thread); with
    ``root_form``, of a root image's tree as it travels (what
    ``tree_digest(tree, root_form=True)`` covers)."""
    links: dict[tuple[int, int], str] = {}
    walk = Walk(tree)
    for event, parent, name, st, fd in walk:
        if event == LEAVE:
            continue
        mode = root_form_mode(st) if root_form else st.st_mode
        if mode is None:
            continue
        rel = os.fsdecode(walk.rel() if event == ENTER else walk.rel(name))
        info = tarfile.TarInfo(rel)
        info.mode, info.uid, info.gid = stat.S_IMODE(mode), st.st_uid, st.st_gid
        info.mtime = st.st_mtime_ns // 10**9
        pax = {"CORRAL.mtime_ns": str(st.st_mtime_ns)}
        xpath = fd if event == ENTER else fd_path(parent, name)
        nofollow = event != ENTER
        for x in os.listxattr(xpath, follow_symlinks=not nofollow):
            if root_form and not root_form_xattr(x):
                continue
            value = os.getxattr(xpath, x, follow_symlinks=not nofollow)
            pax[_XATTR + x] = value.hex()
        spans: list[tuple[int, int]] = []
        file_fd = -1
        if event == ENTER:
            info.type = tarfile.DIRTYPE
        elif stat.S_ISREG(st.st_mode) and st.st_nlink > 1 and (st.st_dev, st.st_ino) in links:
            info.type, info.linkname = tarfile.LNKTYPE, links[(st.st_dev, st.st_ino)]
        elif stat.S_ISREG(st.st_mode):
            if st.st_nlink > 1:
                links[(st.st_dev, st.st_ino)] = rel
            file_fd = os.open(name, _O_READ, dir_fd=parent)
            spans = list(extents(file_fd, st.st_size)) if st.st_size else []
            if spans != [(0, st.st_size)] and st.st_size:
                pax["CORRAL.extents"] = ",".join(f"{a}:{b}" for a, b in spans)
                pax["CORRAL.size"] = str(st.st_size)
            info.size = sum(b - a for a, b in spans)
        elif stat.S_ISLNK(st.st_mode):
            info.type, info.linkname = tarfile.SYMTYPE, os.readlink(name, dir_fd=parent)
        elif stat.S_ISCHR(st.st_mode) or stat.S_ISBLK(st.st_mode):
            info.type = tarfile.CHRTYPE if stat.S_ISCHR(st.st_mode) else tarfile.BLKTYPE
            info.devmajor, info.devminor = os.major(st.st_rdev), os.minor(st.st_rdev)
        elif stat.S_ISFIFO(st.st_mode):
            info.type = tarfile.FIFOTYPE
        else:
            continue  # sockets: never in a layer (copy_tree does not keep them)
        info.pax_headers = pax
        yield info.tobuf(tarfile.PAX_FORMAT, "utf-8", "surrogateescape")
        if file_fd >= 0:
            try:
                yield from _file_data(file_fd, spans, info.size)
            finally:
                os.close(file_fd)
    yield b"\0" * (2 * _BLOCK)


def _file_data(fd: int, spans: list[tuple[int, int]], total: int) -> Iterator[bytes]:
    sent = 0
    for start, end in spans:
        offset = start
        while offset < end:
            chunk = os.pread(fd, min(end - offset, _READ), offset)
            if not chunk:  # shrank under us (layers are immutable: cannot happen)
                break
            yield chunk
            offset += len(chunk)
            sent += len(chunk)
    if sent < total:
        yield b"\0" * (total - sent)  # keep the stream well-formed; the digest will differ
    if total % _BLOCK:
        yield b"\0" * (_BLOCK - total % _BLOCK)


# ------------------------------------------------------------------- receiving


class _Reader:
    """A file-like view of an iterator of chunks, stopping at ``limit`` bytes."""

    def __init__(self, chunks: Iterable[bytes], limit: int, what: str) -> None:
        self._it = iter(chunks)
        self._buf = bytearray()
        self._pos = 0  # what of _buf was read already
        self.count = 0
        self.limit, self.what = limit, what

    def read(self, n: int = -1) -> bytes:
        while n < 0 or len(self._buf) - self._pos < n:
            chunk = next(self._it, None)
            if chunk is None:
                break
            self.count += len(chunk)
            if self.count > self.limit:
                raise LayerTransferError(
                    f"{self.what}: the peer sent more than {self.limit} bytes, more than "
                    "the layer can hold: refused", details={"limit": self.limit},
                )
            if self._pos:  # drop what was read, once per chunk (not per read)
                del self._buf[:self._pos]
                self._pos = 0
            self._buf += chunk
        end = len(self._buf) if n < 0 else min(len(self._buf), self._pos + n)
        out = bytes(self._buf[self._pos:end])
        self._pos = end
        return out


def receive(store: LayerStore, digest: str, chunks: Iterable[bytes], *, max_bytes: int,
            need_bytes: int = 0) -> tuple[Layer, int]:
    """Rebuild the layer ``digest`` from a tar stream into ``store`` and install it;
    returns the layer and the bytes read. Blocking (a thread). ``need_bytes``: what the
    layer takes on disk, checked against the free space first."""
    sealed, count = receive_tree(store, digest, chunks, max_bytes=max_bytes,
                                 need_bytes=need_bytes)
    try:
        layer, _ = store.install(sealed)
    except BaseException:
        store.discard(sealed.tmp)
        raise
    return layer, count


def receive_tree(store: LayerStore, digest: str, chunks: Iterable[bytes], *, max_bytes: int,
                 need_bytes: int = 0, root_form: bool = False) -> tuple[Sealed, int]:
    """Rebuild the tree ``digest`` from a tar stream in a temporary directory of
    ``store``, checked against its digest but not installed: the caller installs or
    moves ``sealed.tmp``, or discards it. ``root_form``: a root image's tree (stricter:
    see the module docstring). Nothing is left on failure."""
    check_digest(digest)
    what = f"{'root image' if root_form else 'layer'} {digest}"
    _check_free(store.root, need_bytes, what)
    tmp = store.new_tmp()
    reader = _Reader(chunks, max_bytes, what)
    try:
        try:
            _extract(tmp / TREE, reader, what, store.root, root_form)
        except tarfile.TarError as exc:
            raise LayerTransferError(
                f"{what}: the peer's stream is not a valid layer archive ({exc}; truncated?)",
                details={"digest": digest},
            ) from None
        sealed = store.seal(tmp)
        if sealed.digest != digest:
            raise LayerTransferError(
                f"{what}: the files received hash to {sealed.digest}, not to the digest "
                "asked for: refused and deleted (a corrupt or hostile peer)",
                details={"digest": digest, "received": sealed.digest},
            )
        return sealed, reader.count
    except BaseException as exc:
        store.discard(tmp)
        if isinstance(exc, OSError) and exc.errno in (errno.ENOSPC, errno.EDQUOT):
            raise StorageFull(f"{what}: no space left for it under {store.root}: free space "
                              "there (delete snapshots or images you no longer need)",
                              details={"path": str(store.root), "errno": exc.errno}) from None
        if isinstance(exc, OSError):
            raise LayerTransferError(f"{what}: could not be written ({exc}): refused",
                                     details={"digest": digest}) from None
        raise


def _check_free(root: Path, need: int, what: str) -> None:
    vfs = os.statvfs(root)
    free = vfs.f_bavail * vfs.f_frsize
    if free - max(need, 0) < RESERVE_BYTES:
        raise StorageFull(
            f"{what} needs {need} bytes but {free} are free under {root} (keeping "
            f"{RESERVE_BYTES} in reserve): free space there and retry",
            details={"path": str(root), "needed": need, "free": free},
        )


def _refuse(what: str, name: str, why: str) -> LayerTransferError:
    return LayerTransferError(f"{what}: entry {name[:200]!r} {why}: refused (unsafe stream)",
                              details={"path": name[:200]})


def _extract(root: Path, reader: _Reader, what: str, store_root: Path,
             root_form: bool = False) -> None:
    dirs: set[str] = set()
    files: set[str] = set()
    seen: set[str] = set()
    written_since_check = 0
    with tarfile.open(fileobj=reader, mode="r|", encoding="utf-8", bufsize=_READ,  # type: ignore[call-overload]
                      errors="surrogateescape") as tar:
        for m in tar:
            name = m.name
            if not seen:
                if name != "." or not m.isdir():
                    raise _refuse(what, name, "comes before the layer's root directory")
            elif (name.startswith("/") or "\0" in name or not name.startswith("./")
                  or any(p in ("", ".", "..") for p in name[2:].split("/"))):
                raise _refuse(what, name, "is not a plain relative path inside the layer")
            if name in seen:
                raise _refuse(what, name, "appears twice")
            seen.add(name)
            parent = name.rpartition("/")[0] if name != "." else None
            if parent is not None and parent not in dirs:
                raise _refuse(what, name, "is not inside a directory of the stream")
            path = os.path.join(root, name) if name != "." else str(root)
            xattrs = _xattrs(m, what, root_form)
            if root_form and (m.mode & ROOT_DROPPED_BITS or m.ischr() or m.isblk()):
                raise _refuse(what, name, "is a device node or setuid/setgid, which a root "
                              "image never carries")
            if m.isdir():
                os.mkdir(path, 0o700)
                dirs.add(name)
            elif m.isreg():
                written_since_check += _write_file(path, tar, m, what)
                files.add(name)
            elif m.islnk():
                if m.linkname not in files:
                    raise _refuse(what, name, "hard-links to something not a file of the stream")
                os.link(os.path.join(root, m.linkname), path, follow_symlinks=False)
                continue  # shares the inode, its owner, mode, times and xattrs
            elif m.issym():
                os.symlink(m.linkname, path)  # only data: nothing is written through it
            elif m.ischr() and (m.devmajor, m.devminor) == (0, 0):
                os.mknod(path, 0o600 | stat.S_IFCHR, os.makedev(0, 0))  # a whiteout
            elif m.isfifo():
                os.mkfifo(path, 0o600)
            else:
                raise _refuse(what, name, "is a device node or of an unknown type")
            _set_meta(path, m, xattrs)
            if written_since_check > _CHECK_EVERY:
                _check_free(store_root, 0, what)
                written_since_check = 0
    if not seen:
        raise LayerTransferError(f"{what}: the peer sent an empty stream: refused")


def _xattrs(m: tarfile.TarInfo, what: str, root_form: bool) -> dict[str, bytes]:
    out = {}
    for key, value in m.pax_headers.items():
        if not key.startswith(_XATTR):
            continue
        name = key[len(_XATTR):]
        if not (root_form_xattr(name) or (not root_form and name in _ALLOWED_XATTRS)):
            raise _refuse(what, m.name, f"carries the extended attribute {name[:80]!r}")
        try:
            out[name] = bytes.fromhex(value)
        except ValueError:
            raise _refuse(what, m.name, "carries a malformed extended attribute") from None
    return out


def _write_file(path: str, tar: tarfile.TarFile, m: tarfile.TarInfo, what: str) -> int:
    data = tar.extractfile(m)
    assert data is not None
    raw = m.pax_headers.get("CORRAL.extents")
    try:
        size = int(m.pax_headers.get("CORRAL.size", m.size))
        spans = [tuple(int(x) for x in s.split(":")) for s in raw.split(",")] if raw else (
            [(0, m.size)] if m.size else [])
    except ValueError:
        raise _refuse(what, m.name, "has malformed extents") from None
    if sum(b - a for a, b in spans) != m.size or any(
        not 0 <= a < b <= size for a, b in spans
    ) or size > (1 << 50):
        raise _refuse(what, m.name, "has extents that do not fit its size")
    fd = os.open(path, _O_CREATE, 0o600)
    try:
        for start, end in spans:
            offset = start
            while offset < end:
                chunk = data.read(min(end - offset, _READ))
                if not chunk:
                    raise LayerTransferError(f"{what}: the stream ends inside {m.name[:200]!r} "
                                             "(truncated): refused")
                os.pwrite(fd, chunk, offset)
                offset += len(chunk)
        os.ftruncate(fd, size)
    finally:
        os.close(fd)
    return m.size


def _set_meta(path: str, m: tarfile.TarInfo, xattrs: dict[str, bytes]) -> None:
    os.chown(path, m.uid, m.gid, follow_symlinks=False)
    if not m.issym():
        os.chmod(path, m.mode & 0o7777)
    for name, value in xattrs.items():
        os.setxattr(path, name, value, follow_symlinks=False)
    if not m.isdir():  # a directory's mtime is not in the digest (its children change it)
        try:
            ns = int(m.pax_headers.get("CORRAL.mtime_ns", int(m.mtime) * 10**9))
        except ValueError:
            raise LayerTransferError(f"entry {m.name[:200]!r}: malformed time: refused") from None
        os.utime(path, ns=(ns, ns), follow_symlinks=False)


def layer_error(exc: BaseException, digest: str) -> CorralError:
    """What a failed transfer raises: a corral error kept, anything else wrapped."""
    if isinstance(exc, CorralError):
        return exc
    return LayerTransferError(f"layer {digest}: transfer failed ({type(exc).__name__}: {exc})",
                              details={"digest": digest})
