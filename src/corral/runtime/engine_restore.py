"""The engine's side of live restore (:mod:`corral.runtime.restore`): taking over the
sandboxes of the engine that had the state directory before, and handing its own to
the next one when it closes with ``handover``.

A mixin of :class:`~corral.runtime.engine.Engine` (like :mod:`.engine_commands`).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import socket
import stat
from dataclasses import dataclass
from pathlib import Path
from typing import IO, TYPE_CHECKING

from pydantic import SecretStr

from corral.errors import CorralError
from corral.network_schema import NetworkPolicy
from corral.runtime import restore, syscalls, users
from corral.runtime.channel import AgentChannel
from corral.runtime.live import Live
from corral.runtime.logtail import LogTail
from corral.runtime.net import netns
from corral.runtime.reconcile import reconcile
from corral.schema import SandboxSpec, SandboxState

if TYPE_CHECKING:
    from corral.runtime.cgroups import CgroupDriver
    from corral.runtime.cpus import CpuPicker
    from corral.runtime.events import Events
    from corral.runtime.gpus import GpuAllocator
    from corral.runtime.images import ImageStore
    from corral.runtime.net import NetworkManager
    from corral.runtime.paths import Layout
    from corral.runtime.registry import Registry
    from corral.runtime.secret_store import SecretStore
    from corral.runtime.uids import UidBlock
    from corral.runtime.volumes import Volumes
    from corral.runtime.warden import Warden

log = logging.getLogger("corral.runtime")

BUILD_CUT_REASON = ("the daemon restarted during the image build this sandbox ran: "
                    "build the image again")
ADOPT_READY_S = 20.0  # how long an adopted agent may take to say READY again
_ADOPTABLE = (SandboxState.RUNNING.value, SandboxState.PAUSED.value)


def lock_taking_over(state_dir: Path) -> tuple[IO[str], restore.Handover | None]:
    """The state directory's lock: handed over by the previous engine's warden (with
    that engine's sandboxes) or taken (blocking; :func:`~.warden.acquire_lock`)."""
    from corral.runtime.warden import acquire_lock

    taken: list[restore.Handover] = []

    def take() -> IO[str] | None:
        handover = restore.take_over(state_dir)
        if handover is None:
            return None
        taken.append(handover)
        return os.fdopen(handover.lock_fd, "a+")

    lock_file = acquire_lock(state_dir, take)
    return lock_file, (taken[0] if taken else None)


def hang_up(sock: socket.socket) -> None:
    """Shut a reattach socket down (the agent sees its end at once) and close it."""
    with contextlib.suppress(OSError):
        sock.shutdown(socket.SHUT_RDWR)
    sock.close()


class RestoreOps:
    """Adopting and handing over sandboxes (mixed into the engine)."""

    layout: Layout
    registry: Registry
    cgroups: CgroupDriver
    cgroup_parent: str
    uids: UidBlock
    gpus: GpuAllocator
    cpu_picker: CpuPicker
    volumes: Volumes
    images: ImageStore
    events: Events
    _live: dict[str, Live]
    _warden: Warden | None
    net: NetworkManager
    _handed_links: dict[str, netns.Link]  # adopted policy sandboxes' links, until adopted
    secret_store: SecretStore

    if TYPE_CHECKING:
        def _on_agent_exit(self, live: Live) -> None: ...
        async def _end(self, live: Live, final: SandboxState, reason: str, *,
                       grace: float) -> None: ...

    def _kept_secrets(self, sandbox_id: str, spec: SandboxSpec) -> SandboxSpec:
        """``spec`` read back from the registry (its secrets masked) with the real
        values its engine kept (:mod:`.secret_store`): what a sandbox taken over after
        a restart gives its new commands. One the store lacks is dropped, never given
        on masked (a sandbox of an engine that kept none)."""
        if not spec.secrets:
            return spec
        kept = self.secret_store.get(sandbox_id)
        if missing := sorted(set(spec.secrets) - set(kept)):
            log.warning("sandbox %s: its secrets %s were not kept; its new commands go "
                        "without them", sandbox_id, ", ".join(missing))
        return spec.model_copy(update={"secrets": {
            k: SecretStr(v) for k, v in kept.items() if k in spec.secrets}})

    def _adoptable(self, handover: restore.Handover | None) -> list[Live]:
        """The sandboxes to adopt from ``handover``: handed over, running or paused in
        the registry, their outer process the same (pid and start time) and their
        cgroup there. Their descriptors pass to our warden before the old one is told
        it may go, so there is no moment when no process holds them. The rest of what
        the registry thought alive is cleaned up as lost (:func:`reconcile`)."""
        lives: list[Live] = []
        handed_links = self._handed_links
        if handover is not None:
            for sid, state, pid, pid_start, cg_path in self.registry.live_rows():
                fds = _classified(handover.sandboxes.get(sid) or [])
                if not (fds.reattach >= 0 and state in _ADOPTABLE and pid and pid_start
                        and cg_path):
                    continue
                if syscalls.process_start_time(pid) != pid_start:
                    continue
                info = self.registry.get(sid)
                if info is None:
                    continue
                link = None
                if isinstance(info.spec.network, NetworkPolicy):  # its link came with it
                    link = netns.link_of_lock(fds.link_lock, self.net.links.lock_dir)
                    if link is None or not link.netns_path.exists():
                        continue
                try:
                    grant = None
                    if info.spec.gpus:  # the same GPUs, held again (its env names them)
                        held = info.spec.env.get("CORRAL_GPUS", "")
                        grant = self.gpus.assign(sid, held.split(","),
                                                 shared=info.spec.gpu_shared)
                    mounts = tuple(self.volumes.mounts(info.spec.tenant, info.spec.volumes))
                    cgroup = self.cgroups.open(cg_path)
                    proc = restore.AdoptedProcess(pid)
                except (OSError, CorralError):
                    self.gpus.release(sid)
                    continue
                live = Live(sid, self._kept_secrets(sid, info.spec), SandboxState(state),
                            self.layout.sandbox_dir(sid),
                            cgroup, restore.process_uid(pid), proc)  # type: ignore[arg-type]
                live.started_at = info.started_at or 0.0
                live.snapshot_id = info.spec.snapshot
                live.gpus = grant
                live.volumes = mounts  # (a volume in use is not removed)
                with contextlib.suppress(CorralError):  # its image's USER (runtime.users)
                    image = self.images.get(info.spec.image)
                    live.user, live.image_layers = users.image_default(image), tuple(image.lowers)
                try:  # the CPUs it runs on (its affinity, set at its launch)
                    live.cpus = self.cpu_picker.hold(sorted(os.sched_getaffinity(pid)))
                except OSError:
                    live.cpus = ()
                live.reattach = socket.socket(fileno=fds.reattach)
                if fds.log >= 0:
                    live.log = LogTail(fds.log)
                if link is not None:
                    live.netns, handed_links[sid] = str(link.netns_path), link
                lives.append(live)
            keep = {live.id for live in lives}
            if self._warden is not None:
                for live in lives:
                    self._warden.keep(live.id, handover.sandboxes[live.id])
            handover.close_unused(keep)
            handover.ack()
        lost = reconcile(self.layout, self.registry, self.cgroups, self.cgroup_parent,
                         keep={live.id: live.cgroup.path for live in lives})
        if lost:
            log.info("%d sandboxes of the previous engine were lost: %s", len(lost),
                     ", ".join(lost[:20]))
        for live in lives:
            self.uids.take(live.uid)
        return lives

    async def _adopt(self, lives: list[Live]) -> list[str]:
        """Give each adopted sandbox's agent a new control socket and wait for it (a
        paused one answers when resumed); those that do not answer end as failed."""
        results = await asyncio.gather(*(self._adopt_one(live) for live in lives))
        adopted = [live.id for live, ok in zip(lives, results, strict=True) if ok]
        if adopted:
            log.info("adopted %d running sandboxes of the previous engine", len(adopted))
        return adopted

    async def _adopt_one(self, live: Live) -> bool:
        assert live.reattach is not None
        self._live[live.id] = live
        if live.log is not None:
            live.log.start()
        if (link := self._handed_links.pop(live.id, None)) is not None:
            assert isinstance(live.spec.network, NetworkPolicy)
            try:  # its policy enforced again, by this engine's table, resolver and proxy
                await self.net.adopt(live.id, live.spec.network, link, live.spec.tenant)
            except (OSError, CorralError) as exc:
                self.net.links.release(link)
                await self._end(live, SandboxState.FAILED,
                                _lost(live, f"its network policy could not be restored ({exc})"),
                                grace=0)
                return False
        try:
            sock = restore.reattach(live.reattach)
        except OSError as exc:
            await self._end(live, SandboxState.FAILED, _lost(live, f"its agent is gone ({exc})"),
                            grace=0)
            return False
        channel = AgentChannel(sock, live.id, proc=live.proc, cgroup=live.cgroup)
        live.channel = channel
        channel.on_close = lambda: self._on_agent_exit(live)
        await channel.start()
        if live.state == SandboxState.PAUSED:
            return True  # frozen: its READY comes when it is resumed
        try:
            if live.cgroup.frozen():  # frozen mid-snapshot by the engine that went away
                live.cgroup.thaw()
        except (OSError, CorralError):
            pass
        if not await restore.wait_ready(channel.ready, ADOPT_READY_S):
            if not live.ending:
                await self._end(live, SandboxState.FAILED,
                                _lost(live, "its agent did not answer the new engine"), grace=0)
            return False
        live.touch()
        return True

    def _keep_with_warden(self, live: Live, fds: list[int]) -> None:
        """A new sandbox's reattach socket and log pipe go to the warden (it may then
        outlive this engine); an image build's stay ours (it ends with the engine). A
        sandbox under a network policy hands over its link's lock too: its namespace
        and veth then outlive this engine, for the next one's table, resolver and proxy
        to enforce its policy again (:meth:`NetworkManager.adopt`)."""
        if live.netns is not None:
            fds = [*fds, self.net.lock_fd(live.id)]
        if self._warden is not None and live.adoptable:
            self._warden.keep(live.id, fds)

    def _forget(self, live: Live, *, shut: bool = True) -> socket.socket | None:
        """The sandbox ends: nobody may reattach it; its agent exits once its control
        socket closes too. Without ``shut``, its reattach socket is handed back for
        the caller to shut down off the event loop (:func:`hang_up`): the shutdown wakes
        the agent, and on a busy host that cost the loop ~1 ms a sandbox, most of its
        work in a mass teardown."""
        if live.reattach is None:
            return None
        # Shut down, not only closed: the warden's copy is the same socket, and the
        # agent must see its end now, not when the warden gets to its ``drop``.
        reattach, live.reattach = live.reattach, None
        if self._warden is not None and live.adoptable:
            self._warden.drop(live.id)
        if not shut:
            return reattach
        hang_up(reattach)
        return None

    async def _hand_over(self) -> set[str]:
        """Close without ending the sandboxes: their agents detach and wait for the
        next engine, the warden keeping their reattach sockets (``grace`` seconds).
        The policy sandboxes handed over (their links stay: ``net.close(keep=...)``)."""
        handed = {live.id for live in self._live.values()
                  if live.adoptable and live.netns is not None}
        # An image build's sandbox is not handed over (its builder is this daemon's):
        # it fails now, typed, and is cleaned up like any ended sandbox.
        await asyncio.gather(*(
            self._end(live, SandboxState.FAILED, BUILD_CUT_REASON, grace=0)
            for live in list(self._live.values()) if not live.adoptable),
            return_exceptions=True)
        for live in list(self._live.values()):
            live.ending = True  # no end is recorded: the next engine adopts it
            if live.channel is not None:
                live.channel.on_close = None
                await live.channel.close()
            if live.reattach is not None:
                live.reattach.close()  # our copy; the warden holds its own
                live.reattach = None
            if live.log is not None:
                live.log.close()
        self._live.clear()
        return handed


@dataclass(frozen=True)
class _Handed:
    """A handed-over sandbox's descriptors, told apart by kind (-1: none)."""

    reattach: int = -1  # the agent's reattach socket
    log: int = -1  # the launcher's, bwrap's and the agent's stderr (a pipe)
    link_lock: int = -1  # a policy sandbox's link's lock (a regular file, held)


def _classified(fds: list[int]) -> _Handed:
    found: dict[str, int] = {}
    for fd in fds:
        try:
            mode = os.fstat(fd).st_mode
        except OSError:
            continue
        kind = ("reattach" if stat.S_ISSOCK(mode) else "log" if stat.S_ISFIFO(mode)
                else "link_lock" if stat.S_ISREG(mode) else None)
        if kind is not None:
            found.setdefault(kind, fd)
    return _Handed(**found)


def _lost(live: Live, why: str) -> str:
    return (f"lost: {why} after the engine restarted (it was {live.state.value}); its "
            "processes, mounts and cgroups were cleaned up")

