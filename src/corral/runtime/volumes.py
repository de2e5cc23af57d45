"""Volumes: named directory trees mounted into many sandboxes at no copy cost.

A volume belongs to a tenant (the admin's: ``_admin``) and lives in the state
directory, its files owned by the canonical sandbox uid (like layers: each sandbox
sees them as its own through its idmapping)::

    <state>/volumes/<owner>/<name>/data        the tree
    <state>/volumes/<owner>/<name>/meta.json   {"name", "size_bytes", "files", "created_at",
                                                "max_mb", "home", "content", "generation"}
    <state>/volumes/<owner>/<name>/volume.img  with max_mb: an ext4 of max_mb MiB, mounted
                                               (loop) at data while the host is up

It is made from a tar archive (:meth:`Volumes.create`, extracted by the same checked
code as image layers, :func:`corral.runtime.oci_layers.apply_layer`: no path leaves the tree,
no device, no setuid bit), in a temporary directory renamed into place when complete:
nothing half-made is ever visible. A sandbox mounts it with ``volumes={"/data":
"NAME"}`` (``"NAME:ro"``, ``"NAME:cow"`` (the default), ``"NAME:rw"``; an admin may
name a host directory instead, ``"/srv/data:ro"``); the launcher mounts it
(``agent/launch.c --volume``). A volume in use by a running sandbox cannot be removed.

A volume made with ``max_mb`` is a filesystem of that size (an ext4 image, made by
``mkfs.ext4 -d`` from the checked tree, mounted nosuid/nodev on a loop device; mounted
again on first use after a reboot): ``rw`` writers share at most ``max_mb`` MiB and
inodes in proportion, and a full one is ``ENOSPC`` inside (:class:`VolumeFull` from
the file API), whatever the writer does (sparse files, hard links, millions of empty
files). It counts ``max_mb`` against the owner's quota, the space it may grow to, and
takes that space on the disk at once (the image is allocated in full, refused with
:class:`StorageFull` past the disk's reserve): volumes never promise more than the disk
holds.

On a cluster a volume travels (:mod:`corral.runtime.volume_travel`): a node that mounts
another node's volume holds a *copy* (``home``: that node), which is never mounted
``rw``; ``content`` is the digest it travels by, dropped (and ``generation`` counted
up) whenever a writer mounts the volume ``rw``.
"""

from __future__ import annotations

import contextlib
import errno
import json
import os
import stat
import subprocess
import tarfile
import tempfile
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

from corral.errors import (
    Forbidden,
    InvalidArgument,
    InvalidState,
    SandboxStartError,
    StorageFull,
    VolumeFull,
    VolumeNotFound,
)
from corral.runtime.diskimage import mkfs
from corral.runtime.fsutil import _write_atomic
from corral.runtime.oci_layers import apply_layer
from corral.runtime.storage import room_above_reserve
from corral.runtime.treecopy import ENTER, LEAVE, Walk, copy_tree, discard_tree, remove_tree
from corral.runtime.uids import CANONICAL_UID
from corral.volume_schema import VOLUME_NAME_RE, VolumeInfo, parse_mount

ADMIN_DIR = "_admin"
IMAGE = "volume.img"
META = "meta.json"
CONTENT = "content"  # {"digest", "size_bytes"} of the tree as it travels (volume_travel.py)
GENERATION = "generation"  # counts rw mounts: a content digest kept is of one generation
MIN_MB, MAX_MB = 8, 1 << 22  # a capped volume's size limits (ext4 wants a few MiB)
MAX_IMAGE_PATH = 1024  # bytes of a path in a capped volume (_make_image: mke2fs -d)


def reserved_bytes(info: VolumeInfo) -> int:
    """What a volume may take on disk: its cap, else its tree's size."""
    return max(info.size_bytes, (info.max_mb or 0) << 20)


def _unpacked_bytes(archive: Path) -> int:
    """The bytes a tar's regular files unpack to (a sparse one's full size), from its
    headers alone; 0 for what is not a tar (the extractor says what is wrong)."""
    try:
        with tarfile.open(archive, "r:") as tar:
            return sum(m.size for m in tar if m.isreg())
    except (tarfile.TarError, EOFError):
        return 0


