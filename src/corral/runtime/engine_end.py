"""How a sandbox is found, changes state and ends: the ownership check every verb on
one sandbox asks first (:meth:`EndOps._owned`), pause and resume, stop and delete, and
the one teardown they share (:meth:`EndOps._end`, :meth:`EndOps._release`).

A mixin of :class:`~corral.runtime.engine.Engine` (like :mod:`.engine_lifetime`).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import signal
import socket
import threading
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import TYPE_CHECKING, Any

from corral.errors import CorralError, InvalidState
from corral.runtime import processes, rootfs, syscalls
from corral.runtime.agent_exit import has_exited, namespace_init
from corral.runtime.agentconn import ended_error
from corral.runtime.channel import wait_exit as _wait_exit
from corral.runtime.engine_restore import hang_up
from corral.runtime.events import SandboxDeleted, SandboxEnded, StateChanged
from corral.runtime.kept_files import keeps_files
from corral.runtime.live import Live
from corral.runtime.ownership import UNSET, OwnerArg
from corral.runtime.protocol import Msg, Tag
from corral.runtime.threadwork import ThreadBatch
from corral.schema import TRANSITIONS, SandboxInfo, SandboxState

if TYPE_CHECKING:
    from concurrent.futures import Executor
    from pathlib import Path

    from corral.runtime.cgroups import Cgroup
    from corral.runtime.cpus import CpuPicker
    from corral.runtime.events import Events
    from corral.runtime.gpus import GpuAllocator
    from corral.runtime.kept_files import KeptFiles
    from corral.runtime.launcher import SlotPool
    from corral.runtime.net import NetworkManager
    from corral.runtime.ownership import Owners
    from corral.runtime.registry import Registry
    from corral.runtime.snapshots import Snapshots
    from corral.runtime.uids import UidBlock

logger = logging.getLogger("corral.runtime")

STOP_WAIT_S = 5.0
RELEASE_THREADS = 48
"""Threads unmounting and removing cgroups at once (``Engine._releasers``). Each release
spends ~10 ms in the kernel, mostly waiting (RCU grace periods, not CPU): asyncio's
default pool (cores + 4 threads) queued a mass teardown behind six of them; 48 took
200 concurrent deletes from 1.16-1.21 s to 0.63-0.87 s (load 24-34, same engine CPU)."""
HANG_UP_THREADS = 8
"""Threads stopping ending sandboxes' agents (``Engine._hang_ups``): the shutdown of the
reattach socket wakes the agent, ~1 ms of the loop's time each on a busy host, and the
read of the freezer's state is a file's open, read and close; a pool of their own, as in
the release pool they queued behind the removals of sandboxes ended earlier, and each
sandbox's exit waits for its own."""
HANG_UP_BATCH = 16
"""Sandboxes' agent stops that share one job of the hang-up pool (``ThreadBatch``)."""
TRIM_AFTER_BYTES = 1 << 20  # unread output dropped at a release that makes it give memory back
PRESTART_WAIT_S = 60.0  # the most a release thread waits for its siblings to start


def release_pool(threads: int = RELEASE_THREADS, name: str = "corral-release") -> ThreadPoolExecutor:
    """A pool of release threads, its threads started by a helper thread.

    A pool starts its threads when work is submitted, and each start waits for the new
    thread to run: on a loaded host ~10 ms apiece, so the first mass teardown blocked
    the event loop for ~0.45 s while 48 threads started. Here a helper thread submits
    ``threads`` tasks that wait for one another, so every thread exists (idle) before
    the loop first needs one; a pool shut down meanwhile just stops the warming."""
    pool = ThreadPoolExecutor(threads, thread_name_prefix=name)
    barrier = threading.Barrier(threads + 1)

    def wait() -> None:
        try:
            barrier.wait(PRESTART_WAIT_S)
        except threading.BrokenBarrierError:
            pass

    def warm() -> None:
        try:
            for _ in range(threads):
                pool.submit(wait)
        except RuntimeError:  # shut down (the engine closed at once)
            barrier.abort()
            return
        wait()

    threading.Thread(target=warm, name=f"{name}-warm", daemon=True).start()
    return pool


