"""Warm launch slots: sandboxes half-started before anyone asks for one.

A slot is a ``corral-agent launch --ready`` process that has already joined a fresh
cgroup (on cgroup v1 a join can wait ~10 ms for an RCU grace period), holding the
control socket and the seccomp program its sandbox will inherit. Creating a sandbox
takes a slot, sets the cgroup's limits, and sends the rest of the launch options
(mounts, the bwrap command line) down the slot's stdin; the launcher then mounts the
root in a private mount namespace and becomes bwrap. Each slot has its own host uid
(:mod:`corral.runtime.uids`), given at spawn: the launcher prepares the idmapping of
its layers while it waits, picks the CPUs of a default-size sandbox and writes its
cpuset, and makes the sandbox's empty network namespace (``agent/netns.c``).

Nothing of the host is handed to the sandbox as a descriptor: the launcher's stdin,
stdout and stderr are pipes (stderr, which bwrap and the agent inherit, is drained
by a :class:`~corral.runtime.logtail.LogTail`), and the others are the control
socket, the reattach socket (a ``SOCK_SEQPACKET`` pair whose host end the engine's
warden keeps, so a later engine can give the agent a new control socket:
:mod:`corral.runtime.restore`) and the seccomp program.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import logging
import os
import secrets
import socket
import subprocess
import threading
import time
from collections import deque
from dataclasses import dataclass
from pathlib import Path

from corral.errors import CorralError, SandboxStartError
from corral.runtime import seccomp
from corral.runtime.agentbuild import agent_layer
from corral.runtime.cgroup_recycle import recycle, set_slot_cpus
from corral.runtime.cgroups import Cgroup, CgroupDriver
from corral.runtime.cpus import CpuPicker
from corral.runtime.devices import standard_rules
from corral.runtime.logtail import LogTail
from corral.runtime.threadwork import finish_in_thread
from corral.runtime.uids import CANONICAL_UID, UidBlock, root_uid
from corral.schema import DEFAULT_CPUS, DEFAULT_MEMORY_MB, DEFAULT_PIDS

log = logging.getLogger("corral.runtime")

DEFAULT_WARM_SLOTS = 4
SPAWN_BACKOFF_S = 1.0
LOCAL_CHANNELS_TIMEOUT_S = 30.0
# emptied groups kept for the next slots (cgroup_recycle.py): at most this many, and at
# most twice the warm target (none where the engine keeps no warm slots)
SPARE_GROUPS = 16


@dataclass
class Slot:
    """One launcher waiting for its sandbox's options."""

    name: str
    cgroup: Cgroup
    proc: subprocess.Popen[bytes]
    sock: socket.socket  # the engine's end of the agent's control channel
    ctl_fd: int  # the number of the agent's end, as the agent will see it
    seccomp_fd: int
    go_fd: int  # the launcher's stdin
    log: LogTail  # its stderr (bwrap's and the agent's too), drained with a cap
    uid: int  # the sandbox's host uid and gid
    reattach: socket.socket | None  # the host end of the agent's reattach socket
    reattach_fd: int  # the number of the agent's end, as the agent will see it
    log_fd: int = -1  # a copy of the read end of ``log``, for the warden to keep
    # the launcher made an empty network namespace of its own while it waited
    # (``agent/netns.c``): a sandbox without a network runs in it, bwrap makes none
    own_netns: bool = False
    # the CPUs its cgroup's cpuset already holds: the picker's guess for a sandbox of
    # DEFAULT_CPUS when it was made (writing a cpuset costs the kernel a rebuild)
    cpus: tuple[int, ...] = ()
    # its group already allows only the standard device nodes (v1: written while it
    # waited, before its launcher joined; corral.runtime.devices)
    devices_set: bool = False
    # the layers (a ':' list) its launcher cloned and idmapped while it waited (launch.c)
    prelower: str = ""

    def alive(self) -> bool:
        return self.proc.poll() is None

    def launch(self, args: list[str]) -> None:
        """Send the remaining options; the launcher mounts the root and execs them."""
        data = b"\0".join(a.encode() for a in args) + b"\0"
        try:
            view = memoryview(data)
            while view:
                view = view[os.write(self.go_fd, view) :]
        finally:
            os.close(self.go_fd)
            self.go_fd = -1

    async def take_local_channels(self, timeout: float = LOCAL_CHANNELS_TIMEOUT_S) -> None:
        """A checkpointable sandbox's agent makes its channels again inside its own
        namespaces and sends us their ends (``agent.c``, ``serve ... local``): take them
        in place of the ones this slot made (which it closes)."""
        loop = asyncio.get_running_loop()
        readable: asyncio.Future[None] = loop.create_future()

        def on_readable() -> None:
            if not readable.done():
                readable.set_result(None)

        loop.add_reader(self.sock.fileno(), on_readable)
        try:
            async with asyncio.timeout(timeout):
                await readable
        except TimeoutError:
            raise SandboxStartError("the sandbox's agent sent no channels") from None
        finally:
            loop.remove_reader(self.sock.fileno())
        msg, fds, _flags, _addr = socket.recv_fds(self.sock, 1, 2, socket.MSG_CMSG_CLOEXEC)
        if msg != b"L" or len(fds) != 2:
            for fd in fds:
                os.close(fd)
            raise SandboxStartError(f"the sandbox's agent did not start: {self.error_output()}")
        self.sock.close()
        self.sock = socket.socket(fileno=fds[0])
        if self.reattach is not None:
            self.reattach.close()
        self.reattach = socket.socket(fileno=fds[1])

    def error_output(self) -> str:
        return self.log.text()

    def hang_up(self) -> None:
        """A launched sandbox failed to start (or its create was cancelled): let go of
        the host's ends that only a ready sandbox hands on. Its agent waits on its
        reattach socket for a next engine while our end is open (restore.py), so once
        its control channel closes it exits only when this one is shut down too."""
        if self.reattach is not None:
            with contextlib.suppress(OSError):
                self.reattach.shutdown(socket.SHUT_RDWR)
            self.reattach.close()
            self.reattach = None
        if self.log_fd >= 0:
            os.close(self.log_fd)
            self.log_fd = -1

    def discard(self) -> bool:
        """Stop an unused launcher and remove its cgroup (blocking); whether nothing of
        it is left (then its uid may be used again)."""
        if self.go_fd >= 0:
            os.close(self.go_fd)  # EOF: a waiting launcher exits
            self.go_fd = -1
        self.sock.close()
        if self.reattach is not None:
            self.reattach.close()
        if self.log_fd >= 0:
            os.close(self.log_fd)
            self.log_fd = -1
        try:
            self.proc.wait(2)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()
        gone = True
        try:
            self.cgroup.remove(children=False)
        except (OSError, CorralError):
            gone = False
        self.log.close()
        return gone