def _check_room(root: Path, need: int, max_mb: int | None) -> None:
    """:class:`StorageFull` if ``need`` more bytes would take the disk under ``root``
    below its reserve (a capped volume's image is allocated in full: :func:`_make_image`)."""
    room = room_above_reserve(root)
    if need > room:
        raise StorageFull(
            f"no room for the volume under {root}: {max(0, room) >> 20} MiB are free above "
            f"the disk's reserve, it needs {need >> 20} MiB; "
            + ("give a smaller max_mb, or " if max_mb else "")
            + "remove volumes or snapshots", details={"path": str(root), "max_mb": max_mb})


def _longest_path(tree: Path) -> int:
    """The length in bytes of the longest path under ``tree``, relative to it."""
    lengths, longest = [0], 0
    for event, parent, name, _st, _fd in Walk(tree, max_depth=None):
        if parent == -1:
            continue
        if event == LEAVE:
            lengths.pop()
            continue
        here = lengths[-1] + len(os.fsencode(name)) + (1 if len(lengths) > 1 else 0)
        longest = max(longest, here)
        if event == ENTER:
            lengths.append(here)
    return longest


def _make_image(work: Path, max_mb: int) -> None:
    """``work/volume.img``: an ext4 of ``max_mb`` MiB holding ``work/data``'s tree, its
    blocks allocated now: a sparse image would let volumes promise more than the disk
    holds, and their rw writers fill the disk every tenant's state is on."""
    longest = _longest_path(work / "data")
    if longest > MAX_IMAGE_PATH:
        # mke2fs 1.47's -d corrupts its heap on a path of about 2040 bytes ("realloc():
        # invalid next size"): a tree a tenant chose is never handed to it
        raise InvalidArgument(
            f"a path in the volume is {longest} bytes long: a volume with max_mb holds "
            f"paths of at most {MAX_IMAGE_PATH} bytes; shorten its directories",
            details={"max_mb": max_mb, "path_bytes": longest})
    image = work / IMAGE
    with open(image, "wb") as f:
        try:
            os.posix_fallocate(f.fileno(), 0, max_mb << 20)
        except OSError as exc:
            if exc.errno not in (errno.EOPNOTSUPP, errno.EINVAL):
                raise StorageFull(f"no room for a volume of max_mb {max_mb} under "
                                  f"{work.parent}: {exc.strerror}",
                                  details={"path": str(work.parent), "max_mb": max_mb}) from None
            f.truncate(max_mb << 20)  # a filesystem without fallocate: room was checked
    proc = subprocess.run(
        [mkfs(), "-q", "-F", "-t", "ext4", "-m", "0", "-d", str(work / "data"),
         "-E", f"root_owner={CANONICAL_UID}:{CANONICAL_UID},nodiscard", str(image)],
        capture_output=True, text=True, check=False)
    if proc.returncode != 0:
        raise SandboxStartError(f"could not make the volume's filesystem: "
                                f"{proc.stderr.strip()[-500:]}")
    remove_tree(work / "data")
    (work / "data").mkdir(mode=0o755)


def _mount(image: Path, data: Path) -> None:
    proc = subprocess.run(["mount", "-t", "ext4", "-o", "loop,nosuid,nodev", str(image),
                           str(data)], capture_output=True, text=True, check=False)
    if proc.returncode != 0:
        raise SandboxStartError(f"could not mount the volume {data.parent.name}: "
                                f"{proc.stderr.strip()[-500:]}")


def _owner_dir(owner: str | None) -> str:
    return ADMIN_DIR if owner is None else owner


def check_name(name: str) -> str:
    if not isinstance(name, str) or not VOLUME_NAME_RE.fullmatch(name):
        raise InvalidArgument(
            f"invalid volume name {name!r}: use 1-63 lower-case letters, digits, '.', '_' "
            "or '-', starting with a letter or digit (no '/', no '..')")
    return name


def check_rel(rel: str) -> list[str]:
    """The components of a path inside a volume (``a/b.bin``, a leading ``/`` allowed),
    else :class:`InvalidArgument`: no ``..``, ``.``, NUL or empty name."""
    parts = [p for p in str(rel).split("/") if p]
    if (not parts or len(rel) > 4096 or "\0" in rel
            or any(p in (".", "..") or len(p) > 255 for p in parts)):
        raise InvalidArgument(f"invalid path {rel[:200]!r} in a volume: a relative path of "
                              "names, without '.' or '..' (e.g. models/ckpt.bin)",
                              details={"path": rel[:200]})
    return parts


_O_DIR = os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC


