"""Volumes: named directory trees mounted into many sandboxes at no copy cost.

A volume belongs to a tenant (the admin's: ``_admin``) and lives in the state
directory, its files owned by the canonical sandbox uid (like layers: each sandbox
sees them as its own through its idmapping)::

    <state>/volumes/<owner>/<name>/data        the tree
    <state>/volumes/<owner>/<name>/meta.json   {"name", "size_bytes", "files", "created_at",
                                                "max_mb"}
    <state>/volumes/<owner>/<name>/volume.img  with max_mb: an ext4 of max_mb MiB, mounted
                                               (loop) at data while the host is up

It is made from a tar archive (:meth:`Volumes.create`, extracted by the same checked
code as image layers, :func:`corral.runtime.oci.apply_layer`: no path leaves the tree,
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
"""

from __future__ import annotations

import errno
import os
import shutil
import subprocess
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

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
from corral.runtime.oci import apply_layer
from corral.runtime.storage import room_above_reserve
from corral.runtime.uids import CANONICAL_UID
from corral.volume_schema import VOLUME_NAME_RE, VolumeInfo, parse_mount

ADMIN_DIR = "_admin"
IMAGE = "volume.img"
MIN_MB, MAX_MB = 8, 1 << 22  # a capped volume's size limits (ext4 wants a few MiB)


def reserved_bytes(info: VolumeInfo) -> int:
    """What a volume may take on disk: its cap, else its tree's size."""
    return max(info.size_bytes, (info.max_mb or 0) << 20)


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


def _make_image(work: Path, max_mb: int) -> None:
    """``work/volume.img``: an ext4 of ``max_mb`` MiB holding ``work/data``'s tree, its
    blocks allocated now: a sparse image would let volumes promise more than the disk
    holds, and their rw writers fill the disk every tenant's state is on."""
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
    shutil.rmtree(work / "data")
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
    if not isinstance(name, str) or not VOLUME_NAME_RE.match(name):
        raise InvalidArgument(
            f"invalid volume name {name!r}: use 1-63 lower-case letters, digits, '.', '_' "
            "or '-', starting with a letter or digit (no '/', no '..')")
    return name


def _canonical(root: Path) -> tuple[int, int]:
    """Chown the tree to the canonical uid; its (bytes, files)."""
    size = files = 0
    for dirpath, dirnames, filenames in os.walk(root):
        for n in (*dirnames, *filenames):
            p = os.path.join(dirpath, n)
            os.chown(p, CANONICAL_UID, CANONICAL_UID, follow_symlinks=False)
            st = os.lstat(p)
            size += st.st_blocks * 512
            files += 1
    os.chown(root, CANONICAL_UID, CANONICAL_UID)
    os.chmod(root, 0o755)
    return size, files


class Volumes:
    """The volumes of one state directory."""

    def __init__(self, root: Path) -> None:
        self.root = root

    def _dir(self, owner: str | None, name: str) -> Path:
        return self.root / _owner_dir(owner) / check_name(name)

    def data_dir(self, owner: str | None, name: str) -> Path:
        return self._dir(owner, name) / "data"

    def create(self, owner: str | None, name: str, archive: Path, *,
               check: Callable[[str | None, int], None] | None = None,
               max_mb: int | None = None) -> VolumeInfo:
        """A new volume ``name`` of ``owner`` from the tar file ``archive``; ``check``
        (owner, bytes) may refuse it (a quota) before it appears; ``max_mb``: a volume
        that never holds more (see the module's docstring)."""
        if max_mb is not None and not MIN_MB <= max_mb <= MAX_MB:
            raise InvalidArgument(f"invalid max_mb {max_mb}: use {MIN_MB}-{MAX_MB}",
                                  details={"field": "max_mb"})
        final = self._dir(owner, name)
        if final.exists():
            raise InvalidState(f"volume {name!r} exists: remove it first (corral volume rm "
                               f"{name}) or pick another name", details={"volume": name})
        final.parent.mkdir(parents=True, exist_ok=True, mode=0o711)
        # a capped one takes max_mb; an uncapped one its tree (checked again once made)
        _check_room(final.parent, (max_mb or 0) << 20 or archive.stat().st_size, max_mb)
        work = Path(tempfile.mkdtemp(prefix=f".{name}.", dir=final.parent))
        try:
            (work / "data").mkdir()
            apply_layer(work / "data", archive)
            size, files = _canonical(work / "data")
            info = VolumeInfo(name=name, size_bytes=size, files=files, created_at=time.time(),
                              max_mb=max_mb)
            if max_mb is not None and size > max_mb << 20:
                raise VolumeFull(f"the archive holds {size} bytes, over the volume's max_mb "
                                 f"({max_mb}): give a larger max_mb",
                                 details={"volume": name, "max_mb": max_mb})
            if check is not None:
                check(owner, reserved_bytes(info))
            if max_mb is None:
                _check_room(final.parent, 0, None)  # its tree left the reserve free
            if max_mb is not None:
                _make_image(work, max_mb)
            (work / "meta.json").write_text(info.model_dump_json())
            os.chmod(work, 0o711)
            os.rename(work, final)  # atomic; fails if a racing create won
        except BaseException:
            shutil.rmtree(work, ignore_errors=True)
            raise
        if max_mb is not None:
            try:
                _mount(final / IMAGE, final / "data")
            except BaseException:
                shutil.rmtree(final, ignore_errors=True)
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
            if not d.name.startswith(".") and (d / "meta.json").exists():
                out.append(VolumeInfo.model_validate_json((d / "meta.json").read_text()))
        return out

    def get(self, owner: str | None, name: str) -> VolumeInfo:
        meta = self._dir(owner, name) / "meta.json"
        if not meta.exists():
            raise VolumeNotFound(f"no volume {name!r} here: create it with corral volume "
                                 f"create {name} --from DIR (on a cluster, on each node that "
                                 "mounts it: volumes do not travel between nodes yet)",
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
        shutil.rmtree(trash, ignore_errors=True)

    def used_bytes(self, owner: str | None) -> int:
        return sum(reserved_bytes(v) for v in self.of(owner))

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
                if mode == "rw" and owner is not None and info.max_mb is None:
                    # its writes land on the host's disk, capped by nothing: one sandbox
                    # could fill the disk every tenant's state is on
                    raise Forbidden(
                        f"volume {dest}: {source!r} has no size (max_mb), so a tenant mounts "
                        "it ro or cow only; for rw, create a volume with max_mb "
                        f"(corral volume create {source} --max-mb N)",
                        details={"field": "volumes", "volume": source})
                self.ensure_mounted(owner, source)
                path = str(self.data_dir(owner, source))
            out.append((mode, path, dest))
        return out
