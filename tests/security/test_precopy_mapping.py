"""Red team of the precopy commit (corral.runtime.precopy): a shared writable mapping
made before the commit, written through while the precopy copies, and removed before
the freeze.

Writes through a mapping whose pages are already mapped change no timestamp, so the
delta cannot see them; the freeze's look at the mappings finds none (removed). Before,
the snapshot then kept the bytes the precopy read, not those the sandbox had when it
was frozen. Now a mapping there as the commit begins makes it copy frozen at once.
The attacker is told to write and unmap when the precopy has copied (a hook on the
store's stage, the precopy's only), so the race is won every time it can be.
"""

from __future__ import annotations

import asyncio
import threading

import pytest

from tests.conftest import requires_root

pytestmark = [requires_root, pytest.mark.root]

ATTACKER = """
import mmap, os, sys
fd = os.open('/workspace/mapped', os.O_RDWR)
m = mmap.mmap(fd, 4096)
os.close(fd)
m[:4] = b'gggg'  # the page is mapped and written: later writes fault no more
print('ready', flush=True)
sys.stdin.readline()
m[:4] = b'EVIL'
m.close()
print('done', flush=True)
sys.stdin.readline()
"""


async def test_a_mapping_unmapped_before_the_freeze_never_hides_its_writes(engine):
    sb = await engine.create(network="none")
    await engine.exec(sb.id, "head -c 4096 /dev/zero | tr '\\0' g > /workspace/mapped")
    attacker = await engine.spawn(sb.id, ["python3", "-u", "-c", ATTACKER])
    assert await asyncio.wait_for(attacker.readline(), 30) == b"ready\n"
    store = engine.snapshots.store
    stage = store.stage
    precopied, attacked = threading.Event(), threading.Event()

    def hooked(upper, **kw):  # in the commit's thread
        tmp = stage(upper, **kw)
        if kw.get("record") is not None:  # the precopy, the sandbox running
            precopied.set()
            attacked.wait(30)
        return tmp

    store.stage = hooked
    try:
        commit = asyncio.ensure_future(engine.snapshot(sb.id))
        while not precopied.is_set() and not commit.done():
            await asyncio.sleep(0.01)
        if precopied.is_set():  # the precopy ran: the attack, before the freeze
            await attacker.write(b"go\n")
            assert await asyncio.wait_for(attacker.readline(), 30) == b"done\n"
            attacked.set()
        snap = await asyncio.wait_for(commit, 60)
    finally:
        store.stage = stage
        attacked.set()
    frozen = b"EVIL" if precopied.is_set() else b"gggg"  # what it had at the freeze
    copy = await engine.create(snapshot=snap.id)
    try:
        r = await engine.exec(copy.id, ["head", "-c", "4", "/workspace/mapped"])
        assert r.stdout == frozen, "the snapshot is not the sandbox as it was frozen"
    finally:
        await attacker.write(b"\n")
        await engine.delete(copy.id)
        await engine.delete(sb.id)
