"""``corral cp``: copy files and directories between this host and a sandbox, like ``docker cp``.

One side is ``ID:PATH`` (absolute, or relative to the sandbox's workdir); the other is
a local path, or ``-`` for this process's standard input or output (one file's bytes).
A local path that contains ``:`` can be written ``./name:with:colons``.

- A file is copied with its permission bits. A destination that is an existing
  directory, or ends with ``/``, receives it under the source's name.
- A directory is packed with tar on one side, moved as one file, and unpacked on
  the other (so the sandbox's image needs tar; the default one has it). A
  destination that is an existing directory receives the copy under the source's
  name; otherwise the destination is created as the copy.
- Symbolic links are copied as links, with their target unchanged (absolute ones too,
  as in a virtualenv), and never followed: nothing is written outside the
  destination. A copy out of a sandbox is unpacked into a temporary directory next to
  the destination and renamed into place only once complete, so a failed copy leaves
  nothing behind; it never merges into an existing directory (remove that first).
  The host refuses device files, absolute paths and hard links out of the copy.
"""

from __future__ import annotations

import argparse
import contextlib
import io
import os
import posixpath
import re
import secrets
import shutil
import sys
import tarfile
import tempfile
from collections.abc import Iterator
from pathlib import Path

import corral
from corral.cli._output import Context, UsageError

_REMOTE = re.compile(r"^(?P<id>[A-Za-z0-9][A-Za-z0-9_.-]*):(?P<path>.*)$")
_ARCHIVE_DIR = "/tmp"  # where the archive of a directory waits inside the sandbox


def parse_remote(arg: str) -> tuple[str, str] | None:
    """``(sandbox id, path)`` for ``ID:PATH``; ``None`` for a local path.

    >>> parse_remote("sb-1a2b:/app/x.py"), parse_remote("sb-1a2b:")
    (('sb-1a2b', '/app/x.py'), ('sb-1a2b', '.'))
    >>> parse_remote("./a:b") is None and parse_remote("/tmp/x") is None
    True
    """
    if arg.startswith(("/", ".", "~")):
        return None
    m = _REMOTE.match(arg)
    return (m["id"], m["path"] or ".") if m else None


def cp(args: argparse.Namespace, ctx: Context) -> int:
    src, dst = parse_remote(args.src), parse_remote(args.dst)
    if (src is None) == (dst is None):
        raise UsageError(
            "one side of cp must be a sandbox path (ID:PATH) and the other a local path, "
            "e.g. corral cp app.py sb-1234:/workspace/"
        )
    if dst is not None:
        _upload(corral.Sandbox.connect(dst[0], client=ctx.client), args.src, dst[1])
    else:
        assert src is not None
        _download(corral.Sandbox.connect(src[0], client=ctx.client), src[1], args.dst)
    return 0


def _upload(sandbox: corral.Sandbox, local: str, remote: str) -> None:
    if local == "-":
        sandbox.files.write(remote, sys.stdin.buffer.read())
        return
    source = Path(local)
    name = source.resolve().name
    target = _remote_target(sandbox, remote, name)
    if not source.is_dir():
        sandbox.files.upload(source, target)  # a missing source raises FileNotFoundError
        return
    archive = f"{_ARCHIVE_DIR}/.corral-cp-{secrets.token_hex(6)}.tar"
    sandbox.files.write(archive, _pack(source), mode=0o600)
    _sh(
        sandbox,
        'mkdir -p -- "$1" && tar -x -f "$2" -C "$1"; rc=$?; rm -f -- "$2"; exit $rc',
        [target, archive],
        f"unpacking {local} into {target}",
    )


