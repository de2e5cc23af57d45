"""Kill every process a sandbox's code started, keeping the sandbox.

The agent (pid 1 inside) and bwrap (its parent, outside) stay; everything else in the
sandbox's cgroup is sandbox code: the commands, spawned processes and whatever they
left running in the background. Used before grading, so that nothing an earlier step
started can reach the judge while it starts (docs/grading.md).

Done from the host, through the cgroup, never by a process inside: a process of the
sandbox's uid is exposed to the others between its exec and making itself
non-dumpable, so only the engine can do this without a window.
"""

from __future__ import annotations

import os
import signal
import time
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from corral.runtime.cgroups import Cgroup

WAIT_S = 5.0


def _children(pid: int) -> set[int]:
    try:
        with open(f"/proc/{pid}/task/{pid}/children") as f:
            return {int(p) for p in f.read().split()}
    except (OSError, ValueError):
        return set()


def _gone(pid: int) -> bool:
    """Exited (a zombie counts: it runs nothing and holds no descriptor)."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            state = f.read().rsplit(b")", 1)[1].split()[0]
    except (OSError, IndexError):
        return True
    return state in (b"Z", b"X")


def kill_sandbox_code(cgroup: Cgroup, bwrap_pid: int) -> int:
    """SIGKILL every process of the cgroup but bwrap and the agent; wait until they
    are gone. Returns how many there were. The group is frozen while its members are
    read, so none can fork past the sweep."""
    keep = {bwrap_pid} | _children(bwrap_pid)
    try:
        try:
            cgroup.freeze()
        except Exception:  # noqa: BLE001 - a task stuck in D state: sweep what we can
            pass
        victims = [p for p in cgroup.pids() if p not in keep]
        for pid in victims:
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
    finally:
        # Always: a freeze that timed out leaves the group FREEZING (the agent frozen
        # with the rest); cgroup v1's frozen tasks also act on SIGKILL only once thawed.
        cgroup.thaw()
    deadline = time.monotonic() + WAIT_S
    left = [p for p in victims if not _gone(p)]
    while left and time.monotonic() < deadline:
        time.sleep(0.002)
        left = [p for p in left if not _gone(p)]
    # Anything that slipped in (joined only some hierarchies) gets one more round.
    late = [p for p in cgroup.pids() if p not in keep and not _gone(p)]
    for pid in late:
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
    return len(victims) + len(late)
