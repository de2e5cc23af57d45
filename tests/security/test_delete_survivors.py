"""Attack: outlive a delete. The daemon's DELETE replies before its teardown ends
(cgroup, mounts and directories go in the background), so a process of the sandbox
that left its agent's process group and session, ignores SIGTERM/SIGHUP and forked
twice must still be dead when the reply comes."""

from __future__ import annotations

import os
import secrets
import time
from pathlib import Path

import pytest

import corral
from tests.conftest import requires_root

pytestmark = [requires_root, pytest.mark.root]


def running(marker: str) -> list[int]:
    """Host pids, not zombies, whose command line carries ``marker``."""
    return [int(e) for e in os.listdir("/proc") if e.isdecimal() and alive(int(e), marker)]


def alive(pid: int, marker: str) -> bool:
    try:
        cmdline = Path(f"/proc/{pid}/cmdline").read_bytes()
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except OSError:
        return False
    return marker.encode() in cmdline and state != "Z"


@pytest.fixture
def client(daemon):
    with corral.Client(daemon.url) as c:
        yield c


def test_no_process_outlives_the_delete_reply(client):
    marker = f"{600000 + secrets.randbelow(99999)}"  # sleep's argument: findable on the host
    escape = (
        "trap '' TERM HUP INT; "
        f"setsid sh -c \"trap '' TERM HUP INT; (setsid sleep {marker} &) ; sleep {marker}\" "
        ">/dev/null 2>&1 < /dev/null &"
    )
    for _ in range(3):
        sb = corral.Sandbox.create(memory_mb=128, client=client)
        sb.exec(["sh", "-c", escape])
        sb.spawn(["sh", "-c", f"trap '' TERM HUP; exec sleep {marker}"])
        deadline = time.monotonic() + 30  # the spawn answers before its sleep has exec'd
        while len(pids := running(marker)) < 3 and time.monotonic() < deadline:
            time.sleep(0.01)
        assert len(pids) >= 3, "the escapes did not start"
        sb.delete()
        # its own pids, looked at right away (a scan of /proc would give them time)
        assert [p for p in pids if alive(p, marker)] == [], "a deleted sandbox's process runs"
        with pytest.raises(corral.SandboxNotFound):
            corral.Sandbox.connect(sb.id, client=client)
