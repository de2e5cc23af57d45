"""The mount table bwrap starts from holds only what bwrap and its sandbox use.

The launcher's private mount namespace is a copy of the host's; before it becomes bwrap
it detaches every host mount that neither leads to nor lies under a path bwrap is given
(``agent/prune.c``): bwrap copies that table again, reads all of it at each bind and
the sandbox's end tears it down. Here a host mount unrelated to the sandbox (a tmpfs in
a private directory, as another sandbox's volume or a loop mount would be) and /sys's
cgroup hierarchies must be gone from bwrap's table, what the sandbox needs must be
there, the sandbox must work, and the host's own table must be untouched (the launcher
made its mounts private first: nothing it detaches propagates).
"""

from __future__ import annotations

import subprocess
import tempfile
from pathlib import Path

import pytest

from tests.conftest import requires_root

pytestmark = [requires_root, pytest.mark.root]


def _points(mountinfo: str) -> list[str]:
    return [line.split()[4] for line in mountinfo.splitlines()]


@pytest.fixture
def host_mount():
    point = Path(tempfile.mkdtemp(prefix="corral-test-unrelated-"))
    subprocess.run(["mount", "-t", "tmpfs", "-o", "size=1m", "corral-test", str(point)], check=True)
    try:
        yield str(point)
    finally:
        subprocess.run(["umount", "-l", str(point)], check=False)
        point.rmdir()


async def test_bwrap_starts_from_a_table_without_the_hosts_unused_mounts(engine, host_mount):
    info = await engine.create()
    try:
        bwrap = engine._live[info.id].proc.pid  # bwrap's outer process: the launcher's table
        points = _points(Path(f"/proc/{bwrap}/mountinfo").read_text())
        assert host_mount not in points
        assert not [p for p in points if p == "/sys" or p.startswith("/sys/")], points
        sandbox_dir = str(engine._live[info.id].sandbox_dir)
        for needed in ("/", "/proc", "/dev", f"{sandbox_dir}/root", f"{sandbox_dir}/rw"):
            assert needed in points, (needed, points)
        # the host still has every mount it had
        host = _points(Path("/proc/self/mountinfo").read_text())
        assert host_mount in host and "/sys" in host
        r = await engine.exec(info.id, ["sh", "-c", "ls /dev/null /proc/self/status && echo ok"])
        assert r.returncode == 0 and r.stdout.endswith(b"ok\n"), r
    finally:
        await engine.delete(info.id)
