"""Importing images: ``docker save`` tarballs and OCI image layouts (a directory or tar).

No registry is involved: the archive is made elsewhere (``docker save``, ``skopeo copy
... oci:dir``, ``podman save --format oci-archive``) and brought here. Its layers are
applied in order into one root filesystem, which is registered like any image; the
image config's ``Env`` and ``WorkingDir`` become the defaults of its sandboxes.

Layers follow the OCI rules for changesets: ``.wh.<name>`` deletes ``<name>`` from the
layers below, ``.wh..wh..opq`` empties its directory of what the layers below put
there; whiteouts apply before the layer's own entries (so a layer may re-create what
it hides). Layers may be plain tar, gzip or zstd (:mod:`corral.runtime.layer_codec`);
blobs are checked against their digests, and layers against the config's ``diff_ids``.

Safety: the archive is untrusted. Entry names that are absolute or contain ``..``,
hard links that do, and symbolic links whose relative target climbs out of the root
are refused with :class:`~corral.errors.ImageImportError`; paths are resolved inside
the root the way the sandbox will see them (a symlink is followed as if the root were
``/``), so nothing is ever written outside it. Device nodes are skipped (sandboxes
mount their own ``/dev``). Files owned by uid/gid 1000 become the sandbox user's.

Example::

    image = import_image(store, Path("alpine.tar"), "alpine")     # blocking: a thread
"""

from __future__ import annotations

import contextlib
import errno
import hashlib
import json
import os
import platform
import re
import shutil
import stat
import tarfile
from collections.abc import Iterator
from pathlib import Path, PurePosixPath
from typing import IO, Any

from corral.errors import ImageImportError
from corral.image_schema import validate_image_name
from corral.runtime import layer_codec
from corral.runtime.debian import SANDBOX_GID, SANDBOX_UID, _make_world_readable
from corral.runtime.fsutil import _remove_tree
from corral.runtime.images import Image, ImageStore
from corral.runtime.uids import CANONICAL_UID

WHITEOUT = ".wh."
OPAQUE = ".wh..wh..opq"
OVERLAY_OPAQUE = "trusted.overlay.opaque"
MAX_LINK_HOPS = 40
_CHUNK = 1 << 20
_INDEX_TYPES = ("application/vnd.oci.image.index.v1+json",
                "application/vnd.docker.distribution.manifest.list.v2+json")
_ARCH = {"x86_64": "amd64", "aarch64": "arm64"}
_ENV_KEY = re.compile(r"[A-Za-z_][A-Za-z0-9_]*")


def import_image(store: ImageStore, source: Path, name: str, *, replace: bool = True) -> Image:
    """Import the archive or OCI layout directory ``source`` as the image ``name``
    (replacing one of that name unless ``replace`` is false). Blocking."""
    validate_image_name(name)
    source = Path(source)
    if not source.exists():
        raise ImageImportError(f"{source} does not exist", details={"path": str(source)})
    if store.exists(name) and not replace:
        raise ImageImportError(f"image {name!r} already exists", details={"image": name})
    work = store._new_tmp_dir(name)
    try:
        with _open_source(source, work) as src:
            config, layers, described = _read_image(src)
            root = work / "tree"
            root.mkdir(mode=0o755)
            diff_ids = (config.get("rootfs") or {}).get("diff_ids") or []
            for i, (path, digest) in enumerate(layers):
                layer = _fetch_layer(src, path, digest, work / "layer.tar", i)
                expected = diff_ids[i] if len(diff_ids) == len(layers) else None
                if expected and _sha256_file(layer) != expected:
                    raise ImageImportError(
                        f"layer {i + 1} of {source} does not match its diff_id {expected} "
                        "(a damaged or altered archive)", details={"layer": i + 1})
                apply_layer(root, layer, i + 1)
                layer.unlink()
        _sandbox_ready(root)
        cfg = config.get("config") or {}
        env, workdir = _env(cfg.get("Env")), _workdir(cfg.get("WorkingDir"))
        return store.add_rootfs(
            name, root, move=True, replace=replace,
            source={"kind": "oci", **described, "layers": [d for _, d in layers]},
            extra={"kind": "oci", "env": env, "workdir": workdir},
        )
    finally:
        _remove_tree(work)