class SlotPool:
    """Keeps ``target`` slots ready and hands them out."""

    def __init__(self, *, agent_path: Path, cgroups: CgroupDriver, cgroup_parent: str, target: int,
                 uids: UidBlock, cpu_picker: CpuPicker | None = None) -> None:
        self.agent_path = agent_path
        self.cpu_picker = cpu_picker
        self.uids = uids
        self.cgroups = cgroups
        self.cgroup_parent = cgroup_parent
        self.target = target
        self._ready: deque[Slot] = deque()
        self._spawning = 0
        self._tasks: set[asyncio.Task[None]] = set()
        self._backoff_until = 0.0
        self.closed = False
        # ended sandboxes' groups, emptied, renamed and reset (give_back), for new slots;
        # given back from release threads
        self._spare: deque[Cgroup] = deque()
        self._spare_lock = threading.Lock()
        self.recycled = 0  # slots made on a recycled group (a figure for tests, benchmarks)
        # the layers (``--lower``'s list) a new slot clones and idmaps while it waits:
        # the agent's, then the engine sets those of the last sandbox it started
        self.prelower = str(agent_layer(agent_path))

    async def take(self, cpus: tuple[int, ...] = ()) -> Slot:
        """A ready slot: a warm one if there is one (one whose cpuset holds ``cpus`` if
        any does), else one made now.

        The caller calls :meth:`refill` once its sandbox is started: while more than
        half the target is still ready, the slot taken is replaced only then, so the
        new launcher's start (its exec, user and network namespaces, cgroup joins, the
        cgroup ``mkdir``s) does not run on the other core during this sandbox's own
        start. Below half, the refill starts at once (a burst)."""
        for i, slot in enumerate(self._ready):
            if cpus and slot.cpus == cpus:  # to the front (the others keep their order)
                del self._ready[i]
                self._ready.appendleft(slot)
                break
        while self._ready:
            slot = self._ready.popleft()
            if slot.alive():
                if len(self._ready) + self._spawning <= self.target // 2:
                    self.refill()
                return slot
            await self._drop(slot)
        self.refill()
        return await self.spawn()

    def refill(self) -> None:
        """Start background spawns until ``target`` slots are ready or on their way."""
        if self.closed or time.monotonic() < self._backoff_until:
            return
        while len(self._ready) + self._spawning < self.target:
            self._spawning += 1
            task = asyncio.get_running_loop().create_task(self._spawn_one())
            self._tasks.add(task)
            task.add_done_callback(self._tasks.discard)

    async def _spawn_one(self) -> None:
        try:
            slot = await self.spawn()
        except Exception as exc:  # noqa: BLE001 - a warm slot is an optimisation
            log.warning("could not prepare a warm sandbox slot: %s", exc)
            self._backoff_until = time.monotonic() + SPAWN_BACKOFF_S
            return
        finally:
            self._spawning -= 1
        if self.closed:
            await self._drop(slot)
        else:
            self._ready.append(slot)

    async def _drop(self, slot: Slot) -> None:
        def release(gone: bool) -> None:
            if gone:
                self.uids.release(slot.uid)

        # (even when cancelled: the pool's close waits for the cgroup to be gone)
        release(await finish_in_thread(slot.discard, on_cancel=release))

    def give_back(self, group: Cgroup) -> bool:
        """An ended sandbox's group: kept for a next slot, renamed and reset
        (:func:`~corral.runtime.cgroup_recycle.recycle`: only if empty), or False: the
        caller removes it as before. Blocking: called from a release thread."""
        with self._spare_lock:
            if self.closed or len(self._spare) >= min(SPARE_GROUPS, 2 * self.target):
                return False
        new = recycle(self.cgroups, group, f"{self.cgroup_parent}/slot-{secrets.token_hex(6)}",
                      cpus=DEFAULT_CPUS, memory_mb=DEFAULT_MEMORY_MB, pids=DEFAULT_PIDS)
        if new is None:
            return False
        with self._spare_lock:
            if not self.closed:
                self._spare.append(new)
                return True
        new.remove(children=False)  # the pool closed meanwhile
        return True

    def _spare_group(self) -> Cgroup | None:
        with self._spare_lock:
            return self._spare.popleft() if self._spare else None

    async def spawn(self) -> Slot:
        """Make one slot: a cgroup (a recycled one where the pool has one), a launcher
        that joined it, and its channels."""
        uid = self.uids.acquire()
        cpus = self.cpu_picker.peek(DEFAULT_CPUS) if self.cpu_picker is not None else ()
        devices_set: list[bool] = []

        def make() -> Cgroup:
            group = self._spare_group()
            if group is not None:
                self.recycled += 1
                set_slot_cpus(self.cgroups, group, cpus)  # (its last sandbox's until now)
            else:  # (v1 fills a new group's cpuset with these CPUs: one write, not two)
                group = self.cgroups.create(
                    f"{self.cgroup_parent}/slot-{secrets.token_hex(6)}", cpus=DEFAULT_CPUS,
                    memory_mb=DEFAULT_MEMORY_MB, pids=DEFAULT_PIDS, cpuset=cpus)
                group.recyclable = True
            try:
                if cpus and self.cgroups.version != 1:
                    self.cgroups.set_cpus(group, cpus)
                # v1: a plain sandbox's device list, off its create's path (v2 attaches a
                # program that a GPU sandbox's could not widen: there, after READY)
                if self.cgroups.version == 1:
                    devices_set.append(group.restrict_devices(standard_rules()) == "v1")
            except BaseException:
                group.remove(children=False)
                raise
            return group

        def unmake(group: Cgroup) -> None:  # made after our caller was cancelled
            group.remove(children=False)

        try:
            cgroup = await finish_in_thread(make, on_cancel=unmake)
        except BaseException:
            self.uids.release(uid)  # nothing ran as it
            raise
        ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
        r_ours, r_theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        seccomp_r, seccomp_w = os.pipe()
        ready_r, ready_w = os.pipe()
        go_r, go_w = os.pipe()
        log_r, log_w = os.pipe()
        log_copy = os.dup(log_r)  # (close-on-exec) the warden keeps one: restore.py
        log = LogTail(log_r)
        prelower = self.prelower
        argv = [str(self.agent_path), "launch", "--ready", "--uid", str(uid), "--gid", str(uid),
                "--root-uid", str(root_uid(uid)), "--canonical", str(CANONICAL_UID),
                "--prenet", "1", "--prelower", prelower]
        for procs in cgroup.procs_files():
            argv += ["--cgroup", procs]
        try:
            os.write(seccomp_w, seccomp.build_filter())
            os.close(seccomp_w)
            proc = subprocess.Popen(
                argv, stdin=go_r, stdout=ready_w, stderr=log_w,
                pass_fds=(theirs.fileno(), r_theirs.fileno(), seccomp_r), env={}, cwd="/",
            )
        except BaseException:
            for fd in (go_w, ready_r, log_copy):
                os.close(fd)
            ours.close()
            r_ours.close()
            log.close()
            await finish_in_thread(lambda: unmake(cgroup))
            self.uids.release(uid)  # the launcher never started
            raise
        finally:
            for fd in (seccomp_r, ready_w, go_r, log_w):
                os.close(fd)
            ctl_fd, reattach_fd = theirs.fileno(), r_theirs.fileno()
            theirs.close()
            r_theirs.close()
        log.start()
        slot = Slot(cgroup.path.rsplit("/", 1)[-1], cgroup, proc, ours, ctl_fd, seccomp_r, go_w, log, uid,
                    r_ours, reattach_fd, log_copy, cpus=cpus, devices_set=any(devices_set),
                    prelower=prelower)
        try:
            said = await _read_ready(ready_r)
        except BaseException:  # cancelled: a launcher and its cgroup nobody else knows of
            await self._drop(slot)
            raise
        finally:
            os.close(ready_r)
        slot.own_netns = said == b"N"
        if said not in (b"R", b"N"):
            detail = slot.error_output()
            await self._drop(slot)
            raise SandboxStartError(
                "the sandbox launcher failed before it was used"
                + (f": {detail}" if detail else "")
            )
        return slot

    async def close(self) -> None:
        self.closed = True
        for task in list(self._tasks):
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        slots, self._ready = list(self._ready), deque()
        await asyncio.gather(*(self._drop(s) for s in slots))
        with self._spare_lock:
            spare, self._spare = list(self._spare), deque()
        for group in spare:
            await finish_in_thread(functools.partial(group.remove, children=False))


async def _read_ready(fd: int) -> bytes:
    """Wait for the launcher's "R" (it has joined its cgroups), "N" (that, and it is in
    a network namespace of its own), or EOF (it died: b"")."""
    loop = asyncio.get_running_loop()
    fut: asyncio.Future[bytes] = loop.create_future()

    def on_readable() -> None:
        if not fut.done():
            try:
                fut.set_result(os.read(fd, 1))
            except OSError:
                fut.set_result(b"")

    loop.add_reader(fd, on_readable)
    try:
        return await asyncio.wait_for(fut, 30)
    except asyncio.TimeoutError:
        return b""
    finally:
        loop.remove_reader(fd)
