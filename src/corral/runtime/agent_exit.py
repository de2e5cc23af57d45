"""How a sandbox's agent ended: waiting for its outer process (bwrap) to exit without a
thread or SIGCHLD handler, and telling a kill from the host (infrastructure) from the
sandbox's own doing when the agent hangs up unasked (:func:`eof_cause`).
"""

from __future__ import annotations

import asyncio
import os
import signal
import subprocess

from corral.errors import CorralError
from corral.runtime.cgroups import Cgroup

EOF_SETTLE_S = 1.0
"""After the agent hangs up: how long to wait for the sandbox's outer process to exit,
to tell a kill from the host from the sandbox's own doing."""


async def wait_exit(proc: subprocess.Popen[bytes]) -> None:
    """Wait for a child to exit without a thread or SIGCHLD handler: poll its pidfd."""
    if proc.poll() is not None:
        return  # reaped already: its pid may belong to another process by now
    loop = asyncio.get_running_loop()
    try:
        pidfd = os.pidfd_open(proc.pid)
    except ProcessLookupError:
        proc.wait()
        return
    fut: asyncio.Future[None] = loop.create_future()

    def exited() -> None:
        if not fut.done():
            fut.set_result(None)

    loop.add_reader(pidfd, exited)
    try:
        if proc.poll() is None:
            await fut
    finally:
        loop.remove_reader(pidfd)
        os.close(pidfd)
    proc.wait()


async def eof_cause(
    proc: subprocess.Popen[bytes] | None, cgroup: Cgroup | None
) -> tuple[bool, str]:
    """Why an agent hung up that the engine did not ask to: (infrastructure?, reason).

    The agent exits only when the engine closes its socket, and nothing inside the
    sandbox can signal its outer process (bwrap, outside the sandbox's pid namespace).
    So only that outer process dying of a signal (and not of the sandbox's own OOM) is
    a kill from the host: infrastructure. Everything else (the agent exiting, whatever
    its status says, as a hijacked agent can exit with any status; the agent's socket
    shut down while it runs; its death by the OOM killer of the sandbox's own cgroup)
    is the sandbox's doing.
    """
    if proc is not None:
        try:
            await asyncio.wait_for(wait_exit(proc), EOF_SETTLE_S)
        except asyncio.TimeoutError:
            pass
    status = proc.poll() if proc is not None else None
    try:
        oom = cgroup is not None and cgroup.oom_kills() > 0
    except (OSError, CorralError):
        oom = False
    if oom:
        return False, (
            "its agent exited unexpectedly after the kernel's OOM killer fired in it: "
            "the sandbox's code ran it out of memory (raise memory_mb)"
        )
    if status is not None and status < 0 and -status != signal.SIGPIPE:
        return True, (
            "the sandbox's agent exited unexpectedly: its processes were killed from "
            f"outside the sandbox ({_signal_name(-status)})"
        )
    if status is None:
        return False, "its agent hung up on the engine while the sandbox still ran"
    return False, f"its agent exited unexpectedly on its own (status {status}) without being asked to"


def _signal_name(signum: int) -> str:
    try:
        return signal.Signals(signum).name
    except ValueError:
        return f"signal {signum}"
