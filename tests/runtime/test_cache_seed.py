"""A local cluster's nodes get caches of their own, seeded from the host's by hard links
(runtime/cache_seed.py): pruning on one node cannot remove what another uses.

Two caches are seeded from the host's default cache, as two nodes' daemons do
(``--seed-cache``). A real engine on the second runs a sandbox from the built-in ``rl``
image (linked when first asked for). The first removes ``rl`` and ``python`` and prunes:
its own names go, while the second's sandbox keeps working, the second can still start
from ``rl``, and the host's cache is untouched.
"""

from __future__ import annotations

import os
import shutil
import tempfile
from pathlib import Path

import pytest

from corral.runtime import image_cache
from corral.runtime.cache_seed import seed_cache
from corral.runtime.image_pull import prune
from corral.runtime.images import ImageStore
from corral.runtime.paths import default_cache_dir
from tests.conftest import requires_root

pytestmark = [requires_root, pytest.mark.root, pytest.mark.timeout(300)]

HOST = default_cache_dir()


@pytest.fixture
def base():
    if not (HOST / "images" / "rl" / image_cache.MANIFEST).is_file():
        pytest.skip("the host is not prepared with the built-in rl image")
    d = Path(tempfile.mkdtemp(prefix="corral-seed-", dir=HOST.parent))
    if os.stat(d).st_dev != os.stat(HOST).st_dev:
        shutil.rmtree(d)
        pytest.skip("no directory beside the host's cache on its file system")
    os.chmod(d, 0o711)
    yield d
    shutil.rmtree(d, ignore_errors=True)


def _layers(images: Path) -> set[str]:
    return set(os.listdir(images / image_cache.LAYERS))


async def test_pruning_one_nodes_cache_leaves_what_another_uses(base):
    from corral.runtime.engine import Engine

    a, b = base / "a", base / "b"
    for cache in (a, b):
        assert "python" in seed_cache(HOST, cache, ["python"])
    assert not (a / "images" / "rl").exists()  # the others come when asked for
    host_rl = ImageStore(HOST / "images").get("rl")
    # the layers of what this test uses (other workers' builds add to the host's cache,
    # and collect what their rebuilds superseded, meanwhile: full run 21)
    host_layers = set(host_rl.layer_ids) | set(ImageStore(HOST / "images").get("python").layer_ids)

    engine = await Engine.open(base / "state-b", b, warm_slots=0)
    engine.images.seed_from = HOST / "images"
    try:
        sb = await engine.create(image="rl", memory_mb=256)
        first = await engine.exec(sb.id, ["python3", "-c", "import numpy; print(numpy.ones(3).sum())"])
        assert first.stdout.strip() == b"3.0", first

        # The first node links rl too, then removes both images and prunes its cache.
        a_store = ImageStore(a / "images", seed_from=HOST / "images")
        assert a_store.get("rl").layer_ids == host_rl.layer_ids
        mine = ImageStore(a / "images")  # no seeding: what is removed stays removed
        mine.remove("rl")
        mine.remove("python")
        prune(a / "images")  # (removing an image already collects its layers)
        assert not (set(host_rl.layer_ids) & _layers(a / "images"))

        again = await engine.exec(sb.id, ["python3", "-c", "import numpy; print(numpy.ones(3).sum())"])
        assert again.stdout.strip() == b"3.0", again
        second = await engine.create(image="rl", memory_mb=256)
        assert (await engine.exec(second.id, ["true"])).returncode == 0
    finally:
        await engine.close()
    # the host's cache lost none of them
    assert host_layers <= _layers(HOST / "images")
    assert ImageStore(HOST / "images").get("rl").digest == host_rl.digest
    assert os.access(HOST / "images" / "python" / "rootfs" / "usr" / "bin" / "python3", os.X_OK)
