"""Applying image layers to a root filesystem, safely: the OCI changeset rules.

``.wh.<name>`` deletes ``<name>`` from the layers below, ``.wh..wh..opq`` empties its
directory of what the layers below put there; whiteouts apply before the layer's own
entries (so a layer may re-create what it hides). :func:`apply_layer` writes one
layer into a merged tree (image import, volumes, Dockerfile builds);
:func:`apply_overlay_layer` keeps a layer as an overlayfs layer of its own (registry
pulls), its whiteouts as overlayfs marks.

Safety: the layer is untrusted. Entry names that are absolute or contain ``..``, hard
links that do, and symbolic links whose relative target climbs out of the root are
refused with :class:`~corral.errors.ImageImportError`; paths are resolved inside the
root the way the sandbox will see them (a symlink is followed as if the root were
``/``, by directory descriptors, never by path), so nothing is ever written outside
it. Device nodes are skipped. Split out of :mod:`corral.runtime.oci`.
"""

from __future__ import annotations

import contextlib
import errno
import os
import shutil
import stat
import tarfile
from pathlib import Path, PurePosixPath
from typing import IO, Any

from corral.errors import ImageImportError
from corral.runtime.debian import SANDBOX_GID, SANDBOX_UID, _make_world_readable
from corral.runtime.fsutil import _remove_tree
from corral.runtime.uids import CANONICAL_UID

WHITEOUT = ".wh."
OPAQUE = ".wh..wh..opq"
OVERLAY_OPAQUE = "trusted.overlay.opaque"
MAX_LINK_HOPS = 40
_CHUNK = 1 << 20


def apply_layer(root: Path, layer: Path, index: int = 1) -> None:
    """Apply one layer (a plain tar file) onto the tree ``root``, in place."""
    try:
        tar = tarfile.open(layer, "r:")
    except tarfile.TarError as exc:
        raise ImageImportError(f"layer {index} is not a tar archive ({exc})") from None
    with tar:
        entries = []
        for m in tar.getmembers():
            parts = _entry_parts(m.name, index)
            if parts:
                entries.append((parts, m))
        for parts, _ in entries:  # whiteouts hide what the layers below put there
            if parts[-1] == OPAQUE:
                d = _resolve_dir(root, parts[:-1], create=False)
                if d is not None:
                    for child in os.listdir(d):
                        _delete(os.path.join(d, child))
            elif parts[-1].startswith(WHITEOUT):
                gone = _whiteout_target(parts, index)
                d = _resolve_dir(root, parts[:-1], create=False)
                if d is not None:
                    _delete(os.path.join(d, gone))
        known: set[str] = set()
        for parts, m in entries:
            if not parts[-1].startswith(WHITEOUT):
                try:
                    _extract(root, tar, parts, m, index, known)
                except OSError as exc:
                    if exc.errno != errno.ENAMETOOLONG:
                        raise
                    raise ImageImportError(
                        f"layer {index}: path {m.name[:200]!r}... is too long to unpack "
                        f"({len(m.name)} characters): shorten its directories",
                        details={"layer": index}) from None


def apply_overlay_layer(root: Path, stream: Any, index: int = 1) -> None:
    """Unpack one layer, read once from ``stream`` (a plain tar: anything with
    ``read(n)``), into the empty tree ``root``, to be an overlayfs lower layer: a
    whiteout becomes overlayfs's marker (a 0/0 character device) and an opaque directory
    gets ``trusted.overlay.opaque`` (both need root); nothing is deleted. The rules of
    :func:`apply_layer` hold."""
    made: set[tuple[str, ...]] = set()  # what this layer itself put there
    known: set[str] = set()
    try:
        with tarfile.open(fileobj=stream, mode="r|", bufsize=_CHUNK) as tar:
            for m in tar:
                parts = _entry_parts(m.name, index)
                if not parts:
                    continue
                if parts[-1] == OPAQUE or parts[-1].startswith(WHITEOUT):
                    gone = parts[-1] if parts[-1] == OPAQUE else _whiteout_target(parts, index)
                    if tuple([*parts[:-1], gone]) not in made:  # hides lower layers only
                        _mark_whiteout(root, parts, index, known)
                    continue
                _extract(root, tar, parts, m, index, known)
                made.add(tuple(parts))
    except (tarfile.TarError, EOFError) as exc:
        raise ImageImportError(f"layer {index} is not a valid tar archive ({exc})",
                               details={"layer": index}) from None


def _mark_whiteout(root: Path, parts: list[str], index: int, known: set[str]) -> None:
    """A whiteout or opaque marker of an OCI layer as overlayfs writes one."""
    if parts[-1] != OPAQUE and not parts[-1].startswith(WHITEOUT):
        return
    d = _resolve_dir(root, parts[:-1], create=True, known=known)
    assert d is not None
    if parts[-1] == OPAQUE:
        os.setxattr(d, OVERLAY_OPAQUE, b"y")
        return
    target = os.path.join(d, _whiteout_target(parts, index))
    if os.path.lexists(target):
        _delete(target)
        _forget(known, root, target)
    os.mknod(target, stat.S_IFCHR | 0o600, os.makedev(0, 0))


