"""``storage="disk"``: the writable layer on the host's disk, bounded by ``disk_mb`` and
``inodes``, not by memory; a full layer is ENOSPC inside and :class:`SandboxDiskFull`
from the file API (issue 25, item 7). Real engine, real loop-mounted ext4."""

from __future__ import annotations

import pytest

from corral.errors import InvalidArgument, SandboxDiskFull
from corral.schema import SandboxSpec, Storage
from tests.conftest import requires_root

WRITE_200M = "head -c 209715200 /dev/zero > /workspace/big; echo rc=$?"


def test_storage_is_memory_by_default_and_validated():
    assert SandboxSpec().storage == Storage.MEMORY
    assert SandboxSpec.parse({"storage": "disk"}).storage == Storage.DISK
    with pytest.raises(InvalidArgument):
        SandboxSpec.parse({"storage": "ssd"})


@requires_root
async def test_a_disk_layer_holds_more_than_the_sandboxs_memory(engine):
    disk = (await engine.create(storage="disk", memory_mb=96, disk_mb=300)).id
    r = await engine.exec(disk, WRITE_200M + "; stat -c %s /workspace/big", timeout=300)
    assert (r.oom_killed, r.stdout) == (False, b"rc=0\n209715200\n"), r
    # the control: the same write into the default tmpfs layer is charged to memory
    mem = (await engine.create(memory_mb=96, disk_mb=300)).id
    r = await engine.exec(mem, WRITE_200M, timeout=300)
    assert r.oom_killed or r.stdout == b"rc=137\n", r  # head was OOM-killed
    # and what it wrote survives a snapshot and comes back in a new sandbox
    r = await engine.exec(disk, "echo kept > /workspace/note", timeout=60)
    snap = await engine.snapshot(disk)
    again = (await engine.create(snapshot=snap.id)).id
    r = await engine.exec(again, "cat /workspace/note", timeout=60)
    assert r.stdout == b"kept\n"


@requires_root
async def test_a_full_disk_layer_is_enospc_inside_and_typed_outside(engine):
    sid = (await engine.create(storage="disk", disk_mb=32, inodes=500)).id
    r = await engine.exec(sid, "head -c 64000000 /dev/zero > /workspace/f", timeout=120)
    assert r.returncode != 0 and b"No space left" in r.stderr, r
    with pytest.raises(SandboxDiskFull) as info:
        await engine.write_file(sid, "/workspace/g", b"x" * (40 << 20))
    assert info.value.errno == 28 and info.value.details["sandbox_id"] == sid
    assert isinstance(info.value, OSError)
    await engine.exec(sid, "rm -f /workspace/f /workspace/g", timeout=60)
    # inodes bound it too: 500 files, not 5000
    r = await engine.exec(sid, "cd /workspace && i=0; while [ $i -lt 5000 ] && (true > f$i) 2>/dev/null;"
                               " do i=$((i+1)); done; echo $i", timeout=300)
    assert 450 <= int(r.stdout) <= 600, r
    # /dev/shm is in the same layer
    r = await engine.exec(sid, "df -P /dev/shm | tail -1", timeout=60)
    assert r.returncode == 0 and "tmpfs" not in r.stdout.decode()


@requires_root
def test_the_sdk_asks_for_a_disk_layer_and_gets_a_typed_full_disk(daemon):
    import corral

    client = corral.Client(daemon.url)
    with corral.Sandbox.create(client=client, storage="disk", disk_mb=64, memory_mb=64) as sb:
        assert sb.info.spec.storage == Storage.DISK
        with pytest.raises(corral.SandboxDiskFull) as info:
            sb.files.write("/workspace/g", b"x" * (70 << 20))
        assert info.value.errno == 28 and info.value.code == "sandbox_disk_full"
