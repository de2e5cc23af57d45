"""Red-team and size: a volume's archive is streamed (server/volume_stream.py,
client/_tarstream.py). It was read whole into the daemon's memory (capped by
--max-upload-bytes) and built whole in the SDK's: a dataset of GBs could not become a
volume. Now an archive larger than --max-upload-bytes makes a volume with the daemon's
memory bounded; a connection dropped mid-archive, a stream past the tenant's quota or
the disk's reserve leaves nothing behind (no staged file, no half-made volume)."""

from __future__ import annotations

import hashlib
import os
import socket
import struct
import tarfile
import time

import httpx
import pytest

import corral
from corral.errors import QuotaExceeded, StorageFull
from tests.security.tenants_helpers import no_traceback, read_by_peer, team_daemon

BIG = 64 << 20


@pytest.fixture(scope="module")
def team():
    with team_daemon("--max-upload-bytes", str(1 << 20)) as t:
        t.make_token("carol", max_snapshot_mb=8)
        yield t


def _leftovers(team) -> list[str]:
    """Staged archives and half-made volumes on the daemon's disk."""
    state = team.daemon.state_dir
    staged = [p.name for p in state.glob(".volume-upload-*")]
    vols = state / "volumes"
    half = [str(p) for p in vols.glob("*/.*")] if vols.is_dir() else []
    return staged + half


def _rss(pid: int, field: str) -> int:
    for line in open(f"/proc/{pid}/status"):
        if line.startswith(field + ":"):
            return int(line.split()[1]) << 10
    raise AssertionError(field)


def test_an_archive_past_max_upload_bytes_streams_with_bounded_memory(team, tmp_path):
    src = tmp_path / "data"
    (src / "shards").mkdir(parents=True)
    blob = os.urandom(BIG)
    (src / "shards" / "big.bin").write_bytes(blob)
    (src / "README").write_text("a dataset\n")
    os.link(src / "README", src / "shards" / "README.link")
    pid = team.daemon.proc.pid
    with open(f"/proc/{pid}/clear_refs", "w") as f:
        f.write("5")  # VmHWM starts again from the current RSS
    before = _rss(pid, "VmRSS")
    with corral.Client(team.url, token=team.tokens["alice"]) as alice:
        vol = corral.Volume.create("big", src, client=alice)
        grown = _rss(pid, "VmHWM") - before
        assert vol.info.files >= 4 and vol.info.size_bytes >= BIG
        data = team.daemon.state_dir / "volumes" / "alice" / "big" / "data"
        got = hashlib.sha256((data / "shards" / "big.bin").read_bytes()).hexdigest()
        assert got == hashlib.sha256(blob).hexdigest()
        assert (data / "shards" / "README.link").read_text() == "a dataset\n"
        assert grown < 32 << 20, f"the daemon grew {grown >> 20} MiB for a 64 MiB archive"
        vol.delete()
        for mode, ext in (("w:gz", "tgz"), ("w:xz", "txz"), ("w:bz2", "tbz")):  # read as sent
            packed = tmp_path / f"small.{ext}"
            with tarfile.open(packed, mode) as tar:
                tar.add(src / "README", arcname="docs/README")
            small = corral.Volume.create(f"small-{ext}", packed, client=alice)
            assert (data.parent.parent / f"small-{ext}" / "data" / "docs" / "README"
                    ).read_text() == "a dataset\n"
            small.delete()
    assert _leftovers(team) == []


def test_a_connection_dropped_mid_archive_leaves_nothing(team):
    s = socket.create_connection(("127.0.0.1", team.port))
    s.sendall((f"POST /v1/volumes?name=cut HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer "
               f"{team.tokens['alice']}\r\nContent-Length: {8 << 20}\r\n\r\n").encode()
              + b"\0" * (2 << 20))
    read_by_peer(s)  # the daemon staged what came
    s.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
    s.close()
    for _ in range(1200):
        if not _leftovers(team):
            break
        time.sleep(0.05)
    assert _leftovers(team) == []
    with team.tenant("alice") as http:
        assert http.get("/v1/volumes").json()["volumes"] == []


def _zeros(total: int):
    for _ in range(total // (1 << 20)):
        yield b"\0" * (1 << 20)


def test_a_stream_past_the_quota_is_cut_off_and_nothing_remains(team):
    """carol may hold 8 MiB: a 32 MiB archive of unknown length is refused part-way, one
    that declares its length before a byte is read; neither leaves anything."""
    with team.tenant("carol") as http:
        for body, headers in ((_zeros(32 << 20), {}),
                              (b"\0" * (32 << 20), {"Content-Length": str(32 << 20)})):
            try:
                r = http.post("/v1/volumes?name=fat", content=body, headers=headers)
            except httpx.TransportError:  # refused while the body still went out
                r = None
            if r is not None:
                assert r.json()["error"]["code"] == QuotaExceeded.code, r.text
            assert _leftovers(team) == []
            assert http.get("/v1/volumes").json()["volumes"] == []
    no_traceback(team)


async def test_a_stream_past_the_disk_reserve_is_cut_off_and_unlinked(tmp_path, monkeypatch):
    """The disk's room made small (12 MiB above its reserve): an archive whose bytes and
    tree would not fit is cut off with StorageFull and its staged file removed."""
    from starlette.requests import Request

    from corral.server import volume_stream

    def room(where):  # what is written there comes off it
        return (12 << 20) - sum(p.stat().st_size for p in where.iterdir())

    monkeypatch.setattr(volume_stream, "_room", room)
    sent = []

    async def receive():
        sent.append(1)
        return {"type": "http.request", "body": b"\0" * (1 << 20), "more_body": True}

    request = Request({"type": "http", "method": "POST", "headers": []}, receive)
    with pytest.raises(StorageFull):
        await volume_stream.stage_body(request, tmp_path, lambda _n: None)
    assert 5 <= len(sent) <= 8  # cut off part-way: 2x what came must fit
    assert list(tmp_path.iterdir()) == []


def test_a_killed_daemons_staged_archive_goes_at_the_next_start(team):
    """A daemon killed mid-archive leaves its staged file: the next one on the state
    directory removes it (no request can hold it then)."""
    stale = team.daemon.state_dir / ".volume-upload-killed"
    stale.write_bytes(b"\0" * 4096)
    team.daemon.stop()
    team.daemon.start()
    assert not stale.exists()
    no_traceback(team)