def _whiteout_target(parts: list[str], index: int) -> str:
    """The name a whiteout ``.wh.<name>`` deletes: one entry of its own directory,
    never the directory itself or its parent (``.wh..``, ``.wh...``, ``.wh.``)."""
    gone = parts[-1][len(WHITEOUT):]
    if gone in ("", ".", ".."):
        path = "/".join(parts)
        raise ImageImportError(
            f"layer {index}: whiteout {path!r} names no file (it would delete its own "
            "directory or the one above: unsafe archive)",
            details={"layer": index, "path": path},
        )
    return gone


def _archive_path(name: str) -> PurePosixPath:
    """A path inside the archive itself (``./x`` is ``x``); never absolute or ``..``."""
    p = PurePosixPath(name)
    if p.is_absolute() or ".." in p.parts:
        raise ImageImportError(f"unsafe path {name!r} in the archive", details={"path": name})
    return p


def _entry_parts(name: str, index: int) -> list[str]:
    """The components of an entry's path; refuses absolute paths and ``..``."""
    if name.startswith("/") or "\0" in name:
        raise ImageImportError(f"layer {index}: absolute path {name!r} (unsafe archive)",
                               details={"layer": index, "path": name})
    parts = [p for p in name.split("/") if p not in ("", ".")]
    if ".." in parts:
        raise ImageImportError(f"layer {index}: path {name!r} climbs out of the root with '..' "
                               "(unsafe archive)", details={"layer": index, "path": name})
    return parts


_DIR_FLAGS = os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC


def _resolve_dir(root: Path, parts: list[str], *, create: bool,
                 known: set[str] | None = None) -> str | None:
    """The host path of directory ``parts`` inside ``root``, symlinks followed as the
    sandbox will follow them (``/`` is ``root``; ``..`` stops there). Missing
    directories are made (``create``) or give None. Each name is looked up in its
    parent's descriptor (a lookup by the whole path, for each name of each entry, was
    cubic in the depth: an archive of 1500 nested directories took minutes). ``known``:
    the directories of a layer being applied reached through no link (a path in the
    tree, each name a real directory), where a lookup starts (from the root, it was
    still quadratic in the depth: 1500 nested directories, a minute); the caller
    forgets what it deletes (:func:`_forget`)."""
    pending = list(reversed(parts))
    done: list[str] = []
    if known is not None and parts:
        if "/".join(parts) in known:
            return _under(root, parts)
        if len(parts) == 1 or "/".join(parts[:-1]) in known:
            pending, done = [parts[-1]], parts[:-1]
    fd = os.open(_under(root, done), _DIR_FLAGS)
    hops = 0
    try:
        while pending:
            comp = pending.pop()
            if comp in ("", "."):
                continue
            if comp == "..":
                if done:
                    done.pop()
                    os.close(fd)
                    fd = os.open(_under(root, done), _DIR_FLAGS)
                continue
            try:
                st = os.lstat(comp, dir_fd=fd)
            except FileNotFoundError:
                if not create:
                    return None
                os.mkdir(comp, 0o755, dir_fd=fd)
                st = os.lstat(comp, dir_fd=fd)
            if stat.S_ISLNK(st.st_mode):
                hops += 1
                if hops > MAX_LINK_HOPS:
                    raise ImageImportError(f"too many symbolic links in {'/'.join(parts)!r}")
                target = os.readlink(comp, dir_fd=fd)
                if target.startswith("/"):
                    done = []
                    os.close(fd)
                    fd = os.open(root, _DIR_FLAGS)
                pending.extend(reversed(target.split("/")))
                continue
            if not stat.S_ISDIR(st.st_mode):
                if not create:
                    return None
                os.unlink(comp, dir_fd=fd)  # a later layer puts a directory where a file was
                os.mkdir(comp, 0o755, dir_fd=fd)
            nfd = os.open(comp, _DIR_FLAGS, dir_fd=fd)
            os.close(fd)
            fd = nfd
            done.append(comp)
        if known is not None and hops == 0:  # parts are then the real directories
            if len(known) >= _KNOWN_MAX:
                known.clear()
            known.add("/".join(done))
        return _under(root, done)
    finally:
        os.close(fd)


def _under(root: Path, names: list[str]) -> str:
    """``root/names...`` (os.path.join, a loop in Python, took seconds on deep trees)."""
    return "/".join([os.fspath(root), *names])


_KNOWN_MAX = 4096  # directories a layer's extraction remembers (each a path of < 4 KiB)


def _forget(known: set[str] | None, root: Path, path: str) -> None:
    """``path`` (in ``root``) is deleted: what :func:`_resolve_dir` knew below it goes."""
    if known:
        rel = os.path.relpath(path, root)
        known.difference_update([k for k in known if k == rel or k.startswith(rel + "/")])