def _download(sandbox: corral.Sandbox, remote: str, local: str) -> None:
    info = sandbox.files.stat(remote)
    if not info.is_dir:
        data = sandbox.files.read(remote)
        if local == "-":
            sys.stdout.buffer.write(data)
            sys.stdout.flush()
            return
        target = _local_target(Path(local), info.name)
        with _staged(target, directory=False) as tmp:
            tmp.write_bytes(data)
            tmp.chmod(info.mode & 0o777)
        return
    archive = f"{_ARCHIVE_DIR}/.corral-cp-{secrets.token_hex(6)}.tar"
    if local == "-":
        raise UsageError(f"{sandbox.id}:{remote} is a directory: copy it to a local path, not -")
    try:
        _sh(sandbox, 'tar -c -f "$2" -C "$1" .', [remote, archive], f"packing {remote}")
        data = sandbox.files.read(archive)
    finally:
        with contextlib.suppress(corral.FileNotFound):
            sandbox.files.remove(archive)
    target = _local_target(Path(local), info.name)
    if os.path.lexists(target):
        raise corral.FileError(
            f"{target} exists: remove it, or copy to a new path ({sandbox.id}:{remote} "
            "is a directory and is never merged into another)",
            details={"path": str(target)},
        )
    with _staged(target, directory=True) as tmp, tarfile.open(fileobj=io.BytesIO(data)) as tar:
        try:
            tar.extractall(tmp, filter=_keep_symlinks)
        except tarfile.TarError as exc:
            raise corral.FileError(
                f"sandbox {sandbox.id}: refused to unpack {remote}: {exc} (nothing was written)",
                details={"sandbox_id": sandbox.id, "path": remote},
            ) from None
        tmp.chmod(info.mode & 0o777)


def _keep_symlinks(member: tarfile.TarInfo, dest: str) -> tarfile.TarInfo | None:
    """tarfile's ``data`` filter, except that a symlink keeps its target whatever it is
    (absolute, or out of the copy): it is created as a link, never followed. Its own
    path is still checked, and so is every later member's path with the links made so
    far resolved, so nothing is written through a link."""
    if not member.issym():
        return tarfile.data_filter(member, dest)
    checked = tarfile.data_filter(member.replace(linkname=".", deep=False), dest)
    return checked.replace(linkname=member.linkname, deep=False)


@contextlib.contextmanager
def _staged(target: Path, *, directory: bool) -> Iterator[Path]:
    """A temporary path next to ``target``, renamed to it when the block succeeds and
    removed when it fails, so ``target`` is never left half-written."""
    parent = target.parent
    parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{target.name}.corral-cp-", dir=parent))
    staged = tmp if directory else tmp / target.name
    try:
        yield staged
        os.replace(staged, target)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def _remote_target(sandbox: corral.Sandbox, path: str, name: str) -> str:
    """Where a copy named ``name`` goes when ``path`` is the destination in the sandbox."""
    if path.endswith("/") or _is_remote_dir(sandbox, path):
        return posixpath.join(path, name)
    return path


def _is_remote_dir(sandbox: corral.Sandbox, path: str) -> bool:
    try:
        return sandbox.files.stat(path).is_dir
    except corral.FileNotFound:
        return False


def _local_target(path: Path, name: str) -> Path:
    return path / name if path.is_dir() or str(path).endswith(os.sep) else path


def _pack(directory: Path) -> bytes:
    """A tar of the directory's contents (its entries at the archive's top)."""
    buffer = io.BytesIO()
    with tarfile.open(fileobj=buffer, mode="w") as tar:
        for entry in sorted(directory.iterdir()):
            tar.add(entry, arcname=entry.name)
    return buffer.getvalue()


def _sh(sandbox: corral.Sandbox, script: str, params: list[str], what: str) -> None:
    """Run a shell script (``$1``, ``$2``... from ``params``); raise if it fails."""
    result = sandbox.exec(["sh", "-c", script, "sh", *params], timeout=None)
    if not result.ok:
        raise corral.FileError(
            f"sandbox {sandbox.id}: {what} failed (exit status {result.returncode}): "
            f"{result.stderr.strip() or 'no message'}",
            details={"sandbox_id": sandbox.id},
        )
