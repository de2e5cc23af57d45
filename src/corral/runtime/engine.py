"""The sandbox engine: creates, drives and cleans up sandboxes on one host.

One :class:`Engine` owns one state directory. It is asyncio-native; every method that
touches a sandbox is a coroutine. A sandbox is::

    corral-agent launch  (host root, made ahead of time by a SlotPool: joins the
      │                   cgroups; then mounts the root in a private mount namespace,
      │                   drops to the sandbox uid and execs bwrap)
      └─ bwrap           (user, pid, mount, net, ipc, uts, cgroup namespaces; seccomp)
           └─ corral-agent serve   (pid 1 inside; runs commands and file operations)

Example::

    engine = await Engine.open()
    info = await engine.create(SandboxSpec(memory_mb=512, tags=["rl"]))
    result = await engine.exec(info.id, ["python3", "-c", "print(6*7)"], timeout=10)
    snap = await engine.snapshot(info.id, name="configured")  # see corral.runtime.snapshots
    copies = await engine.fork(info.id, 8)
    await engine.delete(info.id)
    await engine.close()
"""

from __future__ import annotations

import asyncio
import errno
import os
import secrets
import shutil
import signal
import subprocess
import time
from contextlib import aclosing, suppress
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, AsyncIterator, Iterable, Sequence

from corral.errors import (
    CorralError,
    FileError,
    FileNotFound,
    FileTooLarge,
    InvalidArgument,
    InvalidState,
    SandboxLost,
    SandboxNotFound,
    SandboxStartError,
    Unsupported,
)
from corral.runtime import cgroups, processes, rootfs, seccomp, storage, sweep, syscalls, warden
from corral.runtime.agentbuild import ensure_agent
from corral.runtime.agentconn import agent_max_output, command_events, ended_error
from corral.runtime.channel import AgentChannel
from corral.runtime.channel import wait_exit as _wait_exit
from corral.runtime.events import Events, SandboxEnded, StateChanged
from corral.runtime.images import Image, ImageStore
from corral.runtime.launcher import DEFAULT_WARM_SLOTS, Slot, SlotPool
from corral.runtime.paths import Layout
from corral.runtime.pathutil import resolve_path
from corral.runtime.protocol import Msg, Tag, decode_entry
from corral.runtime.registry import Registry
from corral.runtime.snapshots import Snapshots
from corral.schema import (
    DEFAULT_EXEC_TIMEOUT_S,
    DEFAULT_MAX_OUTPUT,
    TRANSITIONS,
    ExecEvent,
    ExecResult,
    FileInfo,
    NetworkMode,
    SandboxInfo,
    SandboxSpec,
    SandboxState,
    SnapshotInfo,
)

SANDBOX_UID = 1000  # the user inside every sandbox
SANDBOX_HOME = "/home/sandbox"
# The host uid/gid sandboxes run as: unprivileged, in no group, owning nothing on the
# host but the sandboxes' own writable layers. Shared by all sandboxes so that a
# snapshot taken in one keeps its files writable when restored in another; sandboxes
# are kept apart by their namespaces, not by uid.
SANDBOX_HOST_UID = 1_000_000
START_TIMEOUT_S = 20.0
STOP_WAIT_S = 5.0
REAPER_INTERVAL_S = 0.5
FILE_CHUNK = 1 << 20
DEFAULT_MAX_READ = 64 << 20
BASE_PATH = (
    f"{SANDBOX_HOME}/.local/bin:/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin"
)


ID_PREFIX = "sb-"


def _new_id(prefix: str = ID_PREFIX) -> str:
    return prefix + secrets.token_hex(6)


@dataclass
class _Live:
    """What the engine holds for a sandbox whose processes exist."""

    id: str
    spec: SandboxSpec
    state: SandboxState
    sandbox_dir: Path
    cgroup: Any
    proc: subprocess.Popen | None = None
    channel: AgentChannel | None = None
    started_at: float = 0.0
    last_active: float = field(default_factory=time.monotonic)
    busy: int = 0
    lock: asyncio.Lock = field(default_factory=asyncio.Lock)
    exited: asyncio.Event = field(default_factory=asyncio.Event)
    ending: bool = False
    snapshot_id: str | None = None  # started from it: holds a reference until released
    ro_binds: tuple[tuple[str, str], ...] = ()  # (host path, /.corral/DIR/FILE), read-only
    processes: dict[str, Any] = field(default_factory=dict)  # id -> processes.Process
    log: Any = None  # logtail.LogTail: the launcher's, bwrap's and the agent's stderr


