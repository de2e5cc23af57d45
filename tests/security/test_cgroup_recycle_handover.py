"""A recycled cgroup after a live restore: the last sandbox's OOM kills must not be the
next one's.

On cgroup v1 an ended sandbox's emptied group is given to a later warm slot
(runtime/cgroup_recycle.py). The kernel's OOM-kill count (``memory.oom_control``)
cannot be reset, so a recycled group counted from a baseline kept on the engine's
:class:`Cgroup` object only. An engine that took the sandboxes over (a daemon
restarted with ``handover``) opens each group afresh, with no baseline: sandbox A
(one tenant) runs out of memory and is deleted, sandbox C (another tenant) gets A's
group, and after the restart C's group says the OOM killer fired in it, so C's
agent killed from outside (infrastructure: the RL runner retries it) is reported as
C's own fault ("the sandbox's code ran it out of memory": scored as the policy's).
"""

from __future__ import annotations

import asyncio
import os
import signal

import pytest

from tests.conftest import requires_root

WAIT_S = 60.0


async def _until(pred, what: str):
    for _ in range(int(WAIT_S / 0.05)):
        if found := pred():
            return found
        await asyncio.sleep(0.05)
    raise AssertionError(f"{what} within {WAIT_S} s")


def _raw_oom_kills(group) -> int:
    for line in (group._dirs["memory"] / "memory.oom_control").read_text().splitlines():
        if line.startswith("oom_kill "):
            return int(line.split()[1])
    return 0


@requires_root
async def test_an_oom_kill_of_the_last_sandbox_is_not_the_next_ones_after_a_handover(state_dir):
    from corral.runtime.cgroups import detect
    from corral.runtime.engine import Engine
    from tests.conftest import have_root_runtime

    if not have_root_runtime():
        pytest.skip("needs root")
    if detect().version != 1:
        pytest.skip("groups are recycled on cgroup v1 only (v2: always removed)")
    first = await Engine.open(state_dir, warm_slots=1, restore_grace=60)
    later: list[str] = []
    try:
        a = await first.create(memory_mb=64)
        group_a = first.cgroup(a.id)
        r = await first.exec(a.id, ["python3", "-c",
                                    "b = bytearray(400 << 20); b[::4096] = b'x' * len(b[::4096])"],
                             timeout=60)
        assert r.oom_killed, r
        assert _raw_oom_kills(group_a) >= 1
        await first.delete(a.id)
        await _until(lambda: not group_a._dirs["memory"].exists(),  # (renamed or removed)
                     "the ended sandbox's group was not released")
        for _ in range(3):  # the ready slot first, then one made on a spare group if any
            later.append((await first.create(memory_mb=64)).id)
        # the root property: no later sandbox runs in a group the OOM killer fired in
        kills = {sid: _raw_oom_kills(first.cgroup(sid)) for sid in later}
        assert not any(kills.values()), kills
    finally:
        await first.close(handover=True)

    second = await Engine.open(state_dir, warm_slots=0, restore_grace=60)
    try:
        for sid in later:
            assert second.get(sid).state.value == "running"
            assert second.cgroup(sid).oom_kills() == 0, sid
        # the consequence: an agent killed from outside is blamed on the sandbox's memory
        c = max(later, key=kills.__getitem__)  # (the one in A's group, if any)
        for pid in second.cgroup(c).pids():
            os.kill(pid, signal.SIGKILL)
        ended = await _until(lambda: (i := second.get(c)).state.value != "running" and i,
                             "the killed sandbox did not end")
        assert "OOM" not in (ended.reason or ""), ended.reason
    finally:
        await second.close()
