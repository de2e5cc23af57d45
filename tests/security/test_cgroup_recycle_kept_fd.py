"""A recycled cgroup's kept OOM-counter descriptor (runtime/cgroups.py ``_oom_text``).

The OOM-kill count is read through a descriptor a :class:`Cgroup` opens once and keeps.
On cgroup v1 an ended sandbox's emptied group is renamed and given to a later warm
slot (runtime/cgroup_recycle.py), so that nothing still naming the old group reaches
the next sandbox. A descriptor follows the rename: the ended sandbox A's object, still
held by whatever was finishing A (an agent's hang-up being explained, a late command's
result), read the next sandbox C's OOM kills as A's own (A's end blamed on memory C
ran out of: another tenant's sandbox deciding A's reason). Now a group handed on
answers its old holder as a removed one does (a :class:`CgroupError`).
"""

from __future__ import annotations

import pytest

from tests.conftest import requires_root
from tests.security.test_cgroup_recycle import _inode, _successor, one_slot_engine  # noqa: F401

HOG = "b = bytearray(400 << 20); b[::4096] = b'x' * len(b[::4096])"


@requires_root
async def test_an_ended_sandboxs_kept_descriptor_reads_nothing_of_its_groups_next_sandbox(
        one_slot_engine):  # noqa: F811
    from corral.runtime.cgroup_files import CgroupError

    engine = one_slot_engine
    a = await engine.create(memory_mb=64)
    group_a = engine.cgroup(a.id)
    r = await engine.exec(a.id, ["true"])  # (reads the count: the descriptor is opened)
    assert r.returncode == 0 and not r.oom_killed, r
    assert group_a._oom_fd >= 0
    c = await _successor(engine, a.id, _inode(group_a), memory_mb=64)
    try:
        r = await engine.exec(c, ["python3", "-c", HOG], timeout=60)
        assert r.oom_killed, r
        assert engine.cgroup(c).oom_kills() >= 1
        try:
            kills = group_a.oom_kills()
        except CgroupError:
            kills = 0  # gone, as a removed group's
        assert kills == 0, "the ended sandbox read its group's next sandbox's OOM kills"
    finally:
        await engine.delete(c)


def test_a_group_not_handed_on_still_reads_through_its_descriptor(tmp_path):
    """The guard costs nothing to a group that was never renamed: a file standing in
    for the counter is read through its kept descriptor, fresh each time."""
    from corral.runtime.cgroups import CgroupV1

    memory = tmp_path / "memory"
    memory.mkdir()
    (memory / "memory.oom_control").write_text("oom_kill_disable 0\nunder_oom 0\noom_kill 0\n")
    group = CgroupV1("corral/x", {"memory": memory})
    assert group.oom_kills() == 0
    (memory / "memory.oom_control").write_text("oom_kill_disable 0\nunder_oom 0\noom_kill 2\n")
    assert group.oom_kills() == 2
    group.handed_on = True
    with pytest.raises(Exception, match="another sandbox"):
        group.oom_kills()
