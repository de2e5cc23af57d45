"""Reading an image layer whatever its compression: plain tar, gzip or zstd.

OCI layers come as ``tar``, ``tar+gzip`` or ``tar+zstd``
(``application/vnd.oci.image.layer.v1.tar+zstd``); the media type may lie, so the
codec is chosen by the blob's magic bytes. zstd is decompressed by Debian's ``zstd``
program in a child process, not by a Python binding: on a 2.4 GB tar (648 MB
compressed) ``zstd -dc`` into a pipe took 5.9 s against 14.3 s for the ``zstandard``
wheel's stream reader (both hashing what came out; 2 cores, loaded), because the
child decompresses on one core while we unpack on the other. The child gets no more
memory than its default window limit (128 MiB: a frame asking for more is refused),
and the caller bounds what comes out (:class:`corral.runtime.image_pull._Checked`
stops past the pull's byte budget, and closing the reader kills the child).
"""

from __future__ import annotations

import contextlib
import gzip
import os
import shutil
import subprocess
import zlib
from collections.abc import Iterator
from pathlib import Path
from typing import IO, Protocol

from corral.errors import ImageImportError
from corral.runtime.storage import room_above_reserve

MAX_BYTES_ENV = "CORRAL_PULL_MAX_BYTES"
DEFAULT_MAX_BYTES = 64 << 30
GZIP_MAGIC = b"\x1f\x8b"
ZSTD_MAGIC = b"\x28\xb5\x2f\xfd"
_CHUNK = 1 << 20
# What a damaged stream raises while it is read (the zstd child's failure is found
# by its exit status, see open_layer).
DECODE_ERRORS = (EOFError, zlib.error, gzip.BadGzipFile)


def codec(path: Path) -> str:
    """``"zstd"``, ``"gzip"`` or ``"tar"``, from the first bytes of ``path``."""
    with open(path, "rb") as f:
        magic = f.read(4)
    if magic.startswith(ZSTD_MAGIC):
        return "zstd"
    return "gzip" if magic.startswith(GZIP_MAGIC) else "tar"


def _zstd() -> str:
    found = shutil.which("zstd")
    if found is None:
        raise ImageImportError(
            "a layer is zstd-compressed and the `zstd` program is missing: install "
            "Debian's zstd package (scripts/install.sh does)")
    return found


@contextlib.contextmanager
def open_layer(path: Path, what: str) -> Iterator[IO[bytes]]:
    """The layer at ``path`` as a stream of plain tar bytes; ``what`` names the layer
    in errors ("layer 2 of REF"). A damaged stream raises :class:`ImageImportError`."""
    kind = codec(path)
    with open(path, "rb") as raw:
        if kind == "tar":
            yield raw
            return
        if kind == "gzip":
            try:
                with gzip.GzipFile(fileobj=raw) as src:
                    yield src  # type: ignore[misc]
            except DECODE_ERRORS as exc:
                raise ImageImportError(f"{what}: bad gzip data ({exc})") from None
            return
        proc = subprocess.Popen([_zstd(), "-dcq", "--no-progress"], stdin=raw,
                                stdout=subprocess.PIPE, stderr=subprocess.PIPE, env={})
        assert proc.stdout is not None and proc.stderr is not None
        finished = False
        try:
            yield proc.stdout
            finished = True
        finally:
            if not finished:
                proc.kill()  # the caller stopped early (a limit, an error): stop it
            proc.stdout.close()
            err = proc.stderr.read(4096).decode(errors="replace").strip()
            proc.stderr.close()
            code = proc.wait()
        if code != 0:
            raise ImageImportError(f"{what}: bad zstd data ({err or f'exit {code}'})")


def max_pull_bytes() -> int:
    """What one pull or import may unpack (:data:`MAX_BYTES_ENV`, else the default)."""
    raw = os.environ.get(MAX_BYTES_ENV, "")
    return int(raw) if raw.isdigit() and int(raw) > 0 else DEFAULT_MAX_BYTES


def expansion_limit(dest: Path) -> int:
    """What a compressed archive may expand to in ``dest``'s directory: at most what a
    pull may unpack, and never past the disk's reserve there (a few MB of bzip2 or xz
    of zeros expand to terabytes)."""
    return min(max_pull_bytes(), room_above_reserve(dest.parent))


class Readable(Protocol):
    """What :func:`copy_bounded` reads from (a file, a gzip, bz2 or lzma stream)."""

    def read(self, size: int = ..., /) -> bytes: ...


def copy_bounded(src: Readable, out: IO[bytes], limit: int, what: str) -> None:
    """Copy ``src`` to ``out``; :class:`~corral.errors.ImageImportError` past ``limit``
    bytes."""
    n = 0
    while chunk := src.read(_CHUNK):
        n += len(chunk)
        if n > limit:
            raise ImageImportError(
                f"{what} expands past {max(0, limit)} bytes (what one import may unpack, "
                f"{MAX_BYTES_ENV}, or the room above the disk's reserve): refused",
                details={"limit": max(0, limit)})
        out.write(chunk)


def decompress_to(path: Path, dest: Path, what: str) -> None:
    """Write the plain tar of the layer at ``path`` to ``dest``, within
    :func:`expansion_limit`."""
    limit = expansion_limit(dest)
    with open_layer(path, what) as src, open(dest, "wb") as out:
        copy_bounded(src, out, limit, what)
