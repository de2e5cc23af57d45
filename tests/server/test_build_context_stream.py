"""A build context (``POST /v1/images/build`` and ``/v1/images/dockerfile`` with a tar
body) is streamed to a file in the image store, not held in the daemon's memory (as an
image archive, ``POST /v1/images/import``, already was: measured here too).

Before, both routes read the whole tar into a ``bytearray`` (up to --max-upload-bytes,
256 MB by default), copied it into ``bytes``, and only then wrote it to disk: a 96 MB
context grew the daemon's peak resident memory by about twice that. Now the body is
written to disk piece by piece as it arrives and unpacked from there. The measure is
the daemon's peak RSS (``VmHWM``, reset through ``/proc/PID/clear_refs``), never a
clock. The tar here has no request member, so each build is refused (400) right after
the unpack, before any sandbox starts.
"""

from __future__ import annotations

import tarfile
from pathlib import Path

import pytest

from tests.conftest import requires_root
from tests.server.conftest import assert_error

MB = 1 << 20
SIZE = 96 * MB
ZEROS = bytes(MB)


def _peak_reset(pid: int) -> int:
    Path(f"/proc/{pid}/clear_refs").write_text("5")  # VmHWM starts again from VmRSS
    return _status(pid, "VmRSS")


def _status(pid: int, key: str) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith(key + ":"):
            return int(line.split()[1]) * 1024
    raise AssertionError(f"no {key} in /proc/{pid}/status")


def _context_tar():
    """A tar of one ``context/big.bin`` of SIZE bytes, made as it is sent."""
    info = tarfile.TarInfo("context/big.bin")
    info.size = SIZE
    yield info.tobuf(tarfile.GNU_FORMAT)
    for _ in range(SIZE // MB):
        yield ZEROS
    yield bytes(2 * tarfile.BLOCKSIZE)  # the end of the archive


@requires_root
@pytest.mark.root
@pytest.mark.parametrize(("route", "member"), [("/v1/images/build", "build.json"),
                                               ("/v1/images/dockerfile", "dockerfile.json"),
                                               ("/v1/images/import?name=t-stream", "")])
def test_a_large_build_context_keeps_the_daemons_memory_flat(daemon, client, route, member):
    pid = daemon.proc.pid
    before = _peak_reset(pid)
    reply = client.post(route, content=_context_tar(),
                        headers={"Content-Type": "application/x-tar",
                                 "Content-Length": str(SIZE + 3 * tarfile.BLOCKSIZE)})
    grew = _status(pid, "VmHWM") - before
    if member:
        error = assert_error(reply, 400, "invalid_argument")
        assert member in error["message"], error  # unpacked whole, then refused
    else:  # an import (streamed before too): a tar that is no image
        assert reply.status_code == 400, reply.text
    # held whole, the body alone would be >= SIZE (and was twice that, copied)
    assert grew < SIZE // 4, f"a {SIZE >> 20} MB context grew the daemon by {grew >> 20} MB"
