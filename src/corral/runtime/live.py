"""What the engine holds for a sandbox whose processes exist (:class:`Live`).

One per running, paused or ending sandbox, in :attr:`Engine._live
<corral.runtime.engine.Engine>`; its ``lock`` orders lifecycle changes, ``busy`` counts
the commands and file operations in flight (an ``idle_timeout`` waits for them),
``processes`` are its interactive processes (they end with it).
"""

from __future__ import annotations

import asyncio
import socket
import subprocess
import time
import weakref
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Protocol

from corral.runtime.cgroups import Cgroup
from corral.runtime.channel import AgentChannel
from corral.runtime.gpus import GpuGrant
from corral.runtime.logtail import LogTail
from corral.schema import SandboxSpec, SandboxState


class LiveProcess(Protocol):
    """A process kept on its sandbox's record (a :class:`corral.runtime.processes.Process`;
    named by a protocol because that module imports this one)."""

    @property
    def id(self) -> str: ...


@dataclass
class Live:
    """What the engine holds for a sandbox whose processes exist."""

    id: str
    spec: SandboxSpec
    state: SandboxState
    sandbox_dir: Path
    cgroup: Cgroup
    uid: int = -1  # its host uid and gid, its own (corral.runtime.uids)
    proc: subprocess.Popen[bytes] | None = None
    channel: AgentChannel | None = None
    started_at: float = 0.0
    last_active: float = field(default_factory=time.monotonic)
    busy: int = 0
    lock: asyncio.Lock = field(default_factory=asyncio.Lock)
    exited: asyncio.Event = field(default_factory=asyncio.Event)
    ending: bool = False
    snapshot_id: str | None = None  # started from it: holds a reference until released
    ro_binds: tuple[tuple[str, str], ...] = ()  # (host path, /.corral/DIR/FILE), read-only
    build_root: bool = False  # an image build step as root (corral.runtime.rootbuild)
    user: int | None = None  # its commands' default uid (0 or 1000: runtime.users)
    image_layers: tuple[Path, ...] = ()  # its image's, top first: user names (users.resolve)
    gpus: GpuGrant | None = None  # the GPUs it holds (corral.runtime.gpus)
    processes: dict[str, LiveProcess] = field(default_factory=dict)  # by id
    cpus: tuple[int, ...] = ()  # the CPUs it runs on (corral.runtime.cpus)
    log: LogTail | None = None  # the launcher's, bwrap's and the agent's stderr
    reattach: socket.socket | None = None  # the host end of its agent's reattach socket
    adoptable: bool = True  # survives its engine (live restore); not an image build's
    netns: str | None = None  # a policy sandbox's network namespace (runtime/net)
    volumes: tuple[tuple[str, str, str], ...] = ()  # (mode, host dir, dest): runtime/volumes
    images: Path | None = None  # restored from these live checkpoint images (docs/live.md)
    program: tuple[str, ...] = ()  # run as root in place of bubblewrap: CRIU's restore
    kdat: str = ""  # CRIU's kernel probes for that restore (checkpoint.kdat_cache)
    hibernated: str | None = None  # its processes are this checkpoint's (engine_hibernate)
    hibernating: bool = False  # by its timeout, now (on_timeout="hibernate")
    # the daemon's TCP connections into it (port sockets, exposed ports): reset before a
    # dump, or whoever holds one (a stranger with an exposed URL) stops its checkpoints
    port_conns: weakref.WeakSet[socket.socket] = field(default_factory=weakref.WeakSet)

    def touch(self) -> None:
        """Something happened in it now (for ``idle_timeout``)."""
        self.last_active = time.monotonic()

    @contextmanager
    def activity(self) -> Iterator[None]:
        """A command or file operation in flight: busy (an ``idle_timeout`` waits for
        it) while it runs, and active as of when it ends."""
        self.busy += 1
        try:
            yield
        finally:
            self.busy -= 1
            self.touch()
