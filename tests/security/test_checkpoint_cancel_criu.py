"""Attack: a checkpoint cancelled while CRIU dumps (a client that hangs up, again and
again).

``_run_dump`` killed CRIU only past its own timeout: a cancel left it running, as the
sandbox's host uid with the daemon's capabilities, while the engine thawed the sandbox,
removed the images directory CRIU was writing into, let the sandbox go (a delete could
give its uid to the next sandbox with that CRIU still alive) and moved on. CRIU, still
holding the sandbox's tasks, went on dumping into whatever it could, then left the
freezer as it had found it (frozen). Now a cancel kills CRIU and waits for it before
the checkpoint lets go of anything.
"""

from __future__ import annotations

import asyncio
import os
from pathlib import Path

import pytest

from corral.runtime import criu
from corral.runtime.paths import default_cache_dir
from tests.conftest import requires_root

pytestmark = [requires_root, pytest.mark.root]

BALLAST = ("nohup python3 -c 'import time\nb = bytearray(96 << 20)\nwhile True: "
           "time.sleep(1)' >/dev/null 2>&1 &")
PATIENCE_S = 60  # a bound on the polls below, never a measure


def _criu_children() -> list[int]:
    """CRIU dumps this process started (directly, or through setpriv)."""
    me, found = os.getpid(), []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            stat = (entry / "stat").read_text()
            cmdline = (entry / "cmdline").read_bytes().split(b"\0")
        except OSError:
            continue
        ppid = int(stat[stat.rindex(")") + 2:].split()[1])
        if b"dump" in cmdline and any(a.endswith(b"criu") for a in cmdline) and ppid == me:
            found.append(int(entry.name))
    return found


async def test_a_cancelled_checkpoint_leaves_no_criu_running(engine):
    if criu.find(default_cache_dir()) is None:
        pytest.skip(f"no cached CRIU: {criu.BUILD}")
    sb = await engine.create(network="none", checkpointable=True, memory_mb=512)
    try:
        await engine.exec(sb.id, ["sh", "-c", BALLAST])
        live = engine._get_live(sb.id)
        task = asyncio.create_task(engine.checkpoint(sb.id))
        loop = asyncio.get_running_loop()
        end = loop.time() + PATIENCE_S
        while not _criu_children() and not task.done() and loop.time() < end:
            await asyncio.sleep(0.005)
        if task.done():
            pytest.skip("the dump ended before it could be cancelled")
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        assert _criu_children() == [], "CRIU runs on past its cancelled checkpoint"
        assert not live.cgroup.frozen()
        r = await engine.exec(sb.id, ["true"], timeout=PATIENCE_S)  # it runs on
        assert r.returncode == 0
    finally:
        await engine.delete(sb.id)