def _open_dirs(root: Path, parts: list[str], rel: str) -> tuple[int, int, int]:
    """A descriptor of ``root/parts...``, each made if missing (canonical owner), none
    followed if it is a symlink (:class:`InvalidArgument`); how many it made and their
    bytes on disk (counted as a volume's are: thousands of empty directories in one
    upload's path took the disk at no cost to the quota)."""
    fd, made, made_bytes = os.open(root, _O_DIR), 0, 0
    try:
        for part in parts:
            try:
                os.mkdir(part, 0o755, dir_fd=fd)
                os.chown(part, CANONICAL_UID, CANONICAL_UID, dir_fd=fd, follow_symlinks=False)
                made += 1
                made_bytes += os.stat(part, dir_fd=fd, follow_symlinks=False).st_blocks * 512
            except FileExistsError:
                pass
            try:
                nfd = os.open(part, _O_DIR, dir_fd=fd)
            except OSError as exc:
                if exc.errno not in (errno.ELOOP, errno.ENOTDIR):
                    raise
                raise InvalidArgument(f"{rel}: {part!r} on the way is not a directory (a "
                                      "symlink or a file) in the volume: not followed",
                                      details={"path": rel[:200]}) from None
            os.close(fd)
            fd = nfd
    except BaseException:
        os.close(fd)
        raise
    return fd, made, made_bytes


def _copy_in(source: Path, name: str, dir_fd: int, mode: int) -> None:
    """``source``'s bytes into a new file ``name`` of ``dir_fd`` (canonical owner)."""
    out = os.open(name, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC,
                  0o600, dir_fd=dir_fd)
    try:
        with open(source, "rb") as f:
            size = os.fstat(f.fileno()).st_size
            sent = 0
            while sent < size:
                n = os.sendfile(out, f.fileno(), sent, min(size - sent, 1 << 30))
                if n == 0:
                    break
                sent += n
        os.fchown(out, CANONICAL_UID, CANONICAL_UID)
        os.fchmod(out, mode)
        os.fsync(out)
    finally:
        os.close(out)


def _canonical(root: Path) -> tuple[int, int]:
    """Chown the tree to the canonical uid; its (bytes, files). Iterative: an upload
    may have made it thousands of levels deep (os.walk recursed past Python's limit)."""
    size = files = 0
    for event, parent, name, st, _fd in Walk(root):
        if event == LEAVE or parent == -1:
            continue
        os.chown(name, CANONICAL_UID, CANONICAL_UID, dir_fd=parent, follow_symlinks=False)
        size += st.st_blocks * 512
        files += 1
    os.chown(root, CANONICAL_UID, CANONICAL_UID)
    os.chmod(root, 0o755)
    return size, files


