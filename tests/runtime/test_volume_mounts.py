"""A volume's filesystem (``max_mb``: an ext4 image on a loop device) is mounted while
an engine may use it and unmounted when the engine closes with its sandboxes: a loop
mount left behind outlived its state dir (a deleted test daemon's), and every later
sandbox on the host copied it into its mount table."""

from __future__ import annotations

import io
import os
import tarfile

from corral.runtime.engine import Engine
from tests.conftest import requires_root

pytestmark = [requires_root]


async def test_a_volume_filesystem_is_unmounted_when_the_engine_closes_and_mounted_again(
    state_dir, tmp_path
):
    archive = tmp_path / "a.tar"
    with tarfile.open(archive, "w") as t:
        info = tarfile.TarInfo("hello")
        info.size = 3
        t.addfile(info, io.BytesIO(b"hi\n"))
    data = state_dir / "volumes"
    engine = await Engine.open(state_dir)
    try:
        await engine.create_volume("v", archive, max_mb=8)
        sid = (await engine.create({"volumes": {"/d": "v:rw"}})).id
        r = await engine.exec(sid, "cat /d/hello && echo more > /d/written")
        assert r.returncode == 0, r.stderr
        mounted = [p for p in data.glob("*/v/data") if os.path.ismount(p)]
        assert len(mounted) == 1, list(data.glob("*/v/data"))
    finally:
        await engine.close()
    assert mounted[0].is_dir() and not os.path.ismount(mounted[0])
    # the next engine on the state dir mounts it again on first use, with what was written
    engine = await Engine.open(state_dir)
    try:
        sid = (await engine.create({"volumes": {"/d": "v:ro"}})).id
        r = await engine.exec(sid, "cat /d/hello /d/written")
        assert (r.returncode, r.stdout) == (0, b"hi\nmore\n"), r.stderr
        assert os.path.ismount(mounted[0])
        await engine.delete(sid)
        await engine.remove_volume("v")
    finally:
        await engine.close()
    assert not os.path.ismount(mounted[0])
