"""Snapshot commits frozen only for the delta of a precopy (issue 30), end to end.

Real sandboxes: a process holding open files lives through the commit and keeps
writing; a sandbox mapping a file
shared and writable (what timestamps cannot follow) is committed by a whole frozen
copy; what changes between the precopy and the freeze is committed as frozen. The attacks (writing through old descriptors into the snapshot) are in
tests/security/test_snapshot_old_fd.py.
"""

from __future__ import annotations

import asyncio

import pytest

from corral.errors import InternalError
from corral.runtime import precopy
from tests.conftest import requires_root

pytestmark = [requires_root, pytest.mark.root]

MB = 1 << 20

# Reads commands on stdin, acts on files it opened before, answers "ok <cmd>".
HOLDER = ["python3", "-u", "-c", """
import mmap, os, sys
log = open('/workspace/log', 'a', buffering=1)
log.write('before\\n')
m = None
for line in sys.stdin:
    cmd = line.strip()
    if cmd == 'write':
        log.write('after\\n')
    elif cmd == 'map':
        fd = os.open('/workspace/mapped', os.O_RDWR | os.O_CREAT, 0o644)
        os.ftruncate(fd, 4096)
        m = mmap.mmap(fd, 4096)
        m[:6] = b'mapped'
    print('ok', cmd, flush=True)
"""]

async def _ask(proc, cmd: str) -> None:
    await proc.write(f"{cmd}\n".encode())
    assert await asyncio.wait_for(proc.readline(), 30) == f"ok {cmd}\n".encode()


async def _cat(engine, sid: str, path: str) -> bytes:
    r = await engine.exec(sid, ["cat", path])
    assert r.returncode == 0, r.stderr
    return r.stdout


async def test_a_process_with_open_files_survives_the_commit_and_writes_on(engine):
    sb = await engine.create(network="none")
    holder = await engine.spawn(sb.id, HOLDER)
    await _ask(holder, "ready")
    await engine.exec(sb.id, f"head -c {8 * MB} /dev/urandom > /workspace/data")
    snap = await engine.snapshot(sb.id)
    assert engine.snapshots.last_recopied != precopy.WHOLE  # the precopy path was taken
    await _ask(holder, "write")  # the same descriptor, after the commit
    assert await _cat(engine, sb.id, "/workspace/log") == b"before\nafter\n"
    copy = await engine.create(snapshot=snap.id)
    try:
        assert await _cat(engine, copy.id, "/workspace/log") == b"before\n"
        same = await engine.exec(sb.id, "sha256sum /workspace/data")
        assert (await engine.exec(copy.id, "sha256sum /workspace/data")).stdout == same.stdout
    finally:
        await holder.close_stdin()
        assert (await holder.wait(30)).returncode == 0
        await engine.delete(copy.id)
        await engine.delete(sb.id)


async def test_changes_made_after_the_precopy_are_in_the_snapshot(engine, monkeypatch):
    """What the sandbox changes between the precopy and the freeze (done here through
    its own overlay root, right after the precopy) is committed as it is frozen."""
    sb = await engine.create(network="none")
    await engine.exec(sb.id, "cd /workspace && echo old > edit && echo x > rm && "
                             "echo m > mv && mkdir d && echo y > d/y")
    root = engine.upper_dir(sb.id).parent.parent / "root" / "workspace"
    store = engine.snapshots.store
    precopy_stage = store.stage

    def stage_then_change(*args, **kwargs):
        tmp = precopy_stage(*args, **kwargs)
        if kwargs.get("record") is not None:  # the precopy, the sandbox still running
            (root / "edit").write_text("new!\n")
            (root / "rm").unlink()
            (root / "mv").rename(root / "d" / "moved")
            (root / "d" / "new").write_text("n\n")
        return tmp

    monkeypatch.setattr(store, "stage", stage_then_change)
    snap = await engine.snapshot(sb.id)
    monkeypatch.undo()
    assert engine.snapshots.last_recopied > 0
    copy = await engine.create(snapshot=snap.id)
    try:
        r = await engine.exec(copy.id, "cd /workspace && cat edit d/moved d/new d/y; ls")
        assert r.stdout == b"new!\nm\nn\ny\nd\nedit\n", r
    finally:
        await engine.delete(copy.id)
        await engine.delete(sb.id)


async def test_a_shared_writable_mapping_makes_the_commit_a_whole_frozen_copy(engine):
    sb = await engine.create(network="none")
    holder = await engine.spawn(sb.id, HOLDER)
    try:
        await _ask(holder, "map")
        snap = await engine.snapshot(sb.id)
        assert engine.snapshots.last_recopied == precopy.WHOLE
        copy = await engine.create(snapshot=snap.id)
        assert (await _cat(engine, copy.id, "/workspace/mapped"))[:6] == b"mapped"
        await engine.delete(copy.id)
    finally:
        await holder.close_stdin()
        await engine.delete(sb.id)


async def test_a_tree_changing_under_the_precopy_is_copied_whole_frozen(engine, monkeypatch):
    """A precopy that meets a changing tree (an entry gone, a directory moved) gives
    up; the commit copies the whole layer frozen instead, and is right."""
    sb = await engine.create(network="none")
    await engine.exec(sb.id, "echo kept > /workspace/kept")
    store = engine.snapshots.store
    plain_stage = store.stage

    def racing_stage(*args, **kwargs):
        if kwargs.get("record") is not None:
            raise InternalError("'d' changed while its tree was walked")
        return plain_stage(*args, **kwargs)

    monkeypatch.setattr(store, "stage", racing_stage)
    snap = await engine.snapshot(sb.id)
    monkeypatch.undo()
    assert engine.snapshots.last_recopied == precopy.WHOLE
    copy = await engine.create(snapshot=snap.id)
    try:
        assert await _cat(engine, copy.id, "/workspace/kept") == b"kept\n"
    finally:
        await engine.delete(copy.id)
        await engine.delete(sb.id)
