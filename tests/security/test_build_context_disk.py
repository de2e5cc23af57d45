"""Red team 10: build contexts and image archives streamed to disk (``wire.save_body``,
``image_routes._save_body``).

Held whole in memory before, a build context is now written to the image store as it
arrives: the daemon's memory no longer bounds how many a client sends at once, so the
disk must. Attacks: many uploads at once (each under --max-upload-bytes) on a disk
near its reserve: each is cut off typed (StorageFull, 507) once it and its unpacked
tree would take the disk below its reserve, counting what the others wrote (before:
written until the disk filled); a connection dropped mid-body and a tar that is no
build leave no work directory behind.
"""

from __future__ import annotations

import asyncio
import socket
import tarfile
import time

import pytest

from corral.errors import StorageFull
from corral.runtime.paths import default_cache_dir
from tests.conftest import requires_root
from tests.server.conftest import uds_client

MB = 1 << 20


async def test_uploads_at_once_stop_at_the_disks_reserve(tmp_path, monkeypatch):
    """The disk's room made small (16 MiB above its reserve, less what is written in
    the store): three endless uploads at once are each cut off with StorageFull before
    the store holds more than the room, and refused at once for a Content-Length that
    cannot fit."""
    from starlette.requests import Request

    from corral.server import wire

    def room(where):  # what any upload wrote there comes off it
        return (16 << 20) - sum(p.stat().st_size for p in where.iterdir())

    monkeypatch.setattr(wire, "_room", room)

    def endless(headers=()) -> Request:
        async def receive():
            await asyncio.sleep(0)
            return {"type": "http.request", "body": b"\0" * MB, "more_body": True}
        return Request({"type": "http", "method": "POST", "headers": list(headers)}, receive)

    results = await asyncio.gather(
        *(wire.save_body(endless(), tmp_path / f"ctx{i}.tar", 64 * MB, "build context")
          for i in range(3)), return_exceptions=True)
    assert all(isinstance(r, StorageFull) for r in results), results
    written = sum(p.stat().st_size for p in tmp_path.iterdir())
    assert written <= 16 * MB, written  # 2x each upload (archive and tree) kept the room
    sent = []

    async def receive():
        sent.append(1)
        return {"type": "http.request", "body": b"", "more_body": False}

    big = Request({"type": "http", "method": "POST",
                   "headers": [(b"content-length", str(64 * MB).encode())]}, receive)
    with pytest.raises(StorageFull):
        await wire.save_body(big, tmp_path / "big.tar", 1 << 30, "build context")
    assert sent == [] and not (tmp_path / "big.tar").exists()


def _work_dirs(pid: int) -> list[str]:
    images = default_cache_dir() / "images"
    return [p.name for p in images.glob(f".tmp-*-{pid}-*")] if images.is_dir() else []


@requires_root
@pytest.mark.root
@pytest.mark.parametrize("route", ["/v1/images/build", "/v1/images/dockerfile"])
def test_a_dropped_or_bad_context_leaves_no_work_directory(daemon, route):
    """A tar that is no build (400) and a body whose client hangs up half-way both
    leave nothing of the upload in the image store."""
    pid = daemon.proc.pid
    before = set(_work_dirs(pid))
    with uds_client(daemon.socket) as client:
        bad = client.post(route, content=b"this is no tar" * 100,
                          headers={"Content-Type": "application/x-tar"})
    assert bad.status_code == 400, bad.text
    info = tarfile.TarInfo("context/half.bin")
    info.size = 8 * MB
    with socket.socket(socket.AF_UNIX) as s:
        s.connect(str(daemon.socket))
        s.sendall(f"POST {route} HTTP/1.1\r\nHost: localhost\r\n"
                  "Content-Type: application/x-tar\r\n"
                  f"Content-Length: {16 * MB}\r\n\r\n".encode()
                  + info.tobuf(tarfile.GNU_FORMAT) + bytes(2 * MB))
        deadline = time.monotonic() + 30
        while set(_work_dirs(pid)) == before:  # it is being written
            assert time.monotonic() < deadline, "the upload never reached the disk"
            time.sleep(0.05)
    deadline = time.monotonic() + 30
    while set(_work_dirs(pid)) - before:
        assert time.monotonic() < deadline, _work_dirs(pid)
        time.sleep(0.05)


def _receiving(pid: int) -> bool:
    """Whether a context upload of daemon ``pid`` has begun writing to disk."""
    images = default_cache_dir() / "images"
    return any((d / "context.tar").exists() for d in images.glob(f".tmp-*-{pid}-*"))


def _reply_so_far(sock: socket.socket) -> bytes:
    """What the daemon answered on ``sock`` yet (a refusal names its reason)."""
    sock.setblocking(False)
    try:
        return sock.recv(65536)
    except BlockingIOError:
        return b"(no reply)"
    finally:
        sock.setblocking(True)


def test_a_tenant_receives_no_more_contexts_at_once_than_builds_it_may_run():
    """Before its build is admitted a context is received whole (up to
    --max-upload-bytes on disk): a tenant with max_builds 1 that opens many uploads at
    once had each written (N x 256 MB by default) before the gate said no. Now a
    context being received counts as one of the tenant's builds: the second is refused
    typed (quota_exceeded) before a byte of its body is read, and once the first ends
    the next is received."""
    from tests.security.tenants_helpers import no_traceback, team_daemon

    with team_daemon() as team:
        token = team.make_token("ivy", allow_images=True, max_builds=1)
        with team.tcp(token) as ivy:
            slow = socket.create_connection(("127.0.0.1", team.port))
            slow.sendall(b"POST /v1/images/build HTTP/1.1\r\nHost: x\r\n"
                         b"Content-Type: application/x-tar\r\n"
                         + f"Authorization: Bearer {token}\r\n".encode()
                         + f"Content-Length: {4 * MB}\r\n\r\n".encode() + bytes(MB))
            try:
                # until the daemon writes the first to disk (it is counted by then):
                # posting the second meanwhile could take the one place first
                deadline = time.monotonic() + 60
                while not _receiving(team.daemon.proc.pid):
                    assert time.monotonic() < deadline, _reply_so_far(slow)
                    time.sleep(0.05)
                second = ivy.post("/v1/images/build", content=b"junk",
                                  headers={"Content-Type": "application/x-tar"})
                assert second.json()["error"]["code"] == "quota_exceeded", second.text
            finally:
                slow.close()
            deadline = time.monotonic() + 60
            while True:  # the first's place is given back when its upload ends
                third = ivy.post("/v1/images/dockerfile", content=b"junk",
                                 headers={"Content-Type": "application/x-tar"})
                if third.status_code == 400:
                    break
                assert third.json()["error"]["code"] == "quota_exceeded", third.text
                assert time.monotonic() < deadline
                time.sleep(0.05)
        no_traceback(team)
