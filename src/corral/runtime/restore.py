"""Live restore: the sandboxes of an engine that went away, adopted by the next one.

A daemon restart (an upgrade, ``corral daemon restart``, ``systemctl restart``, a
crash and ``kill -9`` included) does not end its sandboxes. How:

- Each sandbox's agent holds, besides its control socket, a *reattach socket*: one
  end of a ``SOCK_SEQPACKET`` pair made by the engine (:mod:`.launcher`), whose other
  end the engine's warden keeps (:mod:`.warden`). When the control socket closes the
  agent does not exit: it detaches (its commands run on, forgotten by request id) and
  waits on the reattach socket for a new control socket (``agent/agent.c``).
- The warden outlives its engine. For ``grace`` seconds it offers, on
  ``<state_dir>/handover.sock`` (a root-only socket in a root-only directory, and
  the peer checked to be root), the engine's lock, its uid block and every sandbox's
  reattach socket and log pipe to the next engine (:func:`take_over`).
- The new engine (:func:`adopt`) checks each sandbox the registry says is running or
  paused against what it was handed and what runs (its outer process, by pid *and*
  start time, and its cgroup), gives its agent a fresh control socket over the
  reattach socket, and waits for its READY; the sandbox keeps its id, spec, files,
  processes, lifetime (``started_at`` is in the registry: its timeout fires when it
  would have) and pause. A sandbox frozen mid-snapshot is thawed. Anything else the
  registry thought alive is lost, as before (:mod:`.reconcile`).

Who can reattach an agent: only a holder of the other end of its reattach socket, a
descriptor that never exists inside the sandbox (the agent is not dumpable, its
descriptors are close-on-exec, and it takes a new control socket only as an
``SCM_RIGHTS`` message on that socket). Sandbox code cannot reach the handover socket
(its path is in the daemon's state directory, outside every sandbox's mount
namespace), and a process that is not root is refused by the warden.

Not kept across a restart: commands and interactive processes that were running keep
running, but their output streams and handles are gone (the clients' connections
closed with the old daemon); the sandbox's log from before the restart is kept.
Image-build sandboxes are not handed to the warden: they end with their engine, failed
with a reason that says to build again (their build fails; what it made is removed).

A sandbox under a network policy is handed over with its network: its link's lock goes
to the warden with its reattach socket, so its namespace and veth outlive the engine,
and the engine's nftables table stays (redirecting to the old resolver's and proxy's
ports, closed meanwhile: connections are refused, nothing gets out). The next engine
replaces the table in one transaction with its own, the adopted links in its set, and
enforces each sandbox's policy (from the registry) with its own resolver and proxy.
Connections relayed by the old proxy ended with it, and the event log starts afresh.
"""

from __future__ import annotations

import asyncio
import logging
import os
import select
import signal
import socket
import struct
import subprocess
from dataclasses import dataclass, field
from pathlib import Path

from corral.errors import CorralError

log = logging.getLogger("corral.runtime")

HANDOVER_SOCKET = "handover.sock"
HANDOVER_WAIT_S = 10.0
"""How long a new engine waits for the warden's descriptors once it connected."""
DEFAULT_RESTORE_GRACE_S = 300.0
"""How long a warden keeps an engine's sandboxes waiting for the next engine."""


@dataclass
class Handover:
    """What a warden handed over: the engine's locks and each sandbox's descriptors."""

    lock_fd: int
    uids_fd: int
    sandboxes: dict[str, list[int]] = field(default_factory=dict)  # [reattach, log]
    conn: socket.socket | None = None
    key_fd: int = -1  # the lock on the engine's cgroups (runtime/cgroup_sweep.py)

    def ack(self) -> None:
        """Tell the warden everything was received: it exits, touching nothing."""
        if self.conn is not None:
            try:
                self.conn.send(b"K")
            finally:
                self.conn.close()
                self.conn = None

    def close_unused(self, used: set[str]) -> None:
        """Close the descriptors of sandboxes that were not adopted."""
        for sid, fds in self.sandboxes.items():
            if sid not in used:
                for fd in fds:
                    with _quiet():
                        os.close(fd)


