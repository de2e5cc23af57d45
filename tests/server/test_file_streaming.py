"""File routes stream: the daemon's memory stays flat whatever a file's size.

A 200 MB upload and download through the native file routes (a real daemon, a real
sandbox) must not grow the daemon's peak resident memory by more than a small part of
the body: the peak (``VmHWM``) is reset through ``/proc/PID/clear_refs`` before each
transfer and read after it, so the measure is memory, never a clock. Before the routes
streamed, the body was held whole (a 200 MB ``bytearray``, then the file joined again).

The streaming ``multipart/form-data`` reader that E2B uploads go through is checked on
its own: every way of cutting a body into pieces gives the same parts.
"""

from __future__ import annotations

import asyncio
import hashlib
import os
from pathlib import Path

import pytest

from corral.errors import InvalidArgument
from corral.server.multipart import file_parts
from tests.conftest import requires_root

MB = 1 << 20
SIZE = 200 * MB
PIECE = os.urandom(MB)


def _peak_reset(pid: int) -> int:
    """Reset the process's peak RSS to its current RSS; that RSS, in bytes."""
    Path(f"/proc/{pid}/clear_refs").write_text("5")
    return _status(pid, "VmRSS")


def _status(pid: int, key: str) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith(key + ":"):
            return int(line.split()[1]) * 1024
    raise AssertionError(f"no {key} in /proc/{pid}/status")


def _body():
    for _ in range(SIZE // MB):
        yield PIECE


@requires_root
@pytest.mark.root
@pytest.mark.timeout(600)
def test_a_200_mb_upload_and_download_keep_the_daemons_memory_flat(daemon, client):
    reply = client.post("/v1/sandboxes", json={"memory_mb": 512, "tags": ["test-server"]})
    assert reply.status_code == 201, reply.text
    sid = reply.json()["id"]
    pid = daemon.proc.pid
    url = f"/v1/sandboxes/{sid}/files"
    try:
        before = _peak_reset(pid)
        up = client.put(url, params={"path": "/tmp/big"}, content=_body(),
                        headers={"content-length": str(SIZE)})
        assert up.status_code == 204, up.text
        grew_up = _status(pid, "VmHWM") - before

        expected = hashlib.sha256()
        for piece in _body():
            expected.update(piece)
        got, size = hashlib.sha256(), 0
        before = _peak_reset(pid)
        with client.stream("GET", url, params={"path": "/tmp/big"}) as down:
            assert down.status_code == 200
            for chunk in down.iter_bytes():
                got.update(chunk)
                size += len(chunk)
        grew_down = _status(pid, "VmHWM") - before
    finally:
        client.delete(f"/v1/sandboxes/{sid}")
    assert size == SIZE and got.hexdigest() == expected.hexdigest()
    # held whole, either would be >= SIZE; streamed, a few chunks at a time
    assert grew_up < SIZE // 8, f"upload grew the daemon's peak RSS by {grew_up >> 20} MB"
    assert grew_down < SIZE // 8, f"download grew the daemon's peak RSS by {grew_down >> 20} MB"


BODY = (b"preamble\r\n--XyZ\r\nContent-Disposition: form-data; name=\"file\"; filename=\"a.txt\""
        b"\r\n\r\nfirst\r\n--XY\r\n--XyZ\r\nContent-Disposition: form-data; name=\"k\"\r\n"
        b"\r\nvalue\r\n--XyZ\r\nContent-Type: x\r\nContent-Disposition: form-data; "
        b"filename=\"b/c.bin\"\r\n\r\n\r\n\x00\xff--XyZ\r\n--XyZ--\r\n")
PARTS = [("a.txt", b"first\r\n--XY"), (None, b"value"), ("b/c.bin", b"\r\n\x00\xff--XyZ")]


async def _parse(pieces: list[bytes], max_parts: int = 10) -> list[tuple[str | None, bytes]]:
    async def feed():
        for p in pieces:
            yield p

    out = []
    async for name, data in file_parts(feed(), b"XyZ", max_parts=max_parts):
        out.append((name, b"".join([c async for c in data])))
    return out


def test_the_multipart_reader_gives_the_same_parts_however_the_body_is_cut():
    for size in (1, 2, 3, 5, 7, 11, 64, len(BODY)):
        pieces = [BODY[i : i + size] for i in range(0, len(BODY), size)]
        assert asyncio.run(_parse(pieces)) == PARTS, size
    for cut in range(1, len(BODY)):  # every single cut
        assert asyncio.run(_parse([BODY[:cut], BODY[cut:]])) == PARTS, cut


@pytest.mark.parametrize("body,max_parts", [
    (BODY[:-20], 10),                 # ends inside a part
    (BODY, 2),                        # too many parts
    (b"--XyZ\r\n" + b"H" * (20 << 10), 10),  # endless headers
])
def test_a_bad_multipart_body_is_refused(body, max_parts):
    with pytest.raises(InvalidArgument):
        asyncio.run(_parse([body], max_parts))
