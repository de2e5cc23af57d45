"""Attacks on the window between a snapshot's commit and its settle (its layer hashed
and made durable in the background: runtime/snapshots.py).

- A sandbox restored from the snapshot before the settle rewrites and deletes its
  files: the digest recorded is still that of the files committed (its writes go to
  its own upper dir, never into the layer being hashed).
- A tenant committing again and again before any settles cannot pass its snapshot
  quota: an unsettled layer counts as soon as it is listed.
- No digest is served or named before it exists: a peer asking for a ``pending:``
  digest is refused typed, and the snapshot is not described to another node."""

from __future__ import annotations

import asyncio

import pytest

from corral.errors import InvalidArgument, InvalidState, QuotaExceeded
from corral.runtime import layer_fetch, layers
from tests.conftest import requires_root
from tests.runtime.test_snapshot_settle import digest_of, gate_settles, sh

pytestmark = [requires_root, pytest.mark.root]


async def test_a_restored_copy_cannot_change_the_digest_its_snapshot_settles_to(
        engine, monkeypatch):
    opened = gate_settles(engine, monkeypatch)
    base = await engine.create()
    await sh(engine, base.id, "echo honest > /workspace/answer && mkdir /workspace/d "
             "&& echo keep > /workspace/d/keep && head -c 2000000 /dev/urandom > /workspace/blob")
    snap = await engine.snapshot(base.id)
    top = snap.layers[0]
    assert layers.is_pending(digest_of(engine, top))
    copy = await engine.create(snapshot=snap.id)
    await sh(engine, copy.id, "echo forged > /workspace/answer; rm -rf /workspace/d; "
             "head -c 100 /dev/zero > /workspace/blob; touch -d @0 /workspace/answer; "
             "echo new > /workspace/extra")
    opened.set()
    await engine.snapshots.settled()
    monkeypatch.setenv("CORRAL_SNAPSHOT_SETTLE", "sync")  # the same files, hashed in the commit
    honest = await engine.snapshot(base.id)
    assert digest_of(engine, top) == digest_of(engine, honest.layers[0])
    assert (engine.snapshots.store.path(top) / "workspace/answer").read_text() == "honest\n"
    await engine.verify_snapshot(snap.id)
    fresh = await engine.create(snapshot=snap.id)
    assert await sh(engine, fresh.id, "cat /workspace/answer /workspace/d/keep") == "honest\nkeep\n"


async def test_commits_faster_than_their_settle_stay_within_the_quota(engine, monkeypatch):
    opened = gate_settles(engine, monkeypatch)
    engine.snapshots.quota_of = lambda owner: (5 << 20) if owner == "racer" else None
    sb = await engine.create(tenant="racer")
    await sh(engine, sb.id, "head -c 3000000 /dev/urandom > /workspace/a")
    first = await engine.snapshot(sb.id, owner="racer")
    assert layers.is_pending(digest_of(engine, first.layers[0]))
    await sh(engine, sb.id, "head -c 3000000 /dev/urandom > /workspace/b")
    with pytest.raises(QuotaExceeded):
        await engine.snapshot(sb.id, owner="racer")
    results = await asyncio.gather(*(engine.snapshot(sb.id, owner="racer") for _ in range(3)),
                                   return_exceptions=True)
    assert all(isinstance(r, QuotaExceeded) for r in results), results
    assert engine.snapshots.usage_bytes("racer") <= 5 << 20
    assert [s.id for s in engine.list_snapshots(owner="racer")] == [first.id]
    opened.set()


async def test_no_pending_digest_is_served_or_described(engine, monkeypatch):
    opened = gate_settles(engine, monkeypatch)
    base = await engine.create()
    await sh(engine, base.id, "echo x > /workspace/x")
    snap = await engine.snapshot(base.id)
    pending = digest_of(engine, snap.layers[0])
    assert pending == layers.PENDING + layers.boot_id()
    with pytest.raises(InvalidArgument):  # a peer's GET /v1/peer/layers/{digest}
        layer_fetch.layer_path_for(engine.snapshots, pending)
    with pytest.raises(InvalidState, match="still being committed"):
        layer_fetch.describe(engine.snapshots, snap.id, None)
    opened.set()
    desc = await engine.describe_snapshot(snap.id, None)
    assert not layers.is_pending(desc["layers"][0]["digest"])