class EndOps:
    """Finding a live sandbox for its owner, pausing it, and ending it (mixed into the engine)."""

    if TYPE_CHECKING:
        _live: dict[str, Live]
        _resuming: dict[str, tuple[asyncio.Event, asyncio.Task[Any] | None, str | None]]
        registry: Registry
        events: Events
        owners: Owners
        kept: KeptFiles
        net: NetworkManager
        cpu_picker: CpuPicker
        uids: UidBlock
        snapshots: Snapshots
        gpus: GpuAllocator
        closed: bool
        _releasers: Executor
        _teardowns: set[asyncio.Future[None]]
        _agent_stops: ThreadBatch
        _pool: SlotPool

        def get(self, sandbox_id: str, *, owner: OwnerArg = UNSET) -> SandboxInfo: ...
        def upper_dir(self, sandbox_id: str) -> Path: ...
        def _forget(self, live: Live, *, shut: bool = True) -> socket.socket | None: ...

    def _owned(self, sandbox_id: str, owner: OwnerArg) -> None:
        """Raise :class:`SandboxNotFound` unless ``owner`` may see ``sandbox_id`` (another
        tenant's answers like an unknown id); every verb on one sandbox asks first."""
        acting = self.owners.of(owner)
        if acting is None:
            return
        live = self._live.get(sandbox_id)
        if live is None or live.spec.tenant != acting:
            self.get(sandbox_id, owner=acting)  # SandboxNotFound unless its own (ended)

    def _get_live(self, sandbox_id: str) -> Live:
        """A live sandbox (whose it is was checked by :meth:`_owned`)."""
        live = self._live.get(sandbox_id)
        if live is None:
            raise ended_error(self.get(sandbox_id, owner=None))  # its own fault: SandboxProtocolError
        return live

    def _running(self, sandbox_id: str) -> Live:
        live = self._get_live(sandbox_id)
        if live.channel is not None and live.channel.faulted:
            raise live.channel.error_copy()  # being ended by its own doing
        if live.state != SandboxState.RUNNING or live.channel is None:
            hint = "resume it first" if live.state == SandboxState.PAUSED else "create a new one"
            raise InvalidState(
                f"sandbox {sandbox_id} is {live.state.value}: {hint}",
                details={"sandbox_id": sandbox_id, "state": live.state.value},
            )
        live.touch()
        return live

    def _transition(self, live: Live, to: SandboxState, reason: str | None = None, *,
                    record: bool = True) -> None:
        """``record=False``: the row is not written (a delete removes it next)."""
        if to not in TRANSITIONS[live.state]:
            raise InvalidState(
                f"sandbox {live.id} cannot go from {live.state.value} to {to.value}",
                details={"sandbox_id": live.id, "state": live.state.value},
            )
        if record:
            self.registry.set_state(live.id, to, reason)  # first: a full disk changes nothing
        old, live.state = live.state, to
        self.events.emit(StateChanged(live.id, old, to, reason))

    async def pause(self, sandbox_id: str, *, owner: OwnerArg = UNSET) -> SandboxInfo:
        """Freeze every process of the sandbox (cgroup freezer). Memory stays resident."""
        self._owned(sandbox_id, owner)
        live = self._get_live(sandbox_id)
        async with live.lock:
            if live.state != SandboxState.PAUSED:
                self._transition(live, SandboxState.PAUSED)
                live.cgroup.freeze()
        return self.get(sandbox_id, owner=None)

    async def _resume_running(self, sandbox_id: str) -> SandboxInfo:
        """Thaw a paused sandbox (``resume``, engine_hibernate.py, also wakes one; whose
        it is was checked there)."""
        live = self._get_live(sandbox_id)
        async with live.lock:
            if live.state == SandboxState.PAUSED:
                self._transition(live, SandboxState.RUNNING)  # StorageFull: still paused
                live.cgroup.thaw()
                live.touch()
            elif live.state != SandboxState.RUNNING:
                self._transition(live, SandboxState.RUNNING)  # raises InvalidState
        return self.get(sandbox_id, owner=None)

    async def stop(
        self, sandbox_id: str, *, grace: float = 2.0, reason: str = "stopped by request",
        owner: OwnerArg = UNSET,
    ) -> SandboxInfo:
        """Stop: SIGTERM to running commands, SIGKILL after ``grace`` seconds, release
        mounts and cgroups. The record stays (state ``stopped``) until deleted."""
        # a resume under way: stop what it leaves
        await self._past_resume(sandbox_id, self.owners.of(owner))
        info = self.get(sandbox_id, owner=owner)  # SandboxNotFound (another owner's too)
        live = self._live.get(sandbox_id)
        if live is None:
            if info.state.terminal:
                return info
        else:
            await self._end(live, SandboxState.STOPPED, reason, grace=grace)
        return self.get(sandbox_id, owner=None)

    async def _past_resume(self, sandbox_id: str, acting: str | None) -> None:
        """Wait until no resume of ``sandbox_id`` is under way (engine_hibernate: it
        takes the hibernated sandbox out of the table while it creates it again); not
        for another tenant's (``acting``: the caller), whose verb answers at once, as
        for an unknown id."""
        while (resuming := self._resuming.get(sandbox_id)) is not None:
            done, task, tenant = resuming
            if task is asyncio.current_task():  # the resume's own create, cleaning up
                return
            if not self.owners.sees_owner(tenant, acting):
                return
            await done.wait()

    async def delete(self, sandbox_id: str, *, owner: OwnerArg = UNSET,
                     wait: bool = True) -> bool:
        """Kill and remove ``owner``'s sandbox and its record. Idempotent: False if it
        did not exist (or is another tenant's).

        ``wait=False`` returns once it is gone from the registry and every process of it
        has exited; removing its cgroup, mounts and directories (kernel waits of a few
        ms: RCU grace periods, not CPU) then finishes in the background, and
        :meth:`close` waits for it. With processes still there after ``STOP_WAIT_S``,
        the whole teardown is waited for, as with ``wait=True``."""
        acting = self.owners.of(owner)
        # a tenant: another's row is not even read (registry.get), so it costs what an
        # unknown id costs, and answers the same (a row is written before its sandbox lives)
        await self._past_resume(sandbox_id, acting)  # a resume under way: delete what it leaves
        live = self._live.get(sandbox_id)
        if live is not None and (acting is None or live.spec.tenant == acting):
            tenant = live.spec.tenant  # one it may delete, in memory: its row need not be read
        else:
            info = self.registry.get(sandbox_id, owner=acting)
            if acting is not None and info is None:
                return False
            tenant = info.spec.tenant if info else None
        live = self._live.get(sandbox_id)
        if live is not None:
            # its row is removed right after: the end's last state is not written
            await self._end(live, SandboxState.STOPPED, "deleted", grace=0, detach=not wait,
                            record=False)
        existed = live is not None or self.registry.get(sandbox_id) is not None
        self.registry.delete(sandbox_id)
        if existed:
            self.events.emit(SandboxDeleted(sandbox_id, tenant))
        return existed

    async def reclaimed(self) -> None:
        """Wait until the background teardowns of ``delete(wait=False)`` are done: the
        sandboxes' cgroups, mounts and directories removed, their uids given back."""
        await _settled(self._teardowns)

    async def _end(self, live: Live, final: SandboxState, reason: str, *, grace: float,
                   detach: bool = False, record: bool = True) -> None:
        async with live.lock:
            if live.ending or self._live.get(live.id) is not live:  # (a resumed one's is new)
                return
            live.ending = True
            try:  # a registry that cannot be written (a full disk) still frees everything
                if live.state in (SandboxState.RUNNING, SandboxState.PAUSED):
                    self._transition(live, SandboxState.STOPPING, reason)
                if grace > 0 and live.channel is not None and not live.channel.closed:
                    if live.cgroup.frozen():
                        live.cgroup.thaw()
                    try:
                        live.channel.send(Msg.SIGNAL, 0, [(Tag.SIGNAL, signal.SIGTERM)])
                        deadline = time.monotonic() + grace
                        while live.channel.streams and time.monotonic() < deadline:
                            await asyncio.sleep(0.02)
                    except CorralError:
                        pass
                if final == SandboxState.STOPPED and keeps_files(reason) and live.proc:
                    await self.kept.keep(live, self.upper_dir(live.id))  # kept_files.py
            finally:
                await self._release(live, detach=detach)
                self._live.pop(live.id, None)
            try:
                if live.state == SandboxState.PENDING:
                    live.state = final
                else:
                    self._transition(live, final, reason, record=record)
            finally:
                self.events.emit(SandboxEnded(live.id, final, reason))

    async def _release(self, live: Live, *, detach: bool = False) -> None:
        """Kill every process, then unmount and remove the cgroup (``detach``: in the
        background once every process has exited, see :meth:`delete`). Never raises."""
        live.ending = True
        # its agent, pid 1 of its pid namespace: its exit is the end of every process of
        # the sandbox, before bwrap's (agent_exit.namespace_init)
        init = namespace_init(live.proc) if detach and live.proc is not None else None
        try:
            await self._stop_processes(live, init)
            gone = live.proc is None or live.proc.poll() is not None or (
                init is not None and has_exited(init))
        finally:
            if init is not None:
                os.close(init)
        if live.log is not None:
            live.log.close()
        dropped = processes.release(live)
        self.cpu_picker.give_back(live.cpus)
        live.cpus = ()
        # Removing cgroups and unmounting are blocking syscalls of a few ms each: in a
        # thread, many teardowns overlap (and use both cores) instead of queueing.
        loop = asyncio.get_running_loop()
        # nothing of it runs any more (its agent was pid 1 of its pid namespace: the
        # kernel ended the rest before it): the caller need not wait
        detach = detach and not self.closed and gone
        trim = dropped >= TRIM_AFTER_BYTES
        if detach:  # bwrap exits after its agent: its own exit is waited for there
            teardown: asyncio.Future[None] = asyncio.ensure_future(self._after_exit(live, trim))
            self._teardowns.add(teardown)
            teardown.add_done_callback(_teardown_done(self._teardowns, live.id))
        else:
            await loop.run_in_executor(
                None if self.closed else self._releasers,  # its pool ends with it (then: asyncio's)
                self._release_resources, live, trim)
        snapshot_id, live.snapshot_id = live.snapshot_id, None
        await self.snapshots.release(snapshot_id)
        self.gpus.release(live.id)  # after its processes are gone

    async def _stop_processes(self, live: Live, init: int | None) -> None:
        """Close the agent's channel (it exits, and with it every process of its pid
        namespace) and wait up to ``STOP_WAIT_S`` for that: for bwrap's exit, or for
        ``init``'s (:func:`~corral.runtime.agent_exit.namespace_init`) where given."""
        # Frozen processes (or a stuck agent, or one not started yet: a create
        # cancelled) cannot see their channel close: they are killed first, rather
        # than waited for STOP_WAIT_S; the freezer is read off the loop, with the
        # reattach socket's shutdown (its agent exits once its channel closes too).
        kill = live.channel is not None and (
            live.channel.faulted or not live.channel.ready.done())
        stop = _agent_stop(live.cgroup, kill, self._forget(live, shut=False),
                           _control_copy(live))
        stopped = None
        if stop is not None:
            stopped = (asyncio.ensure_future(asyncio.to_thread(stop)) if self.closed
                       else self._agent_stops.run(stop))
        self.net.cut_all(live.id)
        if live.channel is not None:
            await live.channel.close()
        if stopped is not None:
            await asyncio.gather(stopped, return_exceptions=True)
        if live.proc is not None:
            try:
                await asyncio.wait_for(_wait_exit(live.proc, init), STOP_WAIT_S)
            except asyncio.TimeoutError:
                pass

    async def _after_exit(self, live: Live, trim: bool) -> None:
        """A detached teardown: bwrap's exit (it reaps the agent and unmounts the
        sandbox's tree; killed in :meth:`_release_resources` if it is not gone within
        ``STOP_WAIT_S``), then the removals, in a release thread."""
        if live.proc is not None:
            with contextlib.suppress(asyncio.TimeoutError):
                await asyncio.wait_for(_wait_exit(live.proc), STOP_WAIT_S)
        await asyncio.get_running_loop().run_in_executor(
            None if self.closed else self._releasers,  # (closed meanwhile: asyncio's)
            self._release_resources, live, trim)

    def _release_resources(self, live: Live, trim: bool = False) -> None:
        if trim:  # megabytes of unread output were freed: give them back (a few ms)
            syscalls.malloc_trim()
        gone = True  # then nothing runs as its uid any more: it may be used again
        if live.cgroup is not None:
            try:  # emptied: kept for a next warm slot (cgroup_recycle.py), else removed
                if not self._pool.give_back(live.cgroup):
                    live.cgroup.remove(children=False)
            except (OSError, CorralError):
                gone = False
        if live.proc is not None and live.proc.poll() is None:
            live.proc.kill()
            live.proc.wait()
        self.net.detach(live.id)
        rootfs.remove_dirs(live.sandbox_dir)
        if gone and not live.sandbox_dir.exists():
            self.uids.release(live.uid)