# ------------------------------------------------------------------ the archive


class _Source:
    """Files of an image archive by their path in it."""

    def open(self, path: str) -> IO[bytes]:
        raise NotImplementedError

    def exists(self, path: str) -> bool:
        raise NotImplementedError

    def json(self, path: str) -> Any:
        try:
            with self.open(path) as f:
                return json.load(f)
        except (ValueError, UnicodeDecodeError) as exc:
            raise ImageImportError(f"{path} in the archive is not valid JSON: {exc}") from None


class _DirSource(_Source):
    def __init__(self, root: Path) -> None:
        self.root = root

    def _path(self, path: str) -> Path:
        return self.root / _archive_path(path)

    def open(self, path: str) -> IO[bytes]:
        p = self._path(path)
        if p.is_symlink() or not p.is_file():
            raise ImageImportError(f"{path} is missing from {self.root}", details={"path": path})
        return open(p, "rb")

    def exists(self, path: str) -> bool:
        return self._path(path).is_file()


class _TarSource(_Source):
    def __init__(self, tar: tarfile.TarFile) -> None:
        self.tar = tar
        self.members = {str(_archive_path(m.name)): m for m in tar.getmembers() if m.isfile()}

    def open(self, path: str) -> IO[bytes]:
        m = self.members.get(str(_archive_path(path)))
        f = self.tar.extractfile(m) if m is not None else None
        if f is None:
            raise ImageImportError(f"{path} is missing from the archive", details={"path": path})
        return f

    def exists(self, path: str) -> bool:
        return str(_archive_path(path)) in self.members


@contextlib.contextmanager
def _open_source(source: Path, work: Path) -> Iterator[_Source]:
    if source.is_dir():
        yield _DirSource(source)
        return
    if layer_codec.codec(source) != "tar":  # `docker save | gzip` (or zstd): unpacked
        plain = work / "archive.tar"  # once, then read at random
        layer_codec.decompress_to(source, plain, str(source))
        source = plain
    try:
        tar = tarfile.open(source, "r:")
    except tarfile.TarError as exc:
        raise ImageImportError(f"{source} is neither a tar archive nor a directory ({exc})",
                               details={"path": str(source)}) from None
    with tar:
        yield _TarSource(tar)


def _read_image(
    src: _Source,
) -> tuple[dict[str, Any], list[tuple[str, str | None]], dict[str, Any]]:
    """(image config, [(layer path, sha256 digest or None)], provenance)."""
    if src.exists("oci-layout") and src.exists("index.json"):
        manifest = _pick_manifest(src, src.json("index.json"))
        config = src.json(_blob(manifest["config"]["digest"]))
        layers = [(_blob(layer["digest"]), layer["digest"]) for layer in manifest["layers"]]
        return config, layers, {"format": "oci", "config": manifest["config"]["digest"]}
    if src.exists("manifest.json"):
        entries = src.json("manifest.json")
        if not isinstance(entries, list) or not entries:
            raise ImageImportError("manifest.json of the archive lists no image")
        if len(entries) > 1:
            tags = [t for e in entries for t in e.get("RepoTags") or []]
            raise ImageImportError(
                f"the archive holds {len(entries)} images ({', '.join(tags) or 'untagged'}): "
                "save one image per archive")
        entry = entries[0]
        try:
            config = src.json(entry["Config"])
            layers = [(str(p), _digest_of(str(p))) for p in entry["Layers"]]
        except (KeyError, TypeError):
            raise ImageImportError("manifest.json of the archive lacks Config or Layers") from None
        tags = entry.get("RepoTags") or []
        return config, layers, {"format": "docker", "ref": tags[0] if tags else None}
    raise ImageImportError(
        "not an image archive: expected manifest.json (docker save) or oci-layout and "
        "index.json (an OCI image layout)")


