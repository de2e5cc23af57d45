"""Attack on the end of a snapshot's settle (runtime/snapshots.py): its layer is hashed,
and its digest is then recorded under the snapshots' lock. While something else held
that lock (a commit installing a large layer, a gc removing one), ``Snapshots.settled()``
already answered "settled" with the registry still saying ``pending:``: a verify then
called the honest snapshot corrupt ("does not match its checksum: delete the snapshot"),
a travel was refused as "still being committed", and an engine closing did not wait for
the digest to be recorded (after a reboot the snapshot would have been dropped)."""

from __future__ import annotations

import asyncio
import threading

import pytest

from corral.runtime import layers
from tests.conftest import requires_root
from tests.runtime.test_snapshot_settle import digest_of, sh

pytestmark = [requires_root, pytest.mark.root]


async def test_settled_waits_until_the_digest_is_recorded(engine, monkeypatch):
    hashed = threading.Event()
    settle = engine.snapshots.store.settle

    def traced(layer_id: str) -> str:
        try:
            return settle(layer_id)
        finally:
            hashed.set()

    monkeypatch.setattr(engine.snapshots.store, "settle", traced)
    base = await engine.create()
    await sh(engine, base.id, "echo honest > /workspace/answer")
    snap = await engine.snapshot(base.id)
    top = snap.layers[0]
    async with engine.snapshots._lock:  # a commit or a gc holding it as the hashing ends
        assert await asyncio.to_thread(hashed.wait, 120), "the settle never hashed"
        await asyncio.sleep(0.05)  # the settle's task reaches the lock
        verifying = asyncio.ensure_future(engine.verify_snapshot(snap.id))
        describing = asyncio.ensure_future(engine.describe_snapshot(snap.id, None))
        waiting = asyncio.ensure_future(engine.snapshots.settled())
        await asyncio.sleep(0.3)
        # what waits for the digest has not been told it exists while it is pending
        assert not waiting.done() or not layers.is_pending(digest_of(engine, top))
    await waiting
    assert not layers.is_pending(digest_of(engine, top))
    await verifying  # the honest snapshot is not called corrupt
    desc = await describing  # nor refused as still being committed
    assert desc["layers"][0]["digest"] == digest_of(engine, top)
