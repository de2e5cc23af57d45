"""Snapshot commits that return before their layer is hashed and durable (it settles in
the background): usable at once, checked against the digest of the very copy, and a
crash before the settle either settles it at the next start (same boot) or drops it
(the machine restarted: its bytes may be torn) — never a snapshot listed half written."""

from __future__ import annotations

import asyncio
import os
import signal
import sqlite3
import subprocess
import sys
import textwrap
import threading

import pytest

from corral.errors import InvalidState
from corral.runtime import layer_fetch, layers
from tests.conftest import requires_root

pytestmark = [requires_root, pytest.mark.root]


async def sh(engine, sid, cmd: str) -> str:
    r = await engine.exec(sid, cmd)
    assert r.returncode == 0, (cmd, r.stdout, r.stderr)
    return r.stdout.decode()


def gate_settles(engine, monkeypatch) -> threading.Event:
    """Hold every layer's settle until the event is set."""
    opened = threading.Event()
    settle = engine.snapshots.store.settle

    def held(layer_id: str) -> str:
        assert opened.wait(60), "the test never let the settle go"
        return settle(layer_id)

    monkeypatch.setattr(engine.snapshots.store, "settle", held)
    return opened


def digest_of(engine, layer_id: str) -> str:
    return engine.snapshots.registry.layer_rows([layer_id])[layer_id][0]


async def test_a_snapshot_is_usable_before_it_settles_and_settles_to_its_digest(engine,
                                                                               monkeypatch):
    opened = gate_settles(engine, monkeypatch)
    base = await engine.create()
    await sh(engine, base.id, "mkdir /workspace/d && echo one > /workspace/d/one "
             "&& head -c 3000000 /dev/urandom > /workspace/big")
    snap = await engine.snapshot(base.id, name="early")
    top = snap.layers[0]
    assert layers.is_pending(digest_of(engine, top))
    # used before its digest exists: restored, read, listed
    copy = await engine.create(snapshot="early")
    assert await sh(engine, copy.id, "cat /workspace/d/one") == "one\n"
    assert [s.name for s in engine.list_snapshots()] == ["early"]
    # what needs the digest waits for it, or is refused typed
    with pytest.raises(InvalidState, match="still being committed"):
        layer_fetch.describe(engine.snapshots, "early", None)
    verifying = asyncio.ensure_future(engine.verify_snapshot("early"))
    describing = asyncio.ensure_future(engine.describe_snapshot("early", None))
    await asyncio.sleep(0.2)
    assert not verifying.done() and not describing.done()
    opened.set()
    await verifying
    desc = await describing
    digest = digest_of(engine, top)
    assert digest == desc["layers"][0]["digest"]
    path = engine.snapshots.store.path(top)
    assert digest == layers.tree_digest(path)[0]
    manifest = (path.parent / layers.MANIFEST).read_text()
    assert digest in manifest
    # a peer asking by digest finds the layer, named at random
    assert layer_fetch.layer_path_for(engine.snapshots, digest) == path
    # the same content settled within a commit hashes equal
    monkeypatch.setenv("CORRAL_SNAPSHOT_SETTLE", "sync")
    again = await engine.snapshot(base.id, name="again")
    assert digest_of(engine, again.layers[0]) == digest


async def test_a_snapshot_deleted_before_it_settles_leaves_nothing(engine, monkeypatch):
    opened = gate_settles(engine, monkeypatch)
    base = await engine.create()
    await sh(engine, base.id, "echo x > /workspace/x")
    snap = await engine.snapshot(base.id)
    top = snap.layers[0]
    assert await engine.delete_snapshot(snap.id)
    opened.set()
    await engine.snapshots.settled()
    assert top not in engine.snapshots.registry.layer_ids()
    assert not (engine.layout.layers_dir / top).exists()


CRASHER = textwrap.dedent(
    """
    import asyncio, sys, time
    from corral.runtime.engine import Engine
    from corral.runtime.layers import LayerStore

    async def main():
        eng = await Engine.open(sys.argv[1])
        LayerStore.settle = lambda self, lid: time.sleep(3600)  # killed before it settles
        sb = await eng.create()
        await eng.exec(sb.id, "echo base > /workspace/f")
        await eng.snapshot(sb.id, name="base")
        copy = await eng.create(snapshot="base")
        await eng.exec(copy.id, "echo top > /workspace/g")
        await eng.snapshot(copy.id, name="top")
        print("committed", flush=True)
        time.sleep(3600)
    asyncio.run(main())
    """
)


def crash_after_commits(state_dir) -> None:
    """A daemon commits "base" and "top" (over it), then is killed before they settle."""
    crasher = subprocess.Popen([sys.executable, "-c", CRASHER, str(state_dir)],
                               stdout=subprocess.PIPE, text=True)
    try:
        assert crasher.stdout.readline() == "committed\n", "the crasher did not commit"
    finally:
        os.kill(crasher.pid, signal.SIGKILL)
        crasher.wait()


def pending_rows(state_dir) -> dict[str, str]:
    db = sqlite3.connect(state_dir / "registry.db")
    try:
        return dict(db.execute("SELECT id, digest FROM layers WHERE digest LIKE 'pending:%'"))
    finally:
        db.close()


async def test_a_daemon_killed_before_the_settle_keeps_its_snapshots(state_dir):
    from corral.runtime.engine import Engine

    crash_after_commits(state_dir)
    assert len(pending_rows(state_dir)) == 2
    async with await Engine.open(state_dir) as engine:
        assert sorted(s.name for s in engine.list_snapshots()) == ["base", "top"]
        assert not engine.snapshots.registry.pending_layers()  # settled at open
        sid = (await engine.create(snapshot="top")).id
        assert await sh(engine, sid, "cat /workspace/f /workspace/g") == "base\ntop\n"
        await engine.verify_snapshot("top")


async def test_after_the_machine_restarted_an_unsettled_snapshot_is_dropped(state_dir):
    from corral.runtime.engine import Engine

    crash_after_commits(state_dir)
    db = sqlite3.connect(state_dir / "registry.db")
    with db:  # as if the kernel had booted again since: its page cache is gone
        db.execute("UPDATE layers SET digest='pending:another-boot' WHERE digest LIKE 'pending:%'")
    db.close()
    async with await Engine.open(state_dir) as engine:
        assert engine.list_snapshots() == []  # never listed, possibly torn
        assert engine.snapshots.registry.layer_ids() == set()
        assert not [p for p in engine.layout.layers_dir.iterdir()]