def _pick_manifest(src: _Source, index: dict[str, Any], depth: int = 0) -> dict[str, Any]:
    """The image manifest of this host's platform (or the only one) in an OCI index."""
    manifests = index.get("manifests") or []
    if not manifests or depth > 4:
        raise ImageImportError("the OCI index lists no image manifest")
    chosen = choose_platform(manifests)
    body = src.json(_blob(chosen["digest"]))
    if not isinstance(body, dict):
        raise ImageImportError(f"blob {chosen['digest']} is not an image manifest")
    if chosen.get("mediaType") in _INDEX_TYPES or "manifests" in body:
        return _pick_manifest(src, body, depth + 1)
    if "config" not in body or "layers" not in body:
        raise ImageImportError(f"blob {chosen['digest']} is not an image manifest")
    return body


def choose_platform(manifests: list[Any]) -> dict[str, Any]:
    """The descriptor in an index's ``manifests`` for this host (linux and its
    architecture; an entry without a platform fits any), skipping attestations."""
    arch = _ARCH.get(platform.machine(), platform.machine())
    fitting = [m for m in manifests if isinstance(m, dict)
               and (m.get("platform") or {}).get("architecture", arch) == arch
               and (m.get("platform") or {}).get("os", "linux") == "linux"
               and (m.get("annotations") or {}).get("vnd.docker.reference.type")
               != "attestation-manifest"]
    if not fitting:
        raise ImageImportError(f"the image index has no manifest for linux/{arch}",
                               details={"platform": f"linux/{arch}"})
    return fitting[0]


def _blob(digest: str) -> str:
    alg, _, hexd = str(digest).partition(":")
    if alg != "sha256" or len(hexd) != 64 or not all(c in "0123456789abcdef" for c in hexd):
        raise ImageImportError(f"unsupported blob digest {digest!r} (expected sha256:<hex>)")
    return f"blobs/sha256/{hexd}"


def _digest_of(path: str) -> str | None:
    """A docker-save layer stored as a blob (``blobs/sha256/<hex>``) is named by its digest."""
    parts = PurePosixPath(path).parts
    if len(parts) == 3 and parts[:2] == ("blobs", "sha256"):
        return "sha256:" + parts[2]
    return None


def _fetch_layer(src: _Source, path: str, digest: str | None, dest: Path, index: int) -> Path:
    """Copy a layer out of the archive as a plain tar, checking its blob digest."""
    h = hashlib.sha256()
    with src.open(path) as fin, open(dest, "wb") as fout:
        while chunk := fin.read(_CHUNK):
            h.update(chunk)
            fout.write(chunk)
    if digest is not None and "sha256:" + h.hexdigest() != digest:
        raise ImageImportError(f"layer {index + 1} ({path}) does not match its digest "
                               f"{digest} (a damaged or altered archive)",
                               details={"layer": index + 1})
    if layer_codec.codec(dest) != "tar":
        plain = dest.with_suffix(".plain")
        layer_codec.decompress_to(dest, plain, f"layer {index + 1}")
        os.replace(plain, dest)
    return dest


def _sha256_file(path: Path) -> str:
    with open(path, "rb") as f:
        return "sha256:" + hashlib.file_digest(f, "sha256").hexdigest()


# ----------------------------------------------------------------- applying


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


def _env(raw: Any) -> dict[str, str]:
    """The config's ``Env`` (``["K=V", ...]``) as a dict; names a sandbox cannot take
    (not ``[A-Za-z_][A-Za-z0-9_]*``) are left out."""
    env = {}
    for item in raw or []:
        k, sep, v = str(item).partition("=")
        if sep and _ENV_KEY.fullmatch(k) and "\0" not in v:
            env[k] = v
    return env


def _workdir(raw: Any) -> str | None:
    if not raw or not isinstance(raw, str) or not raw.startswith("/") or ".." in raw.split("/"):
        return None
    return raw.rstrip("/") or "/"
