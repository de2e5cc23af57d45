"""How a sandbox's agent ended: waiting for its outer process (bwrap) to exit without a
thread or SIGCHLD handler, and telling a kill from the host (infrastructure) from the
sandbox's own doing when the agent hangs up unasked (:func:`eof_cause`).
"""

from __future__ import annotations

import asyncio
import os
import select
import signal
import subprocess

from corral.errors import CorralError
from corral.runtime.cgroups import Cgroup

EOF_SETTLE_S = 1.0
"""After the agent hangs up: how long to wait for the sandbox's outer process to exit,
to tell a kill from the host from the sandbox's own doing."""


async def wait_exit(proc: subprocess.Popen[bytes], init: int | None = None) -> None:
    """Wait for a child to exit without a thread or SIGCHLD handler: poll its pidfd.

    ``init``: a pidfd of :func:`namespace_init`'s; its process exiting ends the wait
    too (``proc`` is then not reaped: it exits soon after, see that function)."""
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

    fds = [pidfd] if init is None else [pidfd, init]
    for fd in fds:
        loop.add_reader(fd, exited)
    try:
        if proc.poll() is None:
            await fut
    finally:
        for fd in fds:
            loop.remove_reader(fd)
        os.close(pidfd)
    if init is None or not has_exited(init):
        proc.wait()


def namespace_init(proc: subprocess.Popen[bytes]) -> int | None:
    """A pidfd of ``proc``'s only child when that child is pid 1 of a pid namespace
    below ours (a sandbox's agent: bwrap ``--as-pid-1``), else None.

    When it has exited, so has every other process of its namespace: the kernel kills
    them and waits until they are reaped before the namespace's first process is
    counted as exited (``zap_pid_ns_processes``, before its pidfd is readable). So a
    delete knows the sandbox's processes are gone without waiting for bwrap, which
    then still reaps it, exits and unmounts the sandbox's tree (~40% of the wait at
    load ~50, all in the sandbox's CPU group)."""
    children = f"/proc/{proc.pid}/task/{proc.pid}/children"
    try:
        with open(children, "rb") as f:
            kids = f.read().split()
        if len(kids) != 1:
            return None
        fd = os.pidfd_open(int(kids[0]))
    except (OSError, ValueError):
        return None
    try:
        with open(f"/proc/{int(kids[0])}/status", "rb") as f:
            ns_pids = next((line.split()[1:] for line in f if line.startswith(b"NSpid:")), [])
        # then still proc's child: a child's pid is not reused before proc reaps it, so
        # the status read and the pidfd are of that child
        with open(children, "rb") as f:
            still = f.read().split() == kids
    except OSError:
        still = False
    if still and len(ns_pids) >= 2 and ns_pids[-1] == b"1":
        return fd
    os.close(fd)
    return None


def has_exited(pidfd: int) -> bool:
    """Whether the process of ``pidfd`` has exited (its pidfd is readable)."""
    poller = select.poll()
    poller.register(pidfd, select.POLLIN)
    return bool(poller.poll(0))


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
