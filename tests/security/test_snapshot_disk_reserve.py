"""A client (a tenant, or code looping snapshot after snapshot for it) cannot fill the
host's disk with snapshots: like a stopped sandbox's kept files, a snapshot's copy never
takes the filesystem under the state directory below its reserve (10 %, at least
1 GiB). On a state directory with less than that free, a snapshot and a fork are
refused with storage_full (507), nothing half-made, the sandbox untouched; so are a live
checkpoint (CRIU wrote its images with no check) and a resumable upload."""

from __future__ import annotations

import os
import shutil
import subprocess

import pytest

from tests.conftest import ROOT_REASON, Daemon, _base_dir, have_root_runtime
from tests.server.conftest import uds_client


@pytest.fixture
def small_daemon():
    if not have_root_runtime() or os.geteuid() != 0:
        pytest.skip(ROOT_REASON + " (and mounting a small tmpfs needs root)")
    base = _base_dir()
    subprocess.run(["mount", "-t", "tmpfs", "-o", "size=96m,mode=0711", "tmpfs", str(base)],
                   check=True)
    d = Daemon(base)
    try:
        d.start()
        yield d
    finally:
        d.stop()
        subprocess.run(["umount", "-l", str(base)], check=False)
        shutil.rmtree(base, ignore_errors=True)


def test_snapshots_never_take_the_disk_below_its_reserve(small_daemon):
    with uds_client(small_daemon.socket) as c:
        made = c.post("/v1/sandboxes", json={"memory_mb": 64})
        assert made.status_code == 201, made.text
        sid = made.json()["id"]
        assert c.put(f"/v1/sandboxes/{sid}/files?path=/workspace/blob",
                     content=os.urandom(1 << 20)).status_code == 204
        snap = c.post(f"/v1/sandboxes/{sid}/snapshot", json={"name": "fills-the-disk"})
        assert snap.status_code == 507, snap.text
        assert snap.json()["error"]["code"] == "storage_full"
        fork = c.post(f"/v1/sandboxes/{sid}/fork", json={"n": 1})
        assert fork.status_code == 507, fork.text
        assert c.get("/v1/snapshots").json()["snapshots"] == []
        assert c.get(f"/v1/sandboxes/{sid}").json()["state"] == "running"
        assert len(c.get("/v1/sandboxes").json()["sandboxes"]) == 1
        ran = c.post(f"/v1/sandboxes/{sid}/exec", json={"cmd": ["true"]})
        assert ran.status_code == 200, ran.text
        assert ran.json()["returncode"] == 0, ran.text
        c.delete(f"/v1/sandboxes/{sid}")
        # a live checkpoint (CRIU's images: up to the sandbox's memory) and a resumable
        # upload's staged bytes keep the reserve too
        made = c.post("/v1/sandboxes", json={"memory_mb": 64, "checkpointable": True})
        assert made.status_code == 201, made.text
        sid = made.json()["id"]
        live = c.post(f"/v1/sandboxes/{sid}/checkpoint", json={})
        assert live.status_code == 507 and live.json()["error"]["code"] == "storage_full", live.text
        up = c.post(f"/v1/sandboxes/{sid}/uploads", json={"path": "f", "size": 1 << 20})
        assert up.status_code == 507 and up.json()["error"]["code"] == "storage_full", up.text
        assert c.get(f"/v1/sandboxes/{sid}").json()["state"] == "running"
        c.delete(f"/v1/sandboxes/{sid}")
    layers = small_daemon.state_dir / "layers"
    if layers.is_dir():  # no staged copy left behind
        assert not [p for p in layers.iterdir() if p.name.startswith((".", "tmp"))], list(layers.iterdir())
    assert "Traceback" not in small_daemon.log.read_text(errors="replace")
