"""Uploads and downloads cost the same per byte at any size (issue 25, item 1).

The blocking HTTP stack sends a buffer with ``while buf: n = sock.send(buf); buf =
buf[n:]``: each partial send copies the unsent rest, so a body handed over whole costs
size² / (2 × what one send takes) bytes of copying (200 MB took 131 s). The SDK hands
the transport pieces of at most ``CHUNK_BYTES``. These tests count, on the real
socket of a real daemon, what the transport is given and what it copies: no clock.
"""

from __future__ import annotations

import asyncio
import os
from pathlib import Path

import httpcore._backends.anyio as anyio_backend
import httpcore._backends.sync as sync_backend
import pytest

import corral
from corral.client._body import CHUNK_BYTES, SyncFileBody
from corral.client._unix import _BlockingStream
from tests.conftest import requires_root

MB = 1 << 20


class _CountingSocket:
    """Stands in front of httpcore's socket: records what each ``send`` was given and
    took. httpcore then copies ``len(buffer) - taken`` bytes (``buf = buf[n:]``)."""

    def __init__(self, sock, log: dict[str, int]) -> None:
        self._sock, self._log = sock, log

    def send(self, buffer) -> int:
        taken = self._sock.send(buffer)
        self._log["copied"] += len(buffer) - taken
        return taken

    def __getattr__(self, name):
        return getattr(self._sock, name)


@pytest.fixture
def wire(monkeypatch):
    """``{"largest": biggest buffer one write got, "copied": bytes copied, "sent": ...}``."""
    log = {"largest": 0, "copied": 0, "sent": 0}
    async_write = anyio_backend.AnyIOStream.write

    def counting(sync_write):
        def write(self, buffer, timeout=None):
            log["largest"] = max(log["largest"], len(buffer))
            log["sent"] += len(buffer)
            if not isinstance(self._sock, _CountingSocket):
                self._sock = _CountingSocket(self._sock, log)
            return sync_write(self, buffer, timeout)
        return write

    async def awrite(self, buffer, timeout=None):
        log["largest"] = max(log["largest"], len(buffer))
        log["sent"] += len(buffer)
        return await async_write(self, buffer, timeout)

    # httpcore's stream (TCP), and the SDK's on the Unix socket (corral.client._unix)
    monkeypatch.setattr(sync_backend.SyncStream, "write", counting(sync_backend.SyncStream.write))
    monkeypatch.setattr(_BlockingStream, "write", counting(_BlockingStream.write))
    monkeypatch.setattr(anyio_backend.AnyIOStream, "write", awrite)

    def reset() -> dict[str, int]:
        out = dict(log)
        log.update(largest=0, copied=0, sent=0)
        return out

    return reset


# A piece carries an HTTP chunk/frame overhead at most this big (headers go apart).
_SLACK = 4096


@requires_root
def test_a_large_write_reaches_the_socket_in_bounded_pieces(client, wire):
    data = os.urandom(16 * MB)
    with corral.Sandbox.create(memory_mb=256, client=client) as sb:
        wire()
        sb.files.write("/tmp/big", data)
        seen = wire()
        assert seen["sent"] >= len(data)
        assert seen["largest"] <= CHUNK_BYTES + _SLACK, seen
        # the copying behind partial sends: at most about one copy of each byte
        assert seen["copied"] <= 2 * len(data), seen
        assert sb.files.read("/tmp/big") == data


@requires_root
def test_copying_per_byte_does_not_grow_with_the_size(client, wire):
    """Four times the bytes, about four times the copying (not sixteen)."""
    with corral.Sandbox.create(memory_mb=256, client=client) as sb:
        per_byte = []
        for size in (4 * MB, 16 * MB):
            data = os.urandom(size)
            wire()
            sb.files.write("/tmp/big", data)
            per_byte.append((wire()["copied"] + 1) / size)
    # quadratic code: x4; linear code: about x1 (the same pieces, the same socket)
    assert per_byte[1] < 2 * per_byte[0] + 0.05, per_byte


@requires_root
def test_upload_streams_a_file_and_every_body_is_bounded(client, wire, tmp_path):
    local = tmp_path / "payload.bin"
    data = os.urandom(6 * MB + 123)
    local.write_bytes(data)
    with corral.Sandbox.create(memory_mb=256, client=client) as sb:
        wire()
        sb.files.upload(local, "/tmp/payload.bin")
        assert wire()["largest"] <= CHUNK_BYTES + _SLACK
        # a JSON body (a command's stdin) is sent in pieces too
        r = sb.exec(["wc", "-c"], stdin=b"x" * (3 * MB))
        assert r.stdout.strip() == str(3 * MB)
        assert wire()["largest"] <= CHUNK_BYTES + _SLACK
        got = sb.files.download("/tmp/payload.bin", tmp_path / "back.bin")
        assert got.read_bytes() == data
        assert sorted(p.name for p in tmp_path.iterdir()) == ["back.bin", "payload.bin"]


