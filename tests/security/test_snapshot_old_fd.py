"""Attacks on a snapshot through what the sandbox held when it was committed (issue 30).

A commit copies the writable layer while the sandbox runs and freezes it only for the
delta (corral.runtime.precopy). The snapshot must still be immutable: the sandbox
writing after the commit through a descriptor or a shared mapping it opened before,
or a sandbox restored from the snapshot writing to the same files, never changes it
(another restore sees the committed bytes, and the layer still matches its digest on
a full re-read). And a file swapped for a FIFO under the running copy must not hang it.
"""

from __future__ import annotations

import asyncio
import os
import time

import pytest

from corral.errors import InternalError
from corral.runtime import precopy
from corral.runtime.treecopy import CopyState, copy_node
from tests.conftest import requires_root

# Opens its files, then on "go" writes through what it opened before the commit.
ATTACKER = """
import mmap, os, sys
fd = os.open('/workspace/secret', os.O_RDWR)
mfd = os.open('/workspace/mapped', os.O_RDWR)
m = mmap.mmap(mfd, 4096) if sys.argv[1] == 'map' else None
print('ready', flush=True)
sys.stdin.readline()
os.pwrite(fd, b'EVIL', 0)
os.pwrite(mfd, b'EVIL', 0)
if m is not None:
    m[:4] = b'EVIL'
    m.flush()
again = os.open(f'/proc/self/fd/{fd}', os.O_WRONLY | os.O_APPEND)
os.write(again, b'MORE')
print('done', flush=True)
"""


async def _cat(engine, sid: str, path: str) -> bytes:
    r = await engine.exec(sid, ["cat", path])
    assert r.returncode == 0, r.stderr
    return r.stdout


@requires_root
@pytest.mark.root
@pytest.mark.parametrize("way", ["fd", "map"])
async def test_writes_through_old_descriptors_never_change_the_snapshot(engine, way):
    """``fd``: the commit took the precopy path (only the delta frozen); ``map``: a
    shared writable mapping made it copy the whole layer frozen. Both are immutable."""
    sb = await engine.create(network="none")
    await engine.exec(sb.id, "printf good > /workspace/secret; "
                             "head -c 4096 /dev/zero | tr '\\0' g > /workspace/mapped")
    attacker = await engine.spawn(sb.id, ["python3", "-u", "-c", ATTACKER, way])
    assert await asyncio.wait_for(attacker.readline(), 30) == b"ready\n"
    snap = await engine.snapshot(sb.id)
    assert (engine.snapshots.last_recopied == precopy.WHOLE) == (way == "map")
    await attacker.write(b"go\n")
    assert await asyncio.wait_for(attacker.readline(), 30) == b"done\n"
    assert await _cat(engine, sb.id, "/workspace/secret") == b"EVILMORE"  # it did write
    first = await engine.create(snapshot=snap.id)
    try:
        assert await _cat(engine, first.id, "/workspace/secret") == b"good"
        assert (await _cat(engine, first.id, "/workspace/mapped"))[:4] == b"gggg"
        # a sandbox restored from it writes the same files, through old descriptors too
        r = await engine.exec(first.id, "exec 3>>/workspace/secret; printf EVIL >&3; "
                                        "printf X >> /proc/self/fd/3; "
                                        "printf EVIL > /workspace/mapped")
        assert r.returncode == 0, r.stderr
        second = await engine.create(snapshot=snap.id)
        try:
            assert await _cat(engine, second.id, "/workspace/secret") == b"good"
            assert (await _cat(engine, second.id, "/workspace/mapped"))[:4] == b"gggg"
        finally:
            await engine.delete(second.id)
        await engine.verify_snapshot(snap.id)  # every layer re-read: its digest holds
    finally:
        await engine.delete(first.id)
        await engine.delete(sb.id)


def test_a_file_swapped_for_a_fifo_under_the_copy_does_not_hang_it(tmp_path):
    """The precopy runs while the sandbox does: it may replace a regular file by a
    FIFO between the copy's stat and its open. Opening a FIFO to read would wait for a
    writer forever; the copy must refuse it at once (the commit then copies frozen)."""
    src = tmp_path / "f"
    src.write_text("regular")
    st = os.lstat(src)
    src.unlink()
    os.mkfifo(src)
    start = time.monotonic()
    with pytest.raises(InternalError, match="changed"):
        copy_node(None, str(src), None, str(tmp_path / "copy"), st, CopyState(None), "")
    assert time.monotonic() - start < 30  # never blocked on the FIFO (a bound, not a timing)
    assert not (tmp_path / "copy").exists()


CHURN = ["sh", "-c", """
cd /workspace && mkdir -p a && head -c 3000000 /dev/zero > big
while true; do
  mv a b; mv b a
  rm -f f; mkfifo f; rm -f f; echo x > f
  ln -sf /etc/passwd big2; rm -f big2; head -c 2000000 /dev/zero > big2
done
"""]


@requires_root
@pytest.mark.root
async def test_a_tree_churning_under_the_commit_neither_breaks_nor_hangs_it(engine):
    """Directories renamed, files swapped for FIFOs and symlinks while the precopy
    reads: the commit still ends (precopy or whole frozen copy) and is one state."""
    sb = await engine.create(network="none")
    await engine.exec(sb.id, "echo kept > /workspace/kept")
    churn = await engine.spawn(sb.id, CHURN)
    try:
        await asyncio.sleep(0.2)
        snaps = [await asyncio.wait_for(engine.snapshot(sb.id), 120) for _ in range(3)]
    finally:
        await churn.kill()
    for snap in snaps:
        copy = await engine.create(snapshot=snap.id)
        try:
            r = await engine.exec(copy.id, "cat /workspace/kept; test -d /workspace/a "
                                           "|| test -d /workspace/b && echo dir")
            assert r.stdout == b"kept\ndir\n", r
            # never a host symlink followed: big2 is absent, a link, or zeros
            r = await engine.exec(copy.id, "test ! -e /workspace/big2 || test -L /workspace/big2"
                                           " || ! grep -q root /workspace/big2 && echo safe")
            assert r.stdout == b"safe\n", r
        finally:
            await engine.delete(copy.id)
    await engine.delete(sb.id)
