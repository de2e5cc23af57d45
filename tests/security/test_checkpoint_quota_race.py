"""A tenant that checkpoints several sandboxes at once against a small
``max_snapshot_mb`` (runtime/engine_live.py).

Each checkpoint alone fits; two do not. Checked one by one before CRIU wrote anything,
all of them would pass and together hold more than the quota. So: the tenant ends at
or under its quota, every refused checkpoint is :class:`QuotaExceeded` (the sandbox
running on, untouched), and nothing half-made is left on disk (no process images but
those of the snapshots made, no staged or sealed layer but theirs)."""

from __future__ import annotations

import asyncio
import os

import pytest

from corral.errors import QuotaExceeded
from corral.runtime import checkpoint
from tests.conftest import requires_root
from tests.security.test_live_checkpoint import _need_criu

pytestmark = [requires_root, pytest.mark.root, pytest.mark.timeout(300)]

RACER = {"owner": "racer"}
N = 4
# a process holding a few MB: its checkpoint is some MB of images
HOLDER = ("nohup python3 -c 'import time; b = bytearray(4 << 20); b[:] = b\"x\" * len(b); "
          "open(\"/tmp/held\", \"w\").close(); time.sleep(1e6)' >/dev/null 2>&1 &")


def _held(engine) -> int:
    return engine.snapshots.usage_bytes("racer") + engine.snapshots.also_held("racer")


async def test_concurrent_checkpoints_stay_within_the_snapshot_quota(engine):
    _need_criu()
    ids = []
    for _ in range(N):
        sb = await engine.create(network="none", checkpointable=True, tenant="racer",
                                 memory_mb=128)
        await engine.exec(sb.id, ["sh", "-c", HOLDER], **RACER)
        ids.append(sb.id)
    for sid in ids:  # each holds its few MB before the race starts (bounded: a hang)
        for _ in range(600):
            if (await engine.exec(sid, ["test", "-e", "/tmp/held"], **RACER)).returncode == 0:
                break
            await asyncio.sleep(0.05)
    # one checkpoint alone, measured (then deleted): the quota fits one, not two
    one = await engine.checkpoint(ids[0], **RACER)
    size = _held(engine)
    await engine.delete_snapshot(one.id, **RACER)
    assert _held(engine) == 0
    limit = size * 3 // 2
    engine.snapshots.quota_of = lambda owner: limit if owner == "racer" else None

    results = await asyncio.gather(*(engine.checkpoint(sid, **RACER) for sid in ids),
                                   return_exceptions=True)
    made = [r for r in results if not isinstance(r, BaseException)]
    refused = [r for r in results if isinstance(r, BaseException)]
    assert all(isinstance(r, QuotaExceeded) for r in refused), refused
    assert 1 <= len(made) and refused, results
    assert _held(engine) <= limit, (_held(engine), limit, len(made))
    # nothing half-made: the images are the made snapshots', the layers theirs
    images = checkpoint.images_root(engine.layout.state_dir, "racer")
    assert sorted(os.listdir(images)) == sorted(s.id for s in made)
    store = engine.snapshots.store
    on_disk = sorted(p.name for p in store.root.iterdir())
    layers = sorted({layer for s in made
                     for layer in engine.snapshots.registry.snapshot(s.id).layers})
    assert on_disk == layers, (on_disk, layers)
    for sid in ids:  # every sandbox runs on, refused or not
        assert (await engine.exec(sid, ["true"], **RACER)).returncode == 0
    for snap in made:
        assert await engine.delete_snapshot(snap.id, **RACER)
    assert os.listdir(images) == []
