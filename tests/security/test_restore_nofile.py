"""Red team: the open files limit of a restored sandbox's processes.

CRIU restores each process with the limits its images name, up to its own, and the
launcher raises CRIU's open files limit for the restore (up to the daemon's hard
limit: runtime/launchargs.py). A copy restored with a lower ``open_files`` than the
sandbox it was taken of kept the checkpoint's (a copy made with 64 had 1024); forged
images could name any number up to the daemon's. Now every restored process is
lowered to the new sandbox's own limit before any runs again (CRIU's pre-resume
action, runtime/live_images.py), and a restored process above it fails the restore
as forged images do.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from corral.errors import CorralError, Unsupported
from corral.runtime import live_images
from tests.conftest import requires_root
from tests.security.test_live_checkpoint import _need_criu

pytestmark = [requires_root, pytest.mark.root, pytest.mark.timeout(180)]

BACKGROUND = "nohup sleep 600 >/dev/null 2>&1 & echo $! > /tmp/bg"
LIMITS = ("for p in 1 $(cat /tmp/bg) self; do grep 'open files' /proc/$p/limits; done; "
          "ulimit -Sn; ulimit -Hn")


def _host_limits(engine, sid: str) -> dict[int, tuple[int, int]]:
    """Soft and hard open files limits of each process of the sandbox (its outer
    launcher left out), read on the host."""
    live = engine._get_live(sid)
    found = {}
    for pid in live.cgroup.pids():
        if pid == live.proc.pid:
            continue
        try:
            text = Path(f"/proc/{pid}/limits").read_text()
        except OSError:
            continue
        line = next(ln for ln in text.splitlines() if ln.startswith("Max open files"))
        found[pid] = (int(line.split()[3]), int(line.split()[4]))
    return found


async def test_restored_processes_get_the_new_sandboxs_open_files_limit(engine, monkeypatch):
    _need_criu()
    sb = await engine.create(network="none", checkpointable=True, open_files=1024)
    try:
        await engine.exec(sb.id, ["sh", "-c", BACKGROUND])
        assert (await engine.exec(sb.id, ["sh", "-c", "ulimit -Hn"])).stdout == b"1024\n"
        snap = await engine.checkpoint(sb.id)
        copy = await engine.create(snapshot=snap.id, open_files=64)
        assert engine.get(copy.id).spec.open_files == 64
        seen = _host_limits(engine, copy.id)
        assert len(seen) >= 2 and set(seen.values()) == {(64, 64)}, seen  # before: 1024
        out = (await engine.exec(copy.id, ["sh", "-c", LIMITS])).stdout.decode().split("\n")
        assert [ln.split()[3:5] for ln in out[:3]] == [["64", "64"]] * 3, out
        assert out[3:5] == ["64", "64"], out  # a new command's, from the restored agent
        await engine.delete(copy.id)
        # the restore's own lowering undone: a process above the limit fails it, typed
        monkeypatch.setattr(live_images, "_ACTION_SCRIPT",
                            live_images._ACTION_SCRIPT.replace("pre-resume) ;;", ""))
        with pytest.raises(CorralError) as err:
            await engine.create(snapshot=snap.id, open_files=64)
        assert "open files limit" in err.value.message
        assert [s.id for s in engine.list() if s.state.value == "running"] == [sb.id]
        # a limit at or above the checkpoint's keeps the processes' own
        copy = await engine.create(snapshot=snap.id, open_files=4096)
        assert set(_host_limits(engine, copy.id).values()) == {(1024, 1024)}
        await engine.delete(copy.id)
        await engine.delete_snapshot(snap.id)
    finally:
        await engine.delete(sb.id)


async def test_a_limit_the_host_cannot_lower_is_a_typed_error_saying_what_to_do(engine, monkeypatch):
    """Where prlimit is refused (a host whose root lacks CAP_SYS_RESOURCE; here the
    action script's prlimit runs as nobody, refused the same way, EPERM), the copy is
    ended as before, but the error says so and what to do, not "forged images"."""
    _need_criu()
    sb = await engine.create(network="none", checkpointable=True, open_files=1024)
    try:
        await engine.exec(sb.id, ["sh", "-c", BACKGROUND])
        snap = await engine.checkpoint(sb.id)
        monkeypatch.setattr(live_images, "_ACTION_SCRIPT", live_images._ACTION_SCRIPT.replace(
            'prlimit --pid', 'setpriv --reuid=65534 --regid=65534 --clear-groups prlimit --pid'))
        with pytest.raises(Unsupported) as err:
            await engine.create(snapshot=snap.id, open_files=64)
        assert err.value.details["cause"] == "open_files_not_lowered"
        assert err.value.details["checkpoint_open_files"] == 1024
        assert "open_files at least 1024" in err.value.message
        assert "CAP_SYS_RESOURCE" in err.value.message and "forged" not in err.value.message
        assert [s.id for s in engine.list() if s.state.value == "running"] == [sb.id]
        # at or above the checkpoint's limit there is nothing to lower: it restores
        copy = await engine.create(snapshot=snap.id, open_files=1024)
        assert (await engine.exec(copy.id, ["sh", "-c", "ulimit -Hn"])).stdout == b"1024\n"
        await engine.delete(copy.id)
        await engine.delete_snapshot(snap.id)
    finally:
        await engine.delete(sb.id)