class _quiet:
    def __enter__(self) -> None:
        return None

    def __exit__(self, *exc: object) -> bool:
        return exc[0] is not None and issubclass(exc[0], OSError)  # type: ignore[arg-type]


def peer_uid(sock: socket.socket) -> int:
    """The uid of the process at the other end of a Unix socket."""
    creds = sock.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, struct.calcsize("3i"))
    return int(struct.unpack("3i", creds)[1])


def take_over(state_dir: Path) -> Handover | None:
    """Receive a dead engine's locks and sandboxes from its warden (blocking); ``None``
    when no warden offers any (no handover socket, or nobody listens on it)."""
    path = state_dir / HANDOVER_SOCKET
    if not path.exists():
        return None
    conn = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    conn.settimeout(HANDOVER_WAIT_S)
    try:
        conn.connect(str(path))
        if peer_uid(conn) != 0:
            raise OSError("the handover socket is not root's")
        handover: Handover | None = None
        while True:
            msg, fds, _flags, _addr = socket.recv_fds(conn, 4096, 8)
            if not msg:
                raise OSError("the warden hung up during the handover")
            kind, rest = msg[:1], msg[1:]
            if kind == b"L" and handover is None and fds:
                handover = Handover(fds[0], fds[1] if len(fds) > 1 else -1,
                                    key_fd=fds[2] if len(fds) > 2 else -1)
            elif kind == b"S" and handover is not None:
                handover.sandboxes[rest.decode(errors="replace")] = fds
            elif kind == b"E" and handover is not None:
                handover.conn = conn
                return handover
            else:
                for fd in fds:
                    os.close(fd)
    except OSError as exc:
        log.warning("no handover from the previous engine's warden (%s): its sandboxes "
                    "are cleaned up", exc)
        conn.close()
        return None


class AdoptedProcess:
    """The outer process (bwrap) of an adopted sandbox: not this process's child, so
    watched and signalled through a pidfd; its exit status is not known (``0``)."""

    def __init__(self, pid: int) -> None:
        self.pid = pid
        self._fd = os.pidfd_open(pid)
        self.returncode: int | None = None

    def poll(self) -> int | None:
        if self.returncode is None and select.select([self._fd], [], [], 0)[0]:
            self._exited()
        return self.returncode

    def wait(self, timeout: float | None = None) -> int:
        if self.returncode is None:
            if not select.select([self._fd], [], [], timeout)[0]:
                raise subprocess.TimeoutExpired(f"pid {self.pid}", timeout or 0)
            self._exited()
        assert self.returncode is not None
        return self.returncode

    def kill(self) -> None:
        if self.returncode is None:
            with _quiet():
                signal.pidfd_send_signal(self._fd, signal.SIGKILL)

    def _exited(self) -> None:
        self.returncode = 0
        os.close(self._fd)
        self._fd = -1


def process_uid(pid: int) -> int:
    """The real uid of process ``pid`` (-1 if it is gone)."""
    try:
        with open(f"/proc/{pid}/status", "rb") as f:
            for line in f:
                if line.startswith(b"Uid:"):
                    return int(line.split()[1])
    except (OSError, ValueError, IndexError):
        pass
    return -1


def reattach(reattach_sock: socket.socket) -> socket.socket:
    """Give an agent a new control socket over its reattach socket; our end of it."""
    ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        socket.send_fds(reattach_sock, [b"C"], [theirs.fileno()])
    except BaseException:
        ours.close()
        raise
    finally:
        theirs.close()
    return ours


async def wait_ready(ready: asyncio.Future[None], timeout: float) -> bool:
    """Whether an adopted agent said READY in time."""
    try:
        async with asyncio.timeout(timeout):
            await asyncio.shield(ready)
        return True
    except (CorralError, TimeoutError):
        return False
