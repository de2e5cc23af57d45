"""Red-team of live restores (issue 29) and of the quota volumes share with them.

- CRIU restores under a descriptor limit of up to 65536 (launchargs.RESTORE_NOFILE,
  above the numbers a busy daemon's agents hold); the tasks it restores must come back
  under the sandbox's own ``open_files``, soft and hard, or code in a fork would hold
  64 times its descriptors (a way around a sandbox's limits by forking itself);
- a volume being published counts in its tenant's other quota checks (checkpoints,
  snapshots, kept files), so the two cannot both pass the quota."""

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


@requires_root
@pytest.mark.root
async def test_a_volume_being_published_counts_in_the_tenants_other_quota_checks(engine,
                                                                                   tmp_path):
    """A tenant's volumes, snapshots, checkpoints and kept files share its quota. A
    capped volume passed its check, then made its image (tens of ms to seconds) before
    it was published: a checkpoint weighed meanwhile did not count it, and both landed
    past the quota. While its image is made it is counted now."""
    import asyncio
    import io
    import tarfile
    import threading

    from corral.errors import QuotaExceeded

    engine.snapshots.quota_of = lambda owner: 20 << 20 if owner == "hana" else None
    archive = tmp_path / "a.tar"
    with tarfile.open(archive, "w") as t:
        info = tarfile.TarInfo("README")
        info.size = 3
        t.addfile(info, io.BytesIO(b"hi\n"))
    root = engine.volumes.owner_root("hana")
    seen: list[bool] = []  # per check made while the volume's image was being made
    done = threading.Event()

    def race() -> None:
        while not done.is_set() and len(seen) < 50:
            if any(root.glob(".v.*/volume.img")):  # past its check, not published yet
                try:
                    engine.snapshots.check_quota("hana", {"layer": 12 << 20})
                    seen.append(True)
                except QuotaExceeded:
                    seen.append(False)

    watcher = threading.Thread(target=race)
    watcher.start()
    try:
        await engine.create_volume("v", archive, max_mb=12, owner="hana")
    finally:
        done.set()
        await asyncio.to_thread(watcher.join)
    try:
        assert seen, "no check fell while the image was made (it was too fast to see)"
        assert not any(seen), f"{seen.count(True)} checks passed 12 + 12 MiB of 20"
    finally:
        await engine.remove_volume("v", owner="hana")
