"""Red team: CRIU's kernel-probe cache (``STATE/checkpoints/.kerndat``, kept from the
first restore per boot and CRIU build, then given to every restore on the host, every
tenant's: runtime/checkpoint.py ``keep_kdat``). It was copied from the restore's ``/run``
as soon as the restored agent answered, before its processes were checked for
confinement: the probes of a restore that is then refused (a forged checkpoint whose
processes are not confined, which may have written there) were kept for everyone.
Now they are kept only once every restored process was found confined.

No forged image is known that CRIU restores and the check then refuses (the forges of
test_live_checkpoint.py restore confined or fail in CRIU), so the check is made to
refuse: a process found unconfined, as for such an image."""

from __future__ import annotations

import pytest

from corral.errors import CorralError, InvalidState
from corral.runtime import checkpoint, criu, live_images
from corral.runtime.paths import default_cache_dir
from tests.conftest import requires_root
from tests.security.test_live_checkpoint import _need_criu

pytestmark = [requires_root, pytest.mark.root, pytest.mark.timeout(300)]


async def test_a_refused_restore_leaves_no_kernel_probes_for_others(engine, monkeypatch):
    _need_criu()
    cache = checkpoint.kdat_cache(engine.layout.state_dir, criu.require(default_cache_dir()))
    sb = await engine.create(network="none", checkpointable=True)
    snap = await engine.checkpoint(sb.id)
    cache.unlink(missing_ok=True)  # the next restore is the one to keep them

    def unconfined(pids, *, outer, uid, nofile, **_):
        raise InvalidState("pid 1 is not confined", details={"pid": 1})

    try:
        with monkeypatch.context() as m:
            m.setattr(live_images, "check_restored", unconfined)
            with pytest.raises(CorralError):
                await engine.create(snapshot=snap.id)
        assert not cache.exists(), "a refused restore's kernel probes were kept"
        copy = await engine.create(snapshot=snap.id)  # a confined one keeps them
        await engine.delete(copy.id)
        assert cache.exists()
    finally:
        await engine.delete(sb.id)
        await engine.delete_snapshot(snap.id)
