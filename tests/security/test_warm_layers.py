"""Warm slots clone and idmap their likely layers ahead of time (``agent/launch.c``,
``premake_lowers``): the attack is a sandbox getting a tree that is no longer what its
image names — an image replaced (``add_rootfs(replace=True)``: the same path, a new
directory) after a slot cloned the old one. A clone is used only for the very
directory its path names at launch (same device and inode); else the layer is cloned
again. A private cache: the test replaces an image of its own.
"""

from __future__ import annotations

import asyncio
import shutil
import tempfile
from pathlib import Path

import pytest

from tests.conftest import requires_root

pytestmark = requires_root


def _tree(path: Path, marker: str) -> Path:
    (path / "etc").mkdir(parents=True)
    (path / "etc/os-release").write_text("ID=test\n")
    (path / "marker").write_text(marker)
    return path


@pytest.fixture
async def private_engine(state_dir):
    from corral.runtime.engine import Engine

    cache = Path(tempfile.mkdtemp(prefix="corral-test-cache-"))
    eng = await Engine.open(state_dir, cache, warm_slots=1)
    try:
        yield eng
    finally:
        await eng.close()
        shutil.rmtree(cache, ignore_errors=True)


async def _slot_with(engine, layers: str) -> None:
    """Wait until the (one) warm slot is one that cloned ``layers`` while it waited: a
    slot is made with the guess of when it was made, so one more sandbox is started
    (and deleted) while the slot waiting is an older one."""
    for _ in range(3):
        for _ in range(600):
            if engine._pool._ready:
                break
            await asyncio.sleep(0.05)
        if engine._pool._ready and engine._pool._ready[0].prelower == layers:
            return
        await engine.delete((await engine.create(image="tiny")).id)
    raise AssertionError("the warm slot was never remade with the new guess")


async def test_a_replaced_image_is_never_served_from_a_clone_made_before(private_engine, tmp_path):
    eng = private_engine
    eng.images.add_rootfs("tiny", _tree(tmp_path / "one", "one"))
    sid = (await eng.create(image="tiny")).id
    assert await eng.read_file(sid, "/marker") == b"one"
    await eng.delete(sid)
    layers = eng._pool.prelower
    assert str(eng.images.get("tiny").rootfs) in layers.split(":")
    await _slot_with(eng, layers)  # it holds a clone of "one"'s tree now
    eng.images.add_rootfs("tiny", _tree(tmp_path / "two", "two"), replace=True)
    sid = (await eng.create(image="tiny")).id
    assert await eng.read_file(sid, "/marker") == b"two"
    await eng.delete(sid)
    # and the clone made ahead is used when it is the directory's (a control: the same
    # image again, slots made after the replacement)
    await _slot_with(eng, eng._pool.prelower)
    sid = (await eng.create(image="tiny")).id
    assert await eng.read_file(sid, "/marker") == b"two"
    await eng.delete(sid)