class Volumes:
    """The volumes of one state directory."""

    def __init__(self, root: Path) -> None:
        self.root = root
        self._lock = threading.Lock()  # read-modify-write of a meta.json
        self._writes: dict[str | None, threading.Lock] = {}  # an owner's quota-weighed writes
        self._pending: dict[str | None, int] = {}  # bytes of volumes being published

    def _dir(self, owner: str | None, name: str) -> Path:
        return self.root / _owner_dir(owner) / check_name(name)

    def data_dir(self, owner: str | None, name: str) -> Path:
        return self._dir(owner, name) / "data"

    def owner_root(self, owner: str | None) -> Path:
        """Where ``owner``'s volumes are (made on first use)."""
        base = self.root / _owner_dir(owner)
        base.mkdir(parents=True, exist_ok=True, mode=0o711)
        return base

    def create(self, owner: str | None, name: str, archive: Path, *,
               check: Callable[[str | None, int], None] | None = None,
               max_mb: int | None = None) -> VolumeInfo:
        """A new volume ``name`` of ``owner`` from the tar file ``archive``; ``check``
        (owner, bytes) may refuse it (a quota) before it appears; ``max_mb``: a volume
        that never holds more (see the module's docstring)."""
        # what the tree will hold, from the headers: a sparse entry of a tiny archive
        # unpacks to its full size, so quota, cap and room are weighed before a byte lands
        need = max(archive.stat().st_size, _unpacked_bytes(archive))
        if max_mb is not None and MIN_MB <= max_mb <= MAX_MB and need > max_mb << 20:
            raise VolumeFull(f"the archive holds {need} bytes, over the volume's max_mb "
                             f"({max_mb}): give a larger max_mb",
                             details={"volume": name, "max_mb": max_mb})
        if check is not None:
            check(owner, need)
        return self._publish(owner, name, lambda data: apply_layer(data, archive),
                             need=need, check=check, max_mb=max_mb)

    def adopt(self, owner: str | None, name: str, tree: Path, *, home: str,
              content: dict[str, Any], max_mb: int | None,
              check: Callable[[str | None, int], None] | None = None) -> VolumeInfo:
        """The copy of node ``home``'s volume ``name`` from ``tree`` (received and
        checked against ``content``'s digest: :mod:`corral.runtime.volume_travel`),
        moved in; an older copy here is replaced (its caller made sure none mounts it)."""
        def fill(data: Path) -> None:
            data.rmdir()
            os.rename(tree, data)
            lost = data / "lost+found"  # an ext4 volume's: mkfs makes its own
            if max_mb is not None and lost.is_dir() and not any(lost.iterdir()):
                lost.rmdir()

        return self._publish(owner, name, fill, need=int(content.get("size_bytes") or 0),
                             check=check, max_mb=max_mb, home=home, extra={CONTENT: content},
                             replace=True)

    def snapshot(self, owner: str | None, name: str, new: str, *,
                 check: Callable[[str | None, int], None] | None = None) -> VolumeInfo:
        """A new volume ``new`` holding ``name``'s files as they are now (a copy: sparse
        files stay sparse, hard links linked), with its ``max_mb``; ``check`` (owner,
        bytes) may refuse it (a quota), before a byte is copied. Its caller makes sure
        no writer changes ``name`` meanwhile."""
        info = self.get(owner, name)
        check_name(new)
        if check is not None:
            check(owner, reserved_bytes(info))
        self.ensure_mounted(owner, name)
        src = self.data_dir(owner, name)
        skip = frozenset({"lost+found"} if info.max_mb is not None else ())  # mkfs makes it

        def fill(data: Path) -> None:
            data.rmdir()
            copy_tree(src, data, skip=skip)

        return self._publish(owner, new, fill, need=reserved_bytes(info), check=check,
                             max_mb=info.max_mb)

    def _publish(self, owner: str | None, name: str, fill: Callable[[Path], None], *,
                 need: int, check: Callable[[str | None, int], None] | None,
                 max_mb: int | None,
                 home: str | None = None, extra: dict[str, Any] | None = None,
                 replace: bool = False) -> VolumeInfo:
        if max_mb is not None and not MIN_MB <= max_mb <= MAX_MB:
            raise InvalidArgument(f"invalid max_mb {max_mb}: use {MIN_MB}-{MAX_MB}",
                                  details={"field": "max_mb"})
        final = self._dir(owner, name)
        if final.exists() and not replace:
            raise InvalidState(f"volume {name!r} exists: remove it first (corral volume rm "
                               f"{name}) or pick another name", details={"volume": name})
        root = self.owner_root(owner)
        # a capped one takes max_mb; an uncapped one its tree (checked again once made)
        _check_room(root, (max_mb or 0) << 20 or need, max_mb)
        work = Path(tempfile.mkdtemp(prefix=f".{name}.", dir=root))
        try:
            (work / "data").mkdir()
            fill(work / "data")
            size, files = _canonical(work / "data")
            info = VolumeInfo(name=name, size_bytes=size, files=files, created_at=time.time(),
                              max_mb=max_mb, home=home)
            if max_mb is not None and size > max_mb << 20:
                raise VolumeFull(f"the archive holds {size} bytes, over the volume's max_mb "
                                 f"({max_mb}): give a larger max_mb",
                                 details={"volume": name, "max_mb": max_mb})
            # weighed and published under the owner's lock: volumes made at once were
            # each weighed before any other was published (a capped one's image is made
            # in between), so together they passed the quota
            with self._owner_lock(owner) if check is not None else contextlib.nullcontext():
                if check is not None:
                    check(owner, reserved_bytes(info))
                # counted by the owner's other quota checks (snapshots, checkpoints, kept
                # files: used_bytes) until published: a checkpoint weighed while a capped
                # volume's image was made did not see it, and both passed the quota
                with self._reserving(owner, reserved_bytes(info) if check else 0):
                    if max_mb is None:
                        _check_room(root, 0, None)  # its tree left the reserve free
                    if max_mb is not None:
                        _make_image(work, max_mb)
                    (work / META).write_text(json.dumps({**info.model_dump(mode="json"),
                                                         **(extra or {})}))
                    os.chmod(work, 0o711)
                    if replace and final.exists():
                        self.remove(owner, name, in_use=False)
                    os.rename(work, final)  # atomic; fails if a racing create won
        except BaseException:
            discard_tree(work)
            raise
        if max_mb is not None:
            try:
                _mount(final / IMAGE, final / "data")
            except BaseException:
                discard_tree(final)
                raise
        return info

    def ensure_mounted(self, owner: str | None, name: str) -> None:
        """A capped volume's filesystem mounted at its data (after a reboot: again)."""
        d = self._dir(owner, name)
        if (d / IMAGE).exists() and not os.path.ismount(d / "data"):
            _mount(d / IMAGE, d / "data")

    def of(self, owner: str | None) -> list[VolumeInfo]:
        base = self.root / _owner_dir(owner)
        if not base.is_dir():
            return []
        out = []
        for d in sorted(base.iterdir()):
            if not d.name.startswith(".") and (d / META).exists():
                out.append(VolumeInfo.model_validate_json((d / META).read_text()))
        return out

    def get(self, owner: str | None, name: str) -> VolumeInfo:
        meta = self._dir(owner, name) / META
        if not meta.exists():
            raise VolumeNotFound(f"no volume {name!r} here: create it with corral volume "
                                 f"create {name} --from DIR (`corral volume ls` lists yours)",
                                 details={"volume": name})
        return VolumeInfo.model_validate_json(meta.read_text())

    def remove(self, owner: str | None, name: str, in_use: bool) -> None:
        self.get(owner, name)
        if in_use:
            raise InvalidState(f"volume {name!r} is mounted by a running sandbox: delete "
                               "those first", details={"volume": name})
        d = self._dir(owner, name)
        if os.path.ismount(d / "data"):  # lazily: a sandbox ending now keeps its clone
            subprocess.run(["umount", "-l", str(d / "data")], capture_output=True, check=False)
        trash = d.with_name(f".{name}.rm.{os.getpid()}.{time.monotonic_ns()}")
        os.rename(d, trash)
        discard_tree(trash)

    def unmount_all(self) -> list[str]:
        """Unmount every volume filesystem (``max_mb``) mounted from this store: the
        engine closes with no sandbox left running, and the next use mounts it again.
        A loop mount left behind outlived its state dir (a deleted test daemon's, or a
        user's ``rm -rf``) and every later sandbox copied it into its mount table."""
        done = []
        for data in sorted(self.root.glob("*/*/data")):
            if os.path.ismount(data):
                subprocess.run(["umount", "-l", str(data)], capture_output=True, check=False)
                done.append(str(data))
        return done

    def meta(self, owner: str | None, name: str) -> dict[str, Any]:
        """The volume's ``meta.json`` as it is (VolumeInfo's fields and what travel keeps)."""
        self.get(owner, name)
        found: dict[str, Any] = json.loads((self._dir(owner, name) / META).read_text())
        return found

    def set_meta(self, owner: str | None, name: str, meta: dict[str, Any]) -> None:
        _write_atomic(self._dir(owner, name) / META, json.dumps(meta))

    def changing(self, owner: str | None, name: str) -> None:
        """A writer mounts the volume: the content digest kept for travel no longer
        holds; the next generation's is computed when a peer asks."""
        with self._lock:
            meta = self.meta(owner, name)
            meta.pop(CONTENT, None)
            meta[GENERATION] = int(meta.get(GENERATION) or 0) + 1
            self.set_meta(owner, name, meta)

    def check_room(self, owner: str | None, need: int) -> None:
        """:class:`StorageFull` if ``need`` more bytes of ``owner``'s volumes would take
        the disk below its reserve."""
        _check_room(self.owner_root(owner), need, None)

    def _owner_lock(self, owner: str | None) -> threading.Lock:
        """One of ``owner``'s quota-weighed writes at a time (uploads landing, volumes
        published), so that two cannot both pass its quota."""
        with self._lock:
            return self._writes.setdefault(owner, threading.Lock())

    def write_file(self, owner: str | None, name: str, rel: str, source: Path,
                   mode: int, check: Callable[[str | None, int], None] | None = None) -> None:
        """:meth:`_write_file`, ``check`` (owner, bytes) weighing ``source``'s size first
        (a quota: uploads opened at once were each weighed alone when opened); one of an
        owner's at a time, so two cannot both pass it."""
        with self._owner_lock(owner):
            if check is not None:
                check(owner, source.stat().st_size)
            self._write_file(owner, name, rel, source, mode)

    def _write_file(self, owner: str | None, name: str, rel: str, source: Path,
                    mode: int) -> None:
        """Put the host file ``source`` (a finished upload's bytes, which it takes) at
        ``rel`` in the volume: parents made, never through a symlink (a writer may
        have planted one), written under a temporary name and renamed into place (never
        seen half-written), owned by the canonical uid, ``mode`` without setuid bits.
        Its size and count are added to the volume's; its content digest is dropped."""
        info = self.get(owner, name)
        self.ensure_mounted(owner, name)
        parts = check_rel(rel)
        fd, made, made_bytes = _open_dirs(self.data_dir(owner, name), parts[:-1], rel)
        tmp = f".{parts[-1][:200]}.upload-{os.getpid()}-{time.monotonic_ns()}"
        try:
            try:
                old = os.stat(parts[-1], dir_fd=fd, follow_symlinks=False)
            except FileNotFoundError:
                old = None
            if old is not None and stat.S_ISDIR(old.st_mode):
                raise InvalidArgument(f"{rel} is a directory in volume {name!r}: pick a file "
                                      "path", details={"volume": name, "path": rel})
            try:
                _copy_in(source, tmp, fd, mode & 0o777)
                os.rename(tmp, parts[-1], src_dir_fd=fd, dst_dir_fd=fd)
            except OSError as exc:
                with contextlib.suppress(OSError):
                    os.unlink(tmp, dir_fd=fd)
                if exc.errno in (errno.ENOSPC, errno.EDQUOT) and info.max_mb is not None:
                    raise VolumeFull(f"volume {name!r} is full (max_mb {info.max_mb}): remove "
                                     "files from it or make a larger one",
                                     details={"volume": name, "max_mb": info.max_mb}) from None
                if exc.errno in (errno.ENOSPC, errno.EDQUOT):
                    raise StorageFull(f"no space left for {rel} in volume {name!r} on this "
                                      "host's disk: remove volumes or snapshots",
                                      details={"volume": name}) from None
                raise
            new = os.stat(parts[-1], dir_fd=fd, follow_symlinks=False)
        finally:
            os.close(fd)
        with self._lock:
            meta = self.meta(owner, name)
            meta["size_bytes"] = max(0, int(meta.get("size_bytes") or 0) + made_bytes
                                     + new.st_blocks * 512
                                     - (old.st_blocks * 512 if old is not None else 0))
            meta["files"] = int(meta.get("files") or 0) + made + (old is None)
            meta.pop(CONTENT, None)
            meta[GENERATION] = int(meta.get(GENERATION) or 0) + 1
            self.set_meta(owner, name, meta)

    def used_bytes(self, owner: str | None) -> int:
        """What ``owner``'s volumes may take, those being published included."""
        return sum(reserved_bytes(v) for v in self.of(owner)) + self._pending.get(owner, 0)

    @contextlib.contextmanager
    def _reserving(self, owner: str | None, size: int) -> Iterator[None]:
        with self._lock:
            self._pending[owner] = self._pending.get(owner, 0) + size
        try:
            yield
        finally:
            with self._lock:
                self._pending[owner] -= size

    def mounts(self, owner: str | None, volumes: dict[str, str]) -> list[tuple[str, str, str]]:
        """``(mode, host path, dest)`` of a spec's volumes, checked: its owner's own
        volumes; a host directory only for the admin."""
        out = []
        for dest, value in volumes.items():
            source, mode = parse_mount(value)
            if source.startswith("/"):
                if owner is not None:
                    raise Forbidden(f"volume {dest}: a host directory ({source}) is the "
                                    "admin's only; create a volume with corral volume create",
                                    details={"field": "volumes"})
                if not os.path.isdir(source):
                    raise InvalidArgument(f"volume {dest}: {source} is not a directory")
                path = source
            else:
                info = self.get(owner, source)
                if mode == "rw" and info.home is not None:
                    raise InvalidState(
                        f"volume {dest}: {source!r} here is a copy of node {info.home}'s "
                        "(volumes travel read-only): mount it rw on that node (node=..., "
                        "or leave node out: the cluster client places it there)",
                        details={"volume": source, "home": info.home, "cause": "copy"})
                if mode == "rw" and owner is not None and info.max_mb is None:
                    # its writes land on the host's disk, capped by nothing: one sandbox
                    # could fill the disk every tenant's state is on
                    raise Forbidden(
                        f"volume {dest}: {source!r} has no size (max_mb), so a tenant mounts "
                        "it ro or cow only; for rw, create a volume with max_mb "
                        f"(corral volume create {source} --max-mb N)",
                        details={"field": "volumes", "volume": source})
                self.ensure_mounted(owner, source)
                if mode == "rw":
                    self.changing(owner, source)
                path = str(self.data_dir(owner, source))
            out.append((mode, path, dest))
        return out