class Engine:
    """Sandboxes on this host. Build one with :meth:`Engine.open`."""

    def __init__(
        self,
        layout: Layout,
        registry: Registry,
        images: ImageStore,
        cgroup_driver: Any,
        agent_path: Path,
        bwrap: str,
        lock_file: Any,
        warm_slots: int = DEFAULT_WARM_SLOTS,
    ) -> None:
        self.layout = layout
        self.registry = registry
        self.images = images
        self.cgroups = cgroup_driver
        self.agent_path = agent_path
        self.bwrap = bwrap
        self._lock_file = lock_file
        self._live: dict[str, _Live] = {}
        self._reaper: asyncio.Task[None] | None = None
        self._warden: warden.Warden | None = None  # thaws and kills if we die
        self._tasks: set[asyncio.Task[Any]] = set()
        self.events = Events()  # StateChanged, SandboxEnded: see runtime/events.py
        self.cgroup_parent = f"corral/{layout.engine_key}"
        self.snapshots = Snapshots(layout, registry, images)
        self._pool = SlotPool(
            agent_path=agent_path,
            cgroups=cgroup_driver,
            cgroup_parent=self.cgroup_parent,
            target=warm_slots,
        )
        self.closed = False
        self.id_prefix = ID_PREFIX

    # ------------------------------------------------------------------ setup

    @classmethod
    async def open(
        cls,
        state_dir: Path | str | None = None,
        cache_dir: Path | str | None = None,
        *,
        warm_slots: int = DEFAULT_WARM_SLOTS,
        id_prefix: str = ID_PREFIX,
    ) -> "Engine":
        """Open the engine on a state directory, reconciling it with reality.

        ``warm_slots`` launchers are kept joined to fresh cgroups, ready to become
        sandboxes (0 turns that off). New sandbox ids start with ``id_prefix`` (a
        cluster's daemons put their node's tag in it, so an id names its node).
        """
        if os.geteuid() != 0:
            raise Unsupported("the corral engine needs root (namespaces, cgroups, mounts)")
        bwrap = shutil.which("bwrap")
        if not bwrap:
            raise Unsupported("bubblewrap is not installed: apt-get install bubblewrap")
        layout = Layout.create(
            Path(state_dir) if state_dir else None, Path(cache_dir) if cache_dir else None
        )
        lock_file = await asyncio.to_thread(warden.acquire_lock, layout.state_dir)
        engine = cls(
            layout,
            Registry(layout.registry_path),
            ImageStore(layout.images_dir),
            cgroups.detect(),
            ensure_agent(layout),
            bwrap,
            lock_file,
            warm_slots,
        )
        engine.id_prefix = id_prefix
        seccomp.build_filter()  # fail now, not at the first create, on an unknown arch
        engine.reconcile()
        engine._warden = warden.Warden.start(lock_file, engine.cgroups, engine.cgroup_parent)
        engine.snapshots.open()
        engine._reaper = asyncio.create_task(engine._reap_loop(), name="corral-reaper")
        engine._pool.refill()
        return engine

    def reconcile(self) -> list[str]:
        """Clean up after a previous owner of this state directory that died.

        Every sandbox the registry thinks is alive is lost (its agent exits when its
        engine does): kill what remains of it, unmount, remove its cgroups, and mark
        it failed with the reason. Then remove leftovers the registry never knew of
        (a crash in the middle of a create). Returns the ids marked failed.
        """
        lost = []
        for sid, state, pid, pid_start, cg_path in self.registry.live_rows():
            if pid and pid_start and syscalls.process_start_time(pid) == pid_start:
                try:
                    os.kill(pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
            if cg_path:
                self._remove_cgroup(cg_path)  # kills what is left, frozen or not
            rootfs.unmount_root(self.layout.sandbox_dir(sid))
            self.registry.set_state(
                sid,
                SandboxState.FAILED,
                f"lost: the engine that ran it stopped unexpectedly while it was {state}; "
                "its processes, mounts and cgroups were cleaned up when the engine restarted",
            )
            lost.append(sid)
        for name in self.cgroups.children(self.cgroup_parent):
            self._remove_cgroup(f"{self.cgroup_parent}/{name}")
        for d in self.layout.sandboxes_dir.iterdir():
            rootfs.unmount_root(d)
        for f in self.layout.slots_dir.iterdir():
            f.unlink(missing_ok=True)
        return lost

    def _remove_cgroup(self, path: str) -> None:
        try:
            self.cgroups.open(path).remove()
        except (OSError, CorralError):
            pass

    async def close(self, *, stop_sandboxes: bool = True) -> None:
        """Stop every sandbox (they cannot outlive their engine) and release the state dir."""
        if self.closed:
            return
        self.closed = True
        if self._reaper:
            self._reaper.cancel()
        if stop_sandboxes:
            await asyncio.gather(
                *(self._end(live, SandboxState.STOPPED, "engine closed", grace=0)
                  for live in list(self._live.values())),
                return_exceptions=True,
            )
        await self._pool.close()
        for t in list(self._tasks):
            t.cancel()
        self._remove_cgroup(self.cgroup_parent)
        self.registry.close()
        if self._warden:
            self._warden.stop()
        self._lock_file.close()

    async def __aenter__(self) -> "Engine":
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()

    # ---------------------------------------------------------------- create

    async def create(
        self, spec: SandboxSpec | dict[str, Any] | None = None, *,
        image_override: Image | None = None, ro_binds: Sequence[tuple[str, str]] = (),
        **kw: Any,
    ) -> SandboxInfo:
        """Create a sandbox and wait until its agent is ready to run commands.

        For image builds (:mod:`corral.runtime.image_build`): ``image_override`` mounts
        an image not in the store (a base plus the layers built so far), and
        ``ro_binds`` puts host files read-only at ``/.corral/DIR/FILE`` (never committed).
        """
        if self.closed:
            raise InvalidState("the engine is closed")
        for _, dest in ro_binds:
            if dest.count("/") != 3 or not dest.startswith(f"/{rootfs.AGENT_DIR}/") or (
                ".." in dest.split("/")
            ):
                raise InvalidArgument(
                    f"ro_binds go to /{rootfs.AGENT_DIR}/DIR/FILE, not {dest!r}")
        if not isinstance(spec, SandboxSpec):
            spec = SandboxSpec.parse(spec, **kw)
        elif kw:
            spec = SandboxSpec.parse(spec.model_dump(exclude_unset=True), **kw)
        sid = _new_id(self.id_prefix)
        spec, snap = self.snapshots.acquire(spec)  # a reference, released by _release
        try:
            image = image_override or self.images.get(spec.image)  # ImageNotFound now
            spec = image.apply_defaults(spec)  # the image's env and workdir, unless set
            lowers = await self.snapshots.lowers(snap, image, self.layout.sandbox_dir(sid))
            slot = await self._pool.take()
        except BaseException as exc:
            await self.snapshots.release(snap)
            if (full := storage.full_error(exc, self.layout.state_dir)) is not None:
                raise full from exc
            raise
        live = _Live(sid, spec, SandboxState.PENDING, self.layout.sandbox_dir(sid), slot.cgroup)
        live.proc = slot.proc
        live.snapshot_id = snap.id if snap else None
        live.ro_binds = tuple((str(src), dest) for src, dest in ro_binds)
        try:
            info = self.registry.insert(sid, spec, slot.cgroup.path)  # a full disk: StorageFull
            self._live[sid] = live
            await self._start(live, slot, lowers)
        except BaseException as exc:
            reason = exc.message if isinstance(exc, CorralError) else f"{type(exc).__name__}: {exc}"
            if slot.go_fd >= 0:
                slot.sock.close()
                await asyncio.to_thread(slot.discard)
            await self._release(live)
            self._live.pop(sid, None)
            with suppress(CorralError):  # a full disk: the restart's reconcile fails the row
                self.registry.delete(sid)  # a failed create leaves nothing, not even a row
            if (full := storage.full_error(exc, self.layout.state_dir)) is not None:
                raise full from exc
            if isinstance(exc, CorralError) or not isinstance(exc, Exception):
                raise
            raise SandboxStartError(f"sandbox failed to start: {reason}") from exc
        info.state = SandboxState.RUNNING
        info.started_at = live.started_at
        return info

    async def _start(self, live: _Live, slot: Slot, lowers: list[Path]) -> None:
        spec = live.spec
        self.cgroups.set_limits(
            slot.cgroup, cpus=spec.cpus, memory_mb=spec.memory_mb, pids=spec.pids
        )
        live.sandbox_dir.mkdir(mode=0o711)
        (live.sandbox_dir / "rw").mkdir()
        (live.sandbox_dir / "root").mkdir()
        live.log = slot.log
        channel = AgentChannel(slot.sock, live.id, proc=slot.proc, cgroup=slot.cgroup)
        live.channel = channel
        channel.on_close = lambda: self._on_agent_exit(live)
        slot.launch(self._launch_args(live, slot, lowers))
        await channel.start()
        try:
            await asyncio.wait_for(asyncio.shield(channel.ready), START_TIMEOUT_S)
        except (CorralError, asyncio.TimeoutError):  # before READY no sandbox code has run
            detail = slot.error_output()
            raise SandboxStartError(
                f"sandbox {live.id} failed to start"
                + (f": {detail}" if detail else " (no error output; see the daemon log)"),
                details={"sandbox_id": live.id},
            ) from None
        live.started_at = self.registry.set_running(
            live.id, slot.proc.pid, syscalls.process_start_time(slot.proc.pid)
        )
        live.state = SandboxState.RUNNING
        live.last_active = time.monotonic()

    def cgroup(self, sandbox_id: str) -> Any:
        """The cgroup of a live sandbox (its usage, its processes)."""
        return self._get_live(sandbox_id).cgroup

    def upper_dir(self, sandbox_id: str) -> Path:
        """The host path of a live sandbox's writable layer (inside its mount namespace)."""
        live = self._get_live(sandbox_id)
        assert live.proc is not None
        # The outer bwrap stays in the launcher's private mount namespace, where the
        # sandbox's tmpfs and overlay are mounted: reach them through its /proc root.
        return Path(f"/proc/{live.proc.pid}/root{live.sandbox_dir}/rw/upper")

    def _launch_args(self, live: _Live, slot: Slot, lowers: list[Path]) -> list[str]:
        """The options a warm launcher still needs: its mounts, uid, and bwrap's argv."""
        spec = live.spec
        argv = [
            "--uid", str(SANDBOX_HOST_UID), "--gid", str(SANDBOX_HOST_UID),
            "--nofile", str(spec.open_files), "--rootdir", str(live.sandbox_dir),
            "--lower", ":".join(str(p) for p in lowers), "--disk-mb", str(spec.disk_mb),
            *rootfs.inode_args(spec.inodes),
        ]
        # bwrap (unprivileged) makes bind mount points in a directory the sandbox owns
        binds = {os.path.dirname(dest) for _, dest in live.ro_binds}
        for d in sorted({SANDBOX_HOME, spec.workdir, *binds} - {"/"}):
            argv += ["--owned", d]
        argv += [
            "--", self.bwrap,
            "--unshare-user", "--unshare-pid", "--unshare-ipc", "--unshare-uts",
            "--unshare-cgroup", "--disable-userns",
            "--uid", str(SANDBOX_UID), "--gid", str(SANDBOX_UID), "--hostname", "sandbox",
            "--bind", str(live.sandbox_dir / "root"), "/",
            "--ro-bind", str(self.agent_path), f"/{rootfs.AGENT_DIR}/agent",
            "--proc", "/proc", "--dev", "/dev",
            "--cap-drop", "ALL", "--new-session", "--die-with-parent", "--as-pid-1",
            "--seccomp", str(slot.seccomp_fd), "--chdir", "/",
        ]
        if spec.network == NetworkMode.NONE:
            argv.append("--unshare-net")
        elif Path("/etc/resolv.conf").exists():
            argv += ["--ro-bind", "/etc/resolv.conf", "/etc/resolv.conf"]
        for src, dest in live.ro_binds:
            argv += ["--ro-bind", src, dest]
        argv += [f"/{rootfs.AGENT_DIR}/agent", "serve", str(slot.ctl_fd)]
        return argv

    # ------------------------------------------------------------- lifecycle

    def _on_agent_exit(self, live: _Live) -> None:
        """The agent's channel closed. Unless we are ending it, the sandbox died."""
        if live.ending:
            return
        task = asyncio.get_running_loop().create_task(
            self._end(live, SandboxState.FAILED, self._death_reason(live), grace=0)
        )
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    def _death_reason(self, live: _Live) -> str:
        # Who ended it (the sandbox itself: "sandbox fault: ...") is the channel's call.
        why = live.channel.reason if live.channel else "the sandbox's agent exited unexpectedly"
        log = live.log.text()[-2000:] if live.log is not None else ""
        return why + (f"; its log: {log}" if log else "")

    def _get_live(self, sandbox_id: str) -> _Live:
        live = self._live.get(sandbox_id)
        if live is None:
            info = self.registry.get(sandbox_id)
            if info is None:
                raise SandboxNotFound(
                    f"no sandbox {sandbox_id!r}: it never existed or was deleted "
                    "(list sandboxes to see what exists)",
                    details={"sandbox_id": sandbox_id},
                )
            raise ended_error(info)  # its own fault: SandboxProtocolError
        return live

    def _running(self, sandbox_id: str) -> _Live:
        live = self._get_live(sandbox_id)
        if live.channel is not None and live.channel.faulted:
            raise live.channel.error_copy()  # being ended by its own doing
        if live.state != SandboxState.RUNNING or live.channel is None:
            hint = "resume it first" if live.state == SandboxState.PAUSED else "create a new one"
            raise InvalidState(
                f"sandbox {sandbox_id} is {live.state.value}: {hint}",
                details={"sandbox_id": sandbox_id, "state": live.state.value},
            )
        live.last_active = time.monotonic()
        return live

    def _transition(self, live: _Live, to: SandboxState, reason: str | None = None) -> None:
        if to not in TRANSITIONS[live.state]:
            raise InvalidState(
                f"sandbox {live.id} cannot go from {live.state.value} to {to.value}",
                details={"sandbox_id": live.id, "state": live.state.value},
            )
        self.registry.set_state(live.id, to, reason)  # first: a full disk changes nothing
        old, live.state = live.state, to
        self.events.emit(StateChanged(live.id, old, to, reason))

    async def pause(self, sandbox_id: str) -> SandboxInfo:
        """Freeze every process of the sandbox (cgroup freezer). Memory stays resident."""
        live = self._get_live(sandbox_id)
        async with live.lock:
            if live.state != SandboxState.PAUSED:
                self._transition(live, SandboxState.PAUSED)
                live.cgroup.freeze()
        return self.get(sandbox_id)

    async def resume(self, sandbox_id: str) -> SandboxInfo:
        live = self._get_live(sandbox_id)
        async with live.lock:
            if live.state == SandboxState.PAUSED:
                self._transition(live, SandboxState.RUNNING)  # StorageFull: still paused
                live.cgroup.thaw()
                live.last_active = time.monotonic()
            elif live.state != SandboxState.RUNNING:
                self._transition(live, SandboxState.RUNNING)  # raises InvalidState
        return self.get(sandbox_id)

    async def stop(
        self, sandbox_id: str, *, grace: float = 2.0, reason: str = "stopped by request"
    ) -> SandboxInfo:
        """Stop: SIGTERM to running commands, SIGKILL after ``grace`` seconds, release
        mounts and cgroups. The record stays (state ``stopped``) until deleted."""
        live = self._live.get(sandbox_id)
        if live is None:
            info = self.get(sandbox_id)  # raises SandboxNotFound
            if info.state.terminal:
                return info
        else:
            await self._end(live, SandboxState.STOPPED, reason, grace=grace)
        return self.get(sandbox_id)

    async def delete(self, sandbox_id: str) -> bool:
        """Kill and remove a sandbox and its record. Idempotent: False if it did not exist."""
        live = self._live.get(sandbox_id)
        if live is not None:
            await self._end(live, SandboxState.STOPPED, "deleted", grace=0)
        existed = live is not None or self.registry.get(sandbox_id) is not None
        self.registry.delete(sandbox_id)
        return existed

    async def _end(self, live: _Live, final: SandboxState, reason: str, *, grace: float) -> None:
        async with live.lock:
            if live.ending or live.id not in self._live:
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
            finally:
                await self._release(live)
                self._live.pop(live.id, None)
            try:
                if live.state == SandboxState.PENDING:
                    live.state = final
                else:
                    self._transition(live, final, reason)
            finally:
                self.events.emit(SandboxEnded(live.id, final, reason))

    async def _release(self, live: _Live) -> None:
        """Kill every process, then unmount and remove the cgroup. Never raises."""
        live.ending = True
        if live.cgroup is not None:
            try:
                if live.cgroup.frozen() or (live.channel and live.channel.faulted):
                    # Frozen processes (or a stuck agent) cannot see their channel
                    # close: kill them now rather than waiting STOP_WAIT_S for an exit.
                    await asyncio.to_thread(live.cgroup.kill_all)
            except (OSError, CorralError):
                pass
        if live.channel is not None:
            await live.channel.close()
        if live.proc is not None:
            try:
                await asyncio.wait_for(_wait_exit(live.proc), STOP_WAIT_S)
            except asyncio.TimeoutError:
                pass
        if live.log is not None:
            live.log.close()
        # Removing cgroups and unmounting are blocking syscalls of a few ms each: in a
        # thread, many teardowns overlap (and use both cores) instead of queueing.
        await asyncio.to_thread(self._release_resources, live)
        snapshot_id, live.snapshot_id = live.snapshot_id, None
        await self.snapshots.release(snapshot_id)

    @staticmethod
    def _release_resources(live: _Live) -> None:
        if live.cgroup is not None:
            try:
                live.cgroup.remove(children=False)
            except (OSError, CorralError):
                pass
        if live.proc is not None and live.proc.poll() is None:
            live.proc.kill()
            live.proc.wait()
        rootfs.remove_dirs(live.sandbox_dir)

    async def _reap_loop(self) -> None:
        """End sandboxes past their lifetime (``timeout``) or idle for ``idle_timeout``."""
        while True:
            await asyncio.sleep(REAPER_INTERVAL_S)
            now_wall, now = time.time(), time.monotonic()
            for live in list(self._live.values()):
                if live.ending or live.state not in (SandboxState.RUNNING, SandboxState.PAUSED):
                    continue
                spec = live.spec
                reason = None
                if live.started_at and now_wall - live.started_at > spec.timeout:
                    reason = f"timeout: its lifetime of {spec.timeout:g} s ran out"
                elif (
                    spec.idle_timeout
                    and live.state == SandboxState.RUNNING
                    and live.busy == 0
                    and now - live.last_active > spec.idle_timeout
                ):
                    reason = f"idle timeout: no activity for {spec.idle_timeout:g} s"
                if reason:
                    task = asyncio.create_task(
                        self._end(live, SandboxState.STOPPED, reason, grace=0)
                    )
                    self._tasks.add(task)
                    task.add_done_callback(self._tasks.discard)

    # ------------------------------------------------------------- snapshots

    async def snapshot(self, sandbox_id: str, name: str | None = None) -> SnapshotInfo:
        """Commit a sandbox's files as a snapshot that new sandboxes start from
        (``create(snapshot=...)``). Its processes are frozen while its writable layer is
        copied (a paused sandbox stays paused), then go on. See
        :mod:`corral.runtime.snapshots`."""
        self.snapshots.check_name(name)
        live = self._get_live(sandbox_id)
        async with live.lock:
            if live.ending or live.state not in (SandboxState.RUNNING, SandboxState.PAUSED):
                raise InvalidState(
                    f"sandbox {sandbox_id} is {live.state.value}: only a running or paused "
                    "sandbox can be snapshotted",
                    details={"sandbox_id": sandbox_id, "state": live.state.value},
                )
            cgroup = None if live.state == SandboxState.PAUSED else live.cgroup
            upper = self.upper_dir(sandbox_id)
            staged = await self.snapshots.stage(upper, cgroup, source=sandbox_id, spec=live.spec)
        return await self.snapshots.commit(
            staged, name=name, spec=live.spec, parent=live.snapshot_id, source=sandbox_id
        )

    async def fork(self, sandbox_id: str, n: int) -> list[SandboxInfo]:
        """``n`` new sandboxes with a copy of this one's files and its spec, made
        concurrently from a snapshot that goes away when the last of them ends.
        All or nothing: if one fails to start, the others are deleted."""
        if not isinstance(n, int) or n < 1:
            raise InvalidArgument(f"fork needs n >= 1 copies, got {n!r}")
        snap = await self.snapshot(sandbox_id)
        spec = self.fork_spec(sandbox_id, snap.id)
        try:
            made = await asyncio.gather(
                *(self.create(spec) for _ in range(n)), return_exceptions=True
            )
        finally:
            await self.snapshots.delete(snap.id)  # deferred while the copies run
        failed = [r for r in made if isinstance(r, BaseException)]
        if failed:
            await asyncio.gather(*(self.delete(r.id) for r in made if isinstance(r, SandboxInfo)))
            raise failed[0]
        return made  # type: ignore[return-value]

    def fork_spec(self, sandbox_id: str, snapshot_id: str) -> SandboxSpec:
        """The spec of a copy of ``sandbox_id`` started from its snapshot: its own, with
        its secrets, which only the live sandbox holds (the registry keeps them masked)."""
        live = self._live.get(sandbox_id)
        secrets = live.spec.secrets if live is not None else {}
        return self.get(sandbox_id).spec.model_copy(
            update={"snapshot": snapshot_id, "secrets": secrets}
        )

    def resolve_spec(self, spec: SandboxSpec) -> SandboxSpec:
        """The effective spec of a sandbox created from ``spec``: with ``snapshot``, the
        fields not given come from the snapshot (:class:`SnapshotNotFound` if none)."""
        return self.snapshots.resolve(spec)

    def list_snapshots(self) -> list[SnapshotInfo]:
        return self.snapshots.list()

    def get_snapshot(self, id_or_name: str) -> SnapshotInfo:
        """A snapshot by id or name; :class:`SnapshotNotFound` if there is none."""
        return self.snapshots.get(id_or_name)

    async def delete_snapshot(self, id_or_name: str) -> bool:
        """Delete a snapshot. Sandboxes started from it keep running; its layers are
        removed when the last of them ends. Idempotent: False if it did not exist."""
        return await self.snapshots.delete(id_or_name)

    async def verify_snapshot(self, id_or_name: str) -> SnapshotInfo:
        """Re-read a snapshot's layers against their checksums (:class:`InvalidState`
        if one was changed on disk). Done by itself before a layer's first use after a
        restart."""
        return await self.snapshots.verify(id_or_name)

    async def gc_layers(self) -> list[str]:
        """Remove the layers no snapshot or sandbox references; returns their ids."""
        return await self.snapshots.gc()

    # ----------------------------------------------------------------- query

    def get(self, sandbox_id: str) -> SandboxInfo:
        info = self.registry.get(sandbox_id)
        if info is None:
            raise SandboxNotFound(
                f"no sandbox {sandbox_id!r}: it never existed or was deleted",
                details={"sandbox_id": sandbox_id},
            )
        return info

    def list(
        self,
        *,
        tags: Iterable[str] = (),
        state: SandboxState | str | Iterable[SandboxState | str] | None = None,
    ) -> list[SandboxInfo]:
        """Sandboxes carrying every tag in ``tags``, in any of the given states."""
        if state is None:
            states: list[SandboxState] = []
        elif isinstance(state, (str, SandboxState)):
            states = [_state(state)]
        else:
            states = [_state(s) for s in state]
        return self.registry.list(tags=list(tags), states=states)

    def usage(self, sandbox_id: str) -> dict[str, float]:
        """Current CPU seconds and memory (MB) of a live sandbox."""
        live = self._get_live(sandbox_id)
        return {
            "cpu_seconds": live.cgroup.cpu_seconds(),
            "memory_mb": live.cgroup.memory_bytes() / (1 << 20),
        }

    def counts(self) -> dict[str, int]:
        return self.registry.counts()

    # ------------------------------------------------------------------ exec

    async def exec(
        self,
        sandbox_id: str,
        cmd: str | Sequence[str],
        *,
        timeout: float | None = DEFAULT_EXEC_TIMEOUT_S,
        env: dict[str, str] | None = None,
        cwd: str | None = None,
        stdin: bytes | str | None = None,
        max_output: int = DEFAULT_MAX_OUTPUT,
    ) -> ExecResult:
        """Run a command to completion; a timeout or OOM kill is a result, not an error."""
        out: list[bytes] = []
        err: list[bytes] = []
        async for ev in self.exec_stream(
            sandbox_id, cmd, timeout=timeout, env=env, cwd=cwd, stdin=stdin,
            max_output=max_output,
        ):
            if ev.kind == "stdout":
                out.append(ev.data)
            elif ev.kind == "stderr":
                err.append(ev.data)
            else:
                assert ev.result is not None
                ev.result.stdout, ev.result.stderr = b"".join(out), b"".join(err)
                return ev.result
        raise SandboxLost(f"sandbox {sandbox_id}: the command's stream ended without an exit")

    async def exec_stream(
        self,
        sandbox_id: str,
        cmd: str | Sequence[str],
        *,
        timeout: float | None = DEFAULT_EXEC_TIMEOUT_S,
        env: dict[str, str] | None = None,
        cwd: str | None = None,
        stdin: bytes | str | None = None,
        max_output: int = DEFAULT_MAX_OUTPUT,
    ) -> AsyncIterator[ExecEvent]:
        """Run a command and yield its output as it happens, then its exit.

        Closing the iterator early (or cancelling the task) kills the command's
        process group. The engine caps the output and enforces the timeout itself,
        whatever the agent says (:mod:`corral.runtime.agentconn`).
        """
        live = self._running(sandbox_id)
        fields = self._exec_fields(live, cmd, timeout, env, cwd, stdin, max_output)
        assert live.channel is not None
        oom_before = live.cgroup.oom_kills()
        stream = live.channel.open_exec(fields, max_output=max_output)
        live.busy += 1
        try:
            async with aclosing(
                command_events(live, stream, timeout, cwd, oom_before)
            ) as events:
                async for ev in events:
                    yield ev
        finally:
            live.busy -= 1
            live.last_active = time.monotonic()

    def _exec_fields(
        self,
        live: _Live,
        cmd: str | Sequence[str],
        timeout: float | None,
        env: dict[str, str] | None,
        cwd: str | None,
        stdin: bytes | str | None,
        max_output: int,
    ) -> list[tuple[int, Any]]:
        if isinstance(cmd, str):
            if not cmd.strip():
                raise InvalidArgument("empty command: pass a shell string or an argv list")
            argv = ["/bin/sh", "-c", cmd]
        else:
            argv = list(cmd)
            if not argv or not all(isinstance(a, str) for a in argv):
                raise InvalidArgument("cmd must be a non-empty list of strings or a shell string")
        if any("\0" in a for a in argv):
            raise InvalidArgument("command arguments may not contain NUL bytes")
        if timeout is not None and not (0 < timeout <= 86400 * 30):
            raise InvalidArgument(f"timeout must be > 0 seconds (or None), got {timeout}")
        if max_output < 0:
            raise InvalidArgument("max_output must be >= 0 bytes")
        full_env = {
            "PATH": BASE_PATH, "HOME": SANDBOX_HOME, "USER": "sandbox", "LOGNAME": "sandbox",
            "LANG": "C.UTF-8", "SHELL": "/bin/sh", "PWD": cwd or live.spec.workdir,
            **live.spec.env, **live.spec.secret_env(), **(env or {}),
        }
        for k, v in full_env.items():
            if not isinstance(k, str) or not isinstance(v, str) or "=" in k or "\0" in k + v:
                raise InvalidArgument(f"invalid environment variable {k!r}")
        fields: list[tuple[int, Any]] = [(Tag.ARGV, a) for a in argv]
        fields += [(Tag.ENV, f"{k}={v}") for k, v in full_env.items()]
        fields.append((Tag.CWD, resolve_path(live.spec.workdir, cwd or live.spec.workdir)))
        if timeout is not None:
            fields.append((Tag.TIMEOUT_MS, max(1, int(timeout * 1000))))
        fields.append((Tag.MAX_OUTPUT, agent_max_output(max_output)))
        if stdin:
            fields.append((Tag.STDIN, stdin.encode() if isinstance(stdin, str) else stdin))
        return fields

    # ------------------------------------------------------------- processes

    async def spawn(
        self,
        sandbox_id: str,
        cmd: str | Sequence[str],
        *,
        env: dict[str, str] | None = None,
        cwd: str | None = None,
        timeout: float | None = None,
        max_buffer: int = processes.DEFAULT_MAX_BUFFER,
    ) -> processes.Process:
        """Start an interactive process: stdin stays open, output is read as it comes.

        Returns a :class:`~corral.runtime.processes.Process` (``write``, ``close_stdin``,
        ``signal``, ``kill``, ``output()``, ``wait``); it dies with its sandbox.
        ``timeout`` (seconds, ``None``: none) kills it like an exec's; ``max_buffer``
        bounds the output kept unread (per stream). See :mod:`corral.runtime.processes`.
        """
        live = self._running(sandbox_id)
        return await processes.spawn(
            self, live, cmd, env=env, cwd=cwd, timeout=timeout, max_buffer=max_buffer
        )

    def get_process(self, sandbox_id: str, process_id: str) -> processes.Process:
        """A process of a live sandbox by id; :class:`~corral.errors.NotFound` if none."""
        return processes.find(self._get_live(sandbox_id), process_id)

    def list_processes(self, sandbox_id: str) -> list[processes.Process]:
        """The processes of a live sandbox (running, and recently exited), oldest first."""
        return list(self._get_live(sandbox_id).processes.values())

    def forget_process(self, sandbox_id: str, process_id: str) -> None:
        """Drop an exited process's record (a running one is killed first by the caller)."""
        live = self._live.get(sandbox_id)
        if live is not None:
            processes.forget(live, process_id)

    # ----------------------------------------------------------------- files

    async def _file_request(self, sandbox_id: str, msg: Msg, path: str, fields: list) -> Any:
        live = self._running(sandbox_id)
        assert live.channel is not None
        live.busy += 1
        try:
            reply = await live.channel.request(  # validated; its data no more than asked
                msg, [(Tag.PATH, path), *fields], max_data=FILE_CHUNK if msg == Msg.FREAD else None
            )
        finally:
            live.busy -= 1
            live.last_active = time.monotonic()
        if reply.msg == Msg.ERR:
            raise _file_error(sandbox_id, path, reply.fields)
        return reply.fields

    def _path(self, sandbox_id: str, path: str) -> str:
        live = self._get_live(sandbox_id)
        return resolve_path(live.spec.workdir, path)

    async def write_file(
        self, sandbox_id: str, path: str, data: bytes | str, *, mode: int = 0o644,
        parents: bool = True,
    ) -> None:
        """Write a file inside the sandbox (as its user), creating parent directories."""
        p = self._path(sandbox_id, path)
        if isinstance(data, str):
            data = data.encode()
        if not 0 <= mode <= 0o7777:
            raise InvalidArgument(f"invalid file mode {mode:o}")
        view = memoryview(data)
        offset = 0
        while True:
            chunk = view[offset : offset + FILE_CHUNK]
            await self._file_request(
                sandbox_id, Msg.FWRITE, p,
                [(Tag.DATA, chunk), (Tag.OFFSET, offset), (Tag.TRUNCATE, offset == 0),
                 (Tag.MODE, mode), (Tag.PARENTS, parents)],
            )
            offset += len(chunk)
            if offset >= len(data):
                return

    async def read_file(
        self, sandbox_id: str, path: str, *, max_bytes: int = DEFAULT_MAX_READ
    ) -> bytes:
        """Read a whole file; :class:`FileTooLarge` if it is bigger than ``max_bytes``."""
        p = self._path(sandbox_id, path)
        parts: list[bytes] = []
        offset = 0
        while True:
            f = await self._file_request(
                sandbox_id, Msg.FREAD, p, [(Tag.OFFSET, offset), (Tag.LENGTH, FILE_CHUNK)]
            )
            size = f.u64(Tag.SIZE)
            if size > max_bytes:
                raise FileTooLarge(
                    f"{p} in sandbox {sandbox_id} is {size} bytes, over the {max_bytes}-byte "
                    "read limit: raise max_bytes or read it in parts",
                    details={"path": p, "size": size, "limit": max_bytes},
                )
            data = f.raw(Tag.DATA)
            parts.append(data)
            offset += len(data)
            if len(data) < FILE_CHUNK or offset >= size:
                return b"".join(parts)

    async def list_dir(self, sandbox_id: str, path: str = ".") -> list[FileInfo]:
        p = self._path(sandbox_id, path)
        f = await self._file_request(sandbox_id, Msg.FLIST, p, [])
        infos = [_file_info(p, raw, child=True) for raw in f.all(Tag.ENTRY)]
        return sorted(infos, key=lambda i: i.name)

    async def stat(self, sandbox_id: str, path: str) -> FileInfo:
        p = self._path(sandbox_id, path)
        f = await self._file_request(sandbox_id, Msg.FSTAT, p, [])
        return _file_info(p, f.raw(Tag.ENTRY), child=False)

    async def remove(self, sandbox_id: str, path: str, *, recursive: bool = False) -> None:
        p = self._path(sandbox_id, path)
        if p == "/":
            raise InvalidArgument("refusing to remove the sandbox's root directory")
        await self._file_request(sandbox_id, Msg.FREMOVE, p, [(Tag.RECURSIVE, recursive)])

    async def mkdir(
        self, sandbox_id: str, path: str, *, parents: bool = True, mode: int = 0o755
    ) -> None:
        p = self._path(sandbox_id, path)
        await self._file_request(
            sandbox_id, Msg.FMKDIR, p, [(Tag.PARENTS, parents), (Tag.MODE, mode)]
        )

    async def kill_processes(self, sandbox_id: str) -> int:
        """SIGKILL every process the sandbox's code started (the agent stays; running
        commands end killed); how many there were. See :mod:`corral.runtime.sweep`."""
        live = self._running(sandbox_id)
        assert live.proc is not None
        return await asyncio.to_thread(sweep.kill_sandbox_code, live.cgroup, live.proc.pid)


def _state(s: SandboxState | str) -> SandboxState:
    try:
        return SandboxState(s)
    except ValueError:
        raise InvalidArgument(
            f"unknown state {s!r}: use one of {', '.join(x.value for x in SandboxState)}"
        ) from None


def _file_info(parent: str, raw: bytes, *, child: bool) -> FileInfo:
    import stat as st

    mode, size, mtime, _uid, _gid, name = decode_entry(raw)
    path = (parent.rstrip("/") + "/" + name) if child else name
    return FileInfo(
        path=path,
        name=name if child else (path.rsplit("/", 1)[-1] or "/"),
        size=size,
        mode=st.S_IMODE(mode),
        mtime=mtime / 1e9,
        is_dir=st.S_ISDIR(mode),
        is_symlink=st.S_ISLNK(mode),
    )


def _file_error(sandbox_id: str, path: str, f: Any) -> CorralError:
    err = f.u64(Tag.ERRNO)
    details = {"sandbox_id": sandbox_id, "path": path, "errno": err}
    if err == errno.ENOENT:
        return FileNotFound(f"no such file or directory in sandbox {sandbox_id}: {path}", details=details)
    hint = {
        errno.EACCES: "permission denied (the image's files are read-only; write under "
        f"{SANDBOX_HOME}, /workspace, /tmp or a directory you created)",
        errno.ENOSPC: "the sandbox's disk is full (raise disk_mb)",
        errno.EISDIR: "it is a directory",
        errno.ENOTDIR: "a part of the path is not a directory",
        errno.ENOTEMPTY: "the directory is not empty (remove it with recursive=True)",
        errno.EEXIST: "it already exists",
        errno.EROFS: "read-only file system",
    }.get(err, f.text(Tag.MESSAGE))
    return FileError(f"{path} in sandbox {sandbox_id}: {hint}", details=details)
