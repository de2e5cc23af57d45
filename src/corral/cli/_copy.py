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
- A file of 8 MiB or more shows a progress bar (bytes, speed, time left) on stderr when
  stderr is a terminal; nothing otherwise. Files over 256 MiB go as resumable uploads.
"""

from __future__ import annotations

import argparse
import os
import posixpath
import re
import sys
from pathlib import Path

import corral
from corral.cli._output import Context, Output, UsageError
from corral.client._tree import staged

_REMOTE = re.compile(r"^(?P<id>[A-Za-z0-9][A-Za-z0-9_.-]*):(?P<path>.*)$")


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
        _upload(corral.Sandbox.connect(dst[0], client=ctx.client), args.src, dst[1], ctx.output)
    else:
        assert src is not None
        _download(corral.Sandbox.connect(src[0], client=ctx.client), src[1], args.dst,
                  ctx.output)
    return 0


def _upload(sandbox: corral.Sandbox, local: str, remote: str, out: Output) -> None:
    if local == "-":
        sandbox.files.write(remote, sys.stdin.buffer.read())
        return
    source = Path(local)
    name = source.resolve().name
    target = _remote_target(sandbox, remote, name)
    if not source.is_dir():
        size = source.stat().st_size  # a missing source raises FileNotFoundError
        with out.transfer(f"{name} -> {sandbox.id}", size) as progress:
            sandbox.files.upload(source, target, progress=progress)
        return
    sandbox.files.upload_dir(source, target)


def _download(sandbox: corral.Sandbox, remote: str, local: str, out: Output) -> None:
    info = sandbox.files.stat(remote)
    if not info.is_dir:
        if local == "-":
            sys.stdout.buffer.write(sandbox.files.read(remote))
            sys.stdout.flush()
            return
        target = _local_target(Path(local), info.name)
        with staged(target, directory=False) as tmp, \
                out.transfer(f"{sandbox.id}:{info.name}", info.size) as progress:
            sandbox.files.download(remote, tmp, progress=progress)
            tmp.chmod(info.mode & 0o777)
        return
    if local == "-":
        raise UsageError(f"{sandbox.id}:{remote} is a directory: copy it to a local path, not -")
    sandbox.files.download_dir(remote, _local_target(Path(local), info.name))


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