def _escapes(parts: list[str], target: str) -> bool:
    """Whether a relative link at ``parts`` climbs above the root with ``..``."""
    depth = len(parts) - 1
    for comp in target.split("/"):
        if comp == "..":
            depth -= 1
            if depth < 0:
                return True
        elif comp not in ("", "."):
            depth += 1
    return False


def _extract(root: Path, tar: tarfile.TarFile, parts: list[str], m: tarfile.TarInfo,
             index: int, known: set[str] | None = None) -> None:
    where = f"layer {index}: {'/'.join(parts)}"
    if m.issym() and not m.linkname.startswith("/") and _escapes(parts, m.linkname):
        raise ImageImportError(f"{where} links to {m.linkname!r}, outside the root "
                               "(unsafe archive)", details={"layer": index, "path": m.name})
    if m.ischr() or m.isblk():
        return  # sandboxes get their own /dev; device nodes in an image are never used
    parent = _resolve_dir(root, parts[:-1], create=True, known=known)
    assert parent is not None
    target = os.path.join(parent, parts[-1])
    try:
        old = os.lstat(target)
    except FileNotFoundError:
        old = None
    if m.isdir():
        if old is None or not stat.S_ISDIR(old.st_mode):
            if old is not None:
                _delete(target)
                _forget(known, root, target)
            os.mkdir(target, 0o700)
        _set_meta(target, m)
        return
    if old is not None:
        _delete(target)
        _forget(known, root, target)
    if m.isreg():
        fin = tar.extractfile(m)
        assert fin is not None
        fd = os.open(target, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o600)
        with os.fdopen(fd, "wb") as fout:
            if m.sparse is not None:
                _copy_sparse(tar, fout, m, where)
            else:
                shutil.copyfileobj(fin, fout, _CHUNK)
    elif m.issym():
        os.symlink(m.linkname, target)
    elif m.islnk():
        link_parts = _entry_parts(m.linkname, index)
        src_dir = (_resolve_dir(root, link_parts[:-1], create=False, known=known)
                   if link_parts else None)
        src = os.path.join(src_dir, link_parts[-1]) if src_dir else None
        if src is None or not os.path.isfile(src) or os.path.islink(src):
            raise ImageImportError(f"{where} is a hard link to {m.linkname!r}, which is not "
                                   "a file of the image", details={"layer": index})
        os.link(src, target)
        return  # a hard link shares its target's owner and mode
    elif m.isfifo():
        os.mkfifo(target, 0o600)
    else:
        return
    _set_meta(target, m)


def _copy_sparse(tar: tarfile.TarFile, fout: IO[bytes], m: tarfile.TarInfo, where: str) -> None:
    """A sparse entry (GNU tar ``-S``): its data blocks, read in order from the archive
    (a stream too), written at their offsets; its holes left holes. Read whole, a few KB
    of archive wrote its full size of zeros (a terabyte fills the host's disk before any
    check of the tree made)."""
    raw = tar.fileobj
    assert raw is not None
    raw.seek(m.offset_data)
    blocks: Any = m.sparse or ()  # (offset, size) of each data block (typeshed: int)
    for offset, size in blocks:
        fout.seek(offset)
        while size > 0:
            chunk = raw.read(min(size, _CHUNK))
            if not chunk:
                raise ImageImportError(f"{where}: its data ends early (a damaged archive)")
            fout.write(chunk)
            size -= len(chunk)
    fout.truncate(m.size)


def _sandbox_ready(root: Path) -> None:
    """What a sandbox needs of any image: mount points for the resolver configuration
    (a sandbox with the network gets the host's), a hosts file, readable files."""
    etc = Path(_resolve_dir(root, ["etc"], create=True) or root / "etc")
    for name, text in (("resolv.conf", ""), ("hosts", "127.0.0.1\tlocalhost sandbox\n")):
        if not os.path.lexists(etc / name):
            (etc / name).write_text(text)
            os.chmod(etc / name, 0o644)
    _make_world_readable(root)


def _set_meta(path: str, m: tarfile.TarInfo) -> None:
    uid = CANONICAL_UID if m.uid == SANDBOX_UID else m.uid
    gid = CANONICAL_UID if m.gid == SANDBOX_GID else m.gid
    os.chown(path, uid, gid, follow_symlinks=False)
    if not m.issym():
        # No privilege leaves an image: setuid/setgid bits are dropped (they mean
        # nothing inside a sandbox, with no_new_privs, and on the host they would make
        # root binaries of anyone's archive). Extended attributes (file capabilities)
        # are never applied.
        os.chmod(path, stat.S_IMODE(m.mode) & ~(stat.S_ISUID | stat.S_ISGID))
    with contextlib.suppress(OSError):
        os.utime(path, (m.mtime, m.mtime), follow_symlinks=False)


def _delete(path: str) -> None:
    if os.path.isdir(path) and not os.path.islink(path):
        _remove_tree(Path(path))  # iterative: an archive's tree may be thousands deep
    elif os.path.lexists(path):
        os.unlink(path)
