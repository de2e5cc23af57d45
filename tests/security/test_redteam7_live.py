"""Red-team of live restores (issue 29): CRIU restores under a descriptor limit of up to
65536 (launchargs.RESTORE_NOFILE, above the numbers a busy daemon's agents hold); the
tasks it restores must come back under the sandbox's own ``open_files``, soft and hard,
or code in a fork would hold 64 times its descriptors (a way around a sandbox's limits
by forking itself)."""

from __future__ import annotations

import pytest

from corral.runtime import criu
from corral.runtime.paths import default_cache_dir
from tests.conftest import requires_root

LIMITS = ("for f in /proc/[0-9]*/limits; do grep 'Max open files' $f; done;"
          " python3 -c 'import resource as r; r.setrlimit(r.RLIMIT_NOFILE, (4096, 4096))'"
          " 2>/dev/null && echo raised; true")


@requires_root
@pytest.mark.root
async def test_restored_tasks_keep_the_sandboxs_descriptor_limit(engine):
    if criu.find(default_cache_dir()) is None:
        pytest.skip(f"no cached CRIU: {criu.BUILD}")
    sb = await engine.create(network="none", checkpointable=True, open_files=256)
    await engine.spawn(sb.id, ["sleep", "600"])
    (copy,) = await engine.fork(sb.id, 1, live=True)
    try:
        for sid in (sb.id, copy.id):
            r = await engine.exec(sid, ["sh", "-c", LIMITS])
            lines = r.stdout.decode().splitlines()
            assert "raised" not in lines, (sid, lines)
            assert len(lines) >= 3, lines  # the agent, sleep, sh at least
            for line in lines:
                soft, hard = line.split()[3:5]
                assert int(soft) <= 256 and int(hard) <= 256, (sid, line)
    finally:
        await engine.delete(copy.id)
        await engine.delete(sb.id)