def _control_copy(live: Live) -> socket.socket | None:
    """A copy of the agent's control socket (its own descriptor) for the stop job to
    shut down: the agent sees its channel end at once, not when the loop, after every
    other delete queued with this one, closes the transport (the job never touches the
    transport's descriptor, which the loop may close, and its number be reused, meanwhile)."""
    chan = live.channel
    if chan is None or chan.closed:
        return None
    chan.closing = True  # an end the engine asks for (see AgentChannel._hung_up)
    try:
        fd = chan.sock.fileno()
        return None if fd < 0 else socket.socket(
            socket.AF_UNIX, socket.SOCK_STREAM, fileno=os.dup(fd))
    except OSError:
        return None


def _agent_stop(cgroup: Cgroup | None, kill: bool, reattach: socket.socket | None,
                control: socket.socket | None) -> Callable[[], None] | None:
    """What stops an ending sandbox's agent off the loop: its processes killed if asked
    (``kill``) or frozen, then its control and reattach sockets shut down. Never raises."""
    if cgroup is None and reattach is None and control is None:
        return None

    def stop() -> None:
        try:
            if cgroup is not None and (kill or cgroup.frozen()):
                cgroup.kill_all()
        except (OSError, CorralError):
            pass
        finally:
            for sock in (control, reattach):
                if sock is not None:
                    hang_up(sock)
    return stop


async def _settled(pending: set[asyncio.Future[None]]) -> None:
    while pending:
        await asyncio.gather(*(asyncio.shield(f) for f in list(pending)), return_exceptions=True)


def _teardown_done(pending: set[asyncio.Future[None]], sandbox_id: str
                   ) -> Callable[[asyncio.Future[None]], None]:
    def done(fut: asyncio.Future[None]) -> None:
        pending.discard(fut)
        if not fut.cancelled() and fut.exception() is not None:
            logger.error("sandbox %s: its teardown failed", sandbox_id, exc_info=fut.exception())
    return done