@requires_root
async def test_the_async_client_sends_the_same_bounded_pieces(aclient, wire, tmp_path):
    data = os.urandom(8 * MB)
    local = tmp_path / "in.bin"
    local.write_bytes(data)
    async with await corral.AsyncSandbox.create(memory_mb=256, client=aclient) as sb:
        wire()
        await sb.files.write("/tmp/a", data)
        await sb.files.upload(local, "/tmp/b")
        assert wire()["largest"] <= CHUNK_BYTES + _SLACK
        out = await sb.files.download("/tmp/b", tmp_path / "out.bin")
        assert await asyncio.to_thread(out.read_bytes) == data
        assert await sb.files.read("/tmp/a") == data


@requires_root
def test_a_failed_download_leaves_nothing_behind(client, tmp_path):
    with corral.Sandbox.create(memory_mb=64, client=client) as sb:
        with pytest.raises(corral.FileNotFound):
            sb.files.download("/tmp/missing", tmp_path / "x")
    assert list(tmp_path.iterdir()) == []


def test_a_file_that_changes_size_while_it_is_sent_is_refused(tmp_path):
    path = tmp_path / "f"
    path.write_bytes(b"a" * (CHUNK_BYTES * 2))
    body = SyncFileBody(path)
    pieces = iter(body)
    assert len(next(pieces)) == CHUNK_BYTES
    path.write_bytes(b"short")
    with pytest.raises(corral.FileError, match="changed size while it was uploaded"):
        list(pieces)
    grown = SyncFileBody(path)
    path.write_bytes(b"longer than before")
    with pytest.raises(corral.FileError, match="changed size"):
        list(grown)


@requires_root
def test_cli_cp_streams_in_bounded_pieces(daemon, client, wire, tmp_path, capsys):
    from corral.cli.main import main

    local = tmp_path / "big.bin"
    local.write_bytes(os.urandom(8 * MB))
    with corral.Sandbox.create(memory_mb=256, client=client) as sb:
        wire()
        assert main(["--url", daemon.url, "cp", str(local), f"{sb.id}:/tmp/big.bin"]) == 0
        assert wire()["largest"] <= CHUNK_BYTES + _SLACK
        assert main(["--url", daemon.url, "cp", f"{sb.id}:/tmp/big.bin",
                     str(tmp_path / "back.bin")]) == 0
    assert (tmp_path / "back.bin").read_bytes() == local.read_bytes()


@requires_root
def test_directories_travel_both_ways_through_the_sdk(client, tmp_path):
    src = tmp_path / "src"
    (src / "pkg").mkdir(parents=True)
    (src / "pkg" / "mod.py").write_text("X = 1\n")
    (src / "run.sh").write_text("#!/bin/sh\necho ok\n")
    (src / "run.sh").chmod(0o755)
    os.symlink("/etc/hostname", src / "link")
    with corral.Sandbox.create(memory_mb=64, client=client) as sb:
        sb.files.upload_dir(src, "/workspace/proj")
        assert sb.exec("/workspace/proj/run.sh").stdout == "ok\n"
        assert sb.files.read("/workspace/proj/pkg/mod.py") == b"X = 1\n"
        assert sb.exec("readlink /workspace/proj/link").stdout == "/etc/hostname\n"
        assert sb.exec("ls -a /tmp").stdout.split() == [".", ".."]  # no archive left
        back = sb.files.download_dir("/workspace/proj", tmp_path / "back")
        assert back == tmp_path / "back"
        assert (back / "pkg" / "mod.py").read_text() == "X = 1\n"
        assert os.access(back / "run.sh", os.X_OK)
        assert os.readlink(back / "link") == "/etc/hostname"
        with pytest.raises(corral.FileError, match="never merged"):
            sb.files.download_dir("/workspace/proj", back)
        with pytest.raises(corral.FileError, match="not a directory"):
            sb.files.download_dir("/workspace/proj/run.sh", tmp_path / "nope")
        with pytest.raises(corral.FileError, match="not a directory"):
            sb.files.upload_dir(src / "run.sh", "/workspace/x")
    assert not Path(tmp_path / "nope").exists()
