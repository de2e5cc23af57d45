"""Directory trees moved as one tar archive: the local half of ``files.upload_dir`` /
``files.download_dir`` (and of ``corral cp``), blocking file work only.

- Symbolic links travel as links, their targets unchanged (absolute ones too, as in a
  virtualenv) and never followed: nothing is written outside the destination.
- An archive from a sandbox is unpacked into a temporary directory next to the
  destination and renamed into place only once complete, so a failed copy leaves
  nothing behind; it never merges into an existing directory. Device files, absolute
  paths and hard links out of the copy are refused (tarfile's ``data`` filter), and so
  is any member whose path goes through a link the archive made (:class:`NoThroughLinks`:
  a forged archive from a hostile sandbox, checked without trusting ``realpath``).
"""

from __future__ import annotations

import contextlib
import os
import shutil
import tarfile
import tempfile
from collections.abc import Iterator
from pathlib import Path

from corral.errors import FileError

ARCHIVE_DIR = "/tmp"
"""Where the archive of a directory waits inside the sandbox while it is packed or unpacked."""

UNPACK = 'mkdir -p -- "$1" && tar -x -f "$2" -C "$1"; rc=$?; rm -f -- "$2"; exit $rc'
"""The sandbox's side of an upload (``sh -c UNPACK sh DIR ARCHIVE``)."""
PACK = 'tar -c -f "$2" -C "$1" .'
"""The sandbox's side of a download (``sh -c PACK sh DIR ARCHIVE``)."""


def pack(directory: Path) -> Path:
    """A tar, in a temporary file the caller removes, of the directory's contents
    (its entries at the archive's top)."""
    if not directory.is_dir():
        raise FileError(f"{directory} is not a directory: upload a file with files.upload",
                        details={"path": str(directory)})
    fd, name = tempfile.mkstemp(prefix="corral-upload-", suffix=".tar")
    try:
        with os.fdopen(fd, "wb") as f, tarfile.open(fileobj=f, mode="w") as tar:
            for entry in sorted(directory.iterdir()):
                tar.add(entry, arcname=entry.name)
    except BaseException:
        os.unlink(name)
        raise
    return Path(name)


def scratch() -> Path:
    """A fresh temporary file name for an archive on its way in (the caller removes it)."""
    fd, name = tempfile.mkstemp(prefix="corral-download-", suffix=".tar")
    os.close(fd)
    return Path(name)


def keep_symlinks(member: tarfile.TarInfo, dest: str) -> tarfile.TarInfo | None:
    """tarfile's ``data`` filter, except that a symlink keeps its target whatever it is
    (absolute, or out of the copy): it is created as a link, never followed. Its own
    path is still checked, and so is every later member's path with the links made so
    far resolved, so nothing is written through a link."""
    if not member.issym():
        return tarfile.data_filter(member, dest)
    checked = tarfile.data_filter(member.replace(linkname=".", deep=False), dest)
    return checked.replace(linkname=member.linkname, deep=False)


class NoThroughLinks:
    """:func:`keep_symlinks`, and, without trusting ``os.path.realpath`` (which gives
    up on paths past PATH_MAX: CVE-2025-4517, unfixed before Python 3.11.13/3.12.11),
    a lexical rule: no member's path (nor a hard link's target) goes through a symlink
    an earlier member made, or is one, or has a ``..`` part. ``tar -c`` of a real tree
    never writes such a member; only a forged archive does. One per archive."""

    def __init__(self) -> None:
        self.links: set[tuple[str, ...]] = set()

    def _parts(self, member: tarfile.TarInfo, path: str) -> tuple[str, ...]:
        parts = tuple(p for p in path.split("/") if p not in ("", "."))
        if ".." in parts:
            raise tarfile.OutsideDestinationError(member, path)
        return parts

    def _through(self, parts: tuple[str, ...], *, itself: bool) -> bool:
        ends = range(1, len(parts) + (1 if itself else 0))
        return any(parts[:n] in self.links for n in ends)

    def __call__(self, member: tarfile.TarInfo, dest: str) -> tarfile.TarInfo | None:
        parts = self._parts(member, member.name)
        if self._through(parts, itself=True):
            raise tarfile.OutsideDestinationError(member, member.name)
        if member.islnk() and self._through(self._parts(member, member.linkname), itself=False):
            raise tarfile.OutsideDestinationError(member, member.linkname)
        checked = keep_symlinks(member, dest)
        if member.issym():
            self.links.add(parts)
        return checked


@contextlib.contextmanager
def staged(target: Path, *, directory: bool) -> Iterator[Path]:
    """A temporary path next to ``target``, renamed to it when the block succeeds and
    removed when it fails, so ``target`` is never left half-written."""
    parent = target.parent
    parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{target.name}.corral-cp-", dir=parent))
    staged_path = tmp if directory else tmp / target.name
    try:
        yield staged_path
        os.replace(staged_path, target)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def refuse_existing(target: Path, source: str) -> None:
    """A directory copy never merges into what is already at ``target``."""
    if os.path.lexists(target):
        raise FileError(
            f"{target} exists: remove it, or copy to a new path ({source} is a directory "
            "and is never merged into another)",
            details={"path": str(target)},
        )


def unpack(archive: Path, target: Path, *, mode: int, sandbox_id: str, source: str) -> None:
    """Unpack ``archive`` (``source`` in the sandbox) as the new directory ``target``
    (see the module's rules)."""
    refuse_existing(target, f"{sandbox_id}:{source}")
    with staged(target, directory=True) as tmp, tarfile.open(archive) as tar:
        try:
            tar.extractall(tmp, filter=NoThroughLinks())
        except tarfile.TarError as exc:
            raise FileError(
                f"sandbox {sandbox_id}: refused to unpack {source}: {exc} (nothing was written)",
                details={"sandbox_id": sandbox_id, "path": source},
            ) from None
        tmp.chmod(mode & 0o777)
