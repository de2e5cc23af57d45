"""The sandbox engine: creates, drives and cleans up sandboxes on one host.

One :class:`Engine` owns one state directory. It is asyncio-native; every method that
touches a sandbox is a coroutine. A sandbox is::

    corral-agent launch  (host root, made ahead of time by a SlotPool: joins the
      │                   cgroups; then mounts the root in a private mount namespace,
      │                   drops to the sandbox's own host uid and execs bwrap)
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
import os
import secrets
import shutil
from collections.abc import Callable
from contextlib import AbstractAsyncContextManager, nullcontext, suppress
from pathlib import Path
from typing import IO, Any, Sequence

from corral.errors import (
    CorralError,
    InvalidArgument,
    InvalidState,
    SandboxStartError,
    Unsupported,
)
from corral.runtime import (
    cgroups,
    devices,
    live_processes,
    rootfs,
    seccomp,
    storage,
    syscalls,
    users,
    warden,
)
from corral.runtime.agentbuild import ensure_agent
from corral.runtime.cgroup_sweep import KeyLock, Swept, sweep
from corral.runtime.cgroups import Cgroup, CgroupDriver
from corral.runtime.channel import AgentChannel
from corral.runtime.cpus import CpuPicker
from corral.runtime.criu_gate import CriuGate, criu_concurrency
from corral.runtime.diskimage import make_image
from corral.runtime.engine_commands import BASE_PATH, CommandOps  # noqa: F401
from corral.runtime.engine_end import (  # noqa: F401
    HANG_UP_BATCH,
    HANG_UP_THREADS,
    RELEASE_THREADS,
    STOP_WAIT_S,
    TRIM_AFTER_BYTES,
    EndOps,
    release_pool,
)
from corral.runtime.engine_files import FileOps
from corral.runtime.engine_hibernate import HibernateOps
from corral.runtime.engine_lifetime import LifetimeOps
from corral.runtime.engine_live import LiveOps
from corral.runtime.engine_network import NetworkOps
from corral.runtime.engine_queries import QueryOps
from corral.runtime.engine_restore import RestoreOps, lock_taking_over
from corral.runtime.engine_snapshots import SnapshotOps
from corral.runtime.engine_volumes import VolumeOps
from corral.runtime.events import Events, SandboxDeleted, SandboxEnded, SandboxStarted
from corral.runtime.gpus import GpuAllocator, GpuBackend, StaticBackend
from corral.runtime.gpus import detect as detect_gpus
from corral.runtime.images import Image, ImageStore
from corral.runtime.kept_files import KeptFiles
from corral.runtime.launchargs import launch_args
from corral.runtime.launcher import DEFAULT_WARM_SLOTS, Slot, SlotPool
from corral.runtime.live import Live
from corral.runtime.net import NetworkManager, netns
from corral.runtime.networks import Networks
from corral.runtime.output_budget import OutputBudget
from corral.runtime.ownership import UNSET, OwnerArg, Owners
from corral.runtime.paths import Layout, cgroup_lock_dir, uid_lock_dir
from corral.runtime.reconcile import engine_cgroup_parent, remove_cgroup
from corral.runtime.registry import Registry
from corral.runtime.restore import DEFAULT_RESTORE_GRACE_S  # noqa: F401 (re-exported)
from corral.runtime.secret_store import SecretStore
from corral.runtime.snapshots import Snapshots
from corral.runtime.startup import open_layout, settle_process, unreachable_ancestor
from corral.runtime.threadwork import ThreadBatch, finish_in_thread
from corral.runtime.uids import (  # noqa: F401  (SANDBOX_UID re-exported)
    CANONICAL_UID,
    SANDBOX_HOME,
    SANDBOX_UID,
    UidBlock,
    canonical_owner,
)
from corral.runtime.volumes import Volumes
from corral.schema import (
    SandboxInfo,
    SandboxSpec,
    SandboxState,
    Storage,
)

# Owner of the sandbox user's files in layers on disk; each sandbox runs as a host uid
# of its own, which its idmapped layers show them as (see corral.runtime.uids).
SANDBOX_HOST_UID = CANONICAL_UID
START_TIMEOUT_S = 20.0


ID_PREFIX = "sb-"


def _new_id(prefix: str = ID_PREFIX) -> str:
    return prefix + secrets.token_hex(6)


class Engine(HibernateOps, LiveOps, SnapshotOps, CommandOps, FileOps, NetworkOps, VolumeOps,
             RestoreOps, LifetimeOps, QueryOps, EndOps):
    """Sandboxes on this host. Build one with :meth:`Engine.open`.

    This class keeps opening, closing and creating, and what a sandbox is
    (:class:`~corral.runtime.live.Live`); finding one for its owner, pausing, stopping
    and deleting it are in :mod:`.engine_end`, its commands, files and snapshots in
    :mod:`.engine_commands`, :mod:`.engine_files` and :mod:`.engine_snapshots`."""

    def __init__(
        self,
        layout: Layout,
        registry: Registry,
        images: ImageStore,
        cgroup_driver: CgroupDriver,
        agent_path: Path,
        bwrap: str,
        lock_file: IO[str],
        uid_block: UidBlock,
        warm_slots: int = DEFAULT_WARM_SLOTS,
        network_hosts: dict[str, str] | None = None,
        restore_grace: float = 0.0,
    ) -> None:
        self.layout = layout
        self.registry = registry
        self.images = images
        self.cgroups = cgroup_driver
        self.agent_path = agent_path
        self.bwrap = bwrap
        self._lock_file = lock_file
        self.uids = uid_block  # this engine's sandbox uids, machine-wide unique
        self.cpu_picker = CpuPicker()  # the CPUs each sandbox runs on
        self.criu_gate = CriuGate(criu_concurrency())  # CRIU dumps and restores at once
        # commands' output held in memory, per tenant and in all (the server sets its size)
        self.output_budget = OutputBudget()
        self._live: dict[str, Live] = {}
        self._handed_links: dict[str, netns.Link] = {}  # live restore: engine_restore.py
        self._reaper: asyncio.Task[None] | None = None
        self._warden: warden.Warden | None = None  # thaws and kills if we die
        self._tasks: set[asyncio.Task[Any]] = set()
        # unmounts and cgroup removals of ending sandboxes (engine_end.RELEASE_THREADS)
        self._releasers = release_pool()
        self._hang_ups = release_pool(HANG_UP_THREADS, "corral-hang-up")  # (engine_end)
        self._agent_stops = ThreadBatch(self._hang_ups, HANG_UP_BATCH)
        self._teardowns: set[asyncio.Future[None]] = set()  # deletes' last steps (engine_end)
        self.events = Events()  # StateChanged, SandboxEnded: see runtime/events.py
        self._hibernated: dict[str, str] = {}  # sandbox id -> checkpoint (engine_hibernate)
        # resumes under way: set when each ends, and its task (delete waits: engine_end)
        self._resuming: dict[str, tuple[asyncio.Event, asyncio.Task[Any] | None, str | None]] = {}
        self._checkpoint_turns: dict[str | None, asyncio.Lock] = {}  # (engine_live)
        # seconds a sandbox may still live under its owner's maximum (the server's): a
        # hibernated one resumes within it (engine_hibernate.py); None: no maximum
        self.lifetime_cap: Callable[[SandboxInfo], float] | None = None
        # room for a hibernated sandbox to start again, held while its resume restores
        # it (the server's admission control: service.py); None: no caps
        self.resume_gate: Callable[[SandboxInfo], AbstractAsyncContextManager[object]] | None = None
        self.events.subscribe(SandboxEnded, self._hibernated_ended)
        # secrets in clear for the next engine, root-only (runtime/secret_store.py)
        self.secret_store = SecretStore(layout.state_dir / "secrets")
        self.events.subscribe(SandboxEnded, lambda e: self.secret_store.remove(e.sandbox_id))
        self.events.subscribe(SandboxDeleted, lambda e: self.secret_store.remove(e.sandbox_id))
        self.owners = Owners()  # who sees what: runtime/ownership.py
        self.cgroup_parent = engine_cgroup_parent(cgroup_driver, layout.engine_key)
        self.cgroup_key: KeyLock | None = None  # held while the groups are ours (Engine.open)
        self.swept: Swept | None = None  # dead engines' groups removed at open (cgroup_sweep)
        self.snapshots = Snapshots(layout, registry, images, self.owners)
        self.kept = KeptFiles(layout.state_dir / "stopped", self.snapshots, self.events)
        self._pool = SlotPool(
            agent_path=agent_path,
            cgroups=cgroup_driver,
            cgroup_parent=self.cgroup_parent,
            target=warm_slots,
            uids=self.uids,
            cpu_picker=self.cpu_picker,
        )
        # egress policies (runtime/net): names in network_hosts resolve to their address
        self.volumes = Volumes(layout.state_dir / "volumes")  # runtime/volumes.py
        self.networks = Networks(layout.state_dir / "networks")  # runtime/networks.py
        kept_held = self.snapshots.also_held  # volumes count against max_snapshot_mb too
        self.snapshots.also_held = lambda owner: (kept_held(owner) + self.volumes.used_bytes(owner)
                                                  + self.images_bytes(owner))  # engine_live.py
        self.net = NetworkManager(layout.engine_key, uid_lock_dir().parent / "net",
                                  hosts=network_hosts)
        self.closed = False
        self.id_prefix = ID_PREFIX
        self.restore_grace = restore_grace  # live restore: runtime/restore.py
        # Ended sandboxes (and their kept files) are deleted this long after they ended
        # (None: kept until deleted).
        self.retention: float | None = None
        self.unreachable: str | None = None  # why sandboxes cannot reach their roots (open)
        self.gpus = GpuAllocator(StaticBackend())  # Engine.open: the host's (runtime.gpus)

    # ------------------------------------------------------------------ setup

    @classmethod
    async def open(
        cls,
        state_dir: Path | str | None = None,
        cache_dir: Path | str | None = None,
        *,
        warm_slots: int = DEFAULT_WARM_SLOTS,
        id_prefix: str = ID_PREFIX,
        network_hosts: dict[str, str] | None = None,
        restore_grace: float = 0.0,
        gpus: GpuBackend | None = None,
    ) -> "Engine":
        """Open the engine on a state directory, reconciling it with reality.

        ``warm_slots`` launchers are kept joined to cgroups of their own, ready to become
        sandboxes (0 turns that off). New sandbox ids start with ``id_prefix`` (a
        cluster's daemons put their node's tag in it, so an id names its node).
        ``network_hosts``: names the resolver of policy sandboxes answers with these
        addresses, not the host's resolver's (docs/network.md).
        ``gpus``: the GPU inventory (default: the host's, through NVML, if any).

        Live restore (:mod:`corral.runtime.restore`): the running and paused
        sandboxes of the previous engine on this state directory are adopted if its
        warden still keeps them; with ``restore_grace`` > 0 this engine's warden keeps
        this engine's for that many seconds after it dies or closes with ``handover``.
        """
        if os.geteuid() != 0:
            raise Unsupported("the corral engine needs root (namespaces, cgroups, mounts)")
        bwrap = shutil.which("bwrap")
        if not bwrap:
            raise Unsupported("bubblewrap is not installed: apt-get install bubblewrap")
        settle_process()  # whatever the parent handed down (startup.py)
        layout = open_layout(state_dir, cache_dir)  # StorageFull if no room to start
        lock_file, handover = await asyncio.to_thread(lock_taking_over, layout.state_dir)
        for staged in layout.state_dir.glob(".volume-upload-*"):  # a killed daemon's archives
            staged.unlink(missing_ok=True)  # (server/volume_stream.py): no request holds them
        try:  # the engine's cgroups are its own from here (runtime/cgroup_sweep.py)
            if handover is not None and handover.key_fd >= 0:  # (its warden's, shared)
                key_lock = KeyLock(cgroup_lock_dir(), layout.engine_key, handover.key_fd)
            else:
                key_lock = await asyncio.to_thread(KeyLock.take, cgroup_lock_dir(),
                                                   layout.engine_key)
        except BaseException:
            lock_file.close()
            raise
        try:
            if handover is not None and handover.uids_fd >= 0:
                uid_block = UidBlock.adopt(handover.uids_fd)
            else:
                uid_block = await asyncio.to_thread(UidBlock.lock, uid_lock_dir())
        except BaseException:
            key_lock.release()
            lock_file.close()
            raise
        engine = cls(
            layout,
            Registry(layout.registry_path),
            ImageStore(layout.images_dir),
            cgroups.detect(),
            ensure_agent(layout),
            bwrap,
            lock_file,
            uid_block,
            warm_slots,
            network_hosts,
            restore_grace,
        )
        engine.id_prefix = id_prefix
        engine.unreachable = unreachable_ancestor(layout.sandboxes_dir)  # (create says it)
        engine.cgroup_key = key_lock
        engine.gpus = GpuAllocator(gpus if gpus is not None else await asyncio.to_thread(
            detect_gpus))
        seccomp.build_filter()  # fail now, not at the first create, on an unknown arch
        engine._warden = warden.Warden.start(
            lock_file, engine.cgroups, engine.cgroup_parent, locks=(engine.uids.fd, key_lock.fd),
            state_dir=layout.state_dir, grace=restore_grace)
        engine.swept = await asyncio.to_thread(  # dead engines' groups (their keys' locks free)
            sweep, engine.cgroups.hierarchies(), cgroup_lock_dir(), own=layout.engine_key)
        adopting = engine._adoptable(handover)  # the rest is reconciled: lost
        engine._hibernated_back()  # hibernated: nothing to adopt, their checkpoints on disk
        users: dict[str, int] = {}
        for live in adopting:
            if live.snapshot_id:
                users[live.snapshot_id] = users.get(live.snapshot_id, 0) + 1
        engine.snapshots.open(users)
        await engine._adopt(adopting)
        engine.secret_store.sweep(lambda sid: sid in engine._live)  # only what lives on
        engine.kept.sweep(lambda sid: engine.registry.get(sid) is not None)
        engine._reaper = asyncio.create_task(engine._reap_loop(), name="corral-reaper")
        engine._pool.refill()
        return engine

    async def close(self, *, stop_sandboxes: bool = True, handover: bool = False) -> None:
        """Stop every sandbox and release the state dir; with ``handover`` (and a
        ``restore_grace``) leave them running for the next engine to adopt."""
        if self.closed:
            return
        self.closed = True
        if self._reaper:
            self._reaper.cancel()
        handover = handover and self.restore_grace > 0 and self._warden is not None
        handed: set[str] = set()  # policy sandboxes: their links stay for the next engine
        if handover:
            handed = await self._hand_over()
        elif stop_sandboxes:
            await asyncio.gather(
                *(self._end(live, SandboxState.STOPPED, "engine closed", grace=0)
                  for live in list(self._live.values())),
                return_exceptions=True,
            )
        await self._pool.close()
        await asyncio.gather(*list(self._teardowns), return_exceptions=True)
        await self.snapshots.settled()  # snapshot layers hashed and durable, recorded
        self._releasers.shutdown(wait=False)
        self._hang_ups.shutdown(wait=False)
        await self.net.close(keep=handed)
        for t in list(self._tasks):
            t.cancel()
        if not handover:  # (it would kill what is handed over)
            remove_cgroup(self.cgroups, self.cgroup_parent)
        if stop_sandboxes and not handover:  # nothing left runs on a volume's mount
            await asyncio.to_thread(self.volumes.unmount_all)
        self.registry.close()
        if self._warden:
            self._warden.stop(handover=handover)
        if self.cgroup_key is not None:  # (a warden keeping a handover holds it on)
            self.cgroup_key.release(remove=not handover)
        self.uids.close()
        self._lock_file.close()

    async def __aenter__(self) -> "Engine":
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()

    # ---------------------------------------------------------------- create

    async def create(
        self, spec: SandboxSpec | dict[str, Any] | None = None, *,
        image_override: Image | None = None, ro_binds: Sequence[tuple[str, str]] = (),
        build_root: bool = False, sandbox_id: str | None = None, owner: OwnerArg = UNSET,
        **kw: Any,
    ) -> SandboxInfo:
        """Create a sandbox for ``owner`` (whose snapshots and networks it may name;
        whose sandbox it is: ``spec.tenant``, which the caller sets) and wait until its
        agent is ready to run commands.

        For image builds (:mod:`corral.runtime.image_build`): ``image_override`` mounts
        an image not in the store (a base plus the layers built so far), and
        ``ro_binds`` puts copies of host files read-only at ``/.corral/DIR/FILE`` (never
        committed); ``build_root`` runs it as root in its user namespace (a ``user: root``
        step: :mod:`corral.runtime.rootbuild`). From a live snapshot it runs the
        snapshot's processes on (:mod:`corral.runtime.engine_live`); ``sandbox_id``: a
        hibernated sandbox's, resumed (:mod:`corral.runtime.engine_hibernate`).
        """
        acting = self.owners.of(owner)
        if self.closed:
            raise InvalidState("the engine is closed")
        if self.unreachable is not None:  # (every start would fail in bwrap: say why)
            raise InvalidState(
                f"no sandbox can start under the state directory {self.layout.state_dir}: "
                f"the sandboxes' users cannot pass through {self.unreachable}; use a state "
                "directory every user can pass through (the default /var/lib/corral, "
                "--state-dir), or chmod o+x that directory",
                details={"state_dir": str(self.layout.state_dir), "cause": "unreachable"})
        for _, dest in ro_binds:
            if dest.count("/") != 3 or not dest.startswith(f"/{rootfs.AGENT_DIR}/") or (
                ".." in dest.split("/") or ":" in dest
            ):
                raise InvalidArgument(
                    f"ro_binds go to /{rootfs.AGENT_DIR}/DIR/FILE, not {dest!r}")
        if not isinstance(spec, SandboxSpec):
            spec = SandboxSpec.parse(spec, **kw)
        elif kw:
            spec = SandboxSpec.parse(spec.model_dump(exclude_unset=True), **kw)
        spec = self.resolve_network(spec, owner=acting)  # network="NAME": NetworkNotFound now
        sid = sandbox_id or _new_id(self.id_prefix)
        spec, snap = self.snapshots.acquire(spec, owner=acting)  # a reference, released by _release
        try:
            images = self.checkpoint_images(snap.id, owner=None) if snap is not None else None  # live?
            image = image_override or self.images.get(spec.image)  # ImageNotFound now
            mounts = self.volumes.mounts(spec.tenant, spec.volumes)  # VolumeNotFound now
            spec = image.apply_defaults(spec)  # the image's env and workdir, unless set
            # (not for a live snapshot's copy or a resume: its processes are restored)
            entry = (users.entrypoint_argv(image)  # InvalidArgument now, if it has none
                     if spec.run_entrypoint and image_override is None and images is None
                     else None)
            grant = self.gpus.assign(sid, spec.gpus, shared=spec.gpu_shared)  # or NoGpuCapacity
            if grant is not None:
                spec = spec.model_copy(update={"env": grant.env(spec.env)})
            lowers = await self.snapshots.lowers(snap, image)
            slot = await self._pool.take(self.cpu_picker.peek(spec.cpus))  # (cpuset ready)
        except BaseException as exc:
            self.gpus.release(sid)
            await self.snapshots.release(snap)
            if (full := storage.full_error(exc, self.layout.state_dir)) is not None:
                raise full from exc
            raise
        live = Live(sid, spec, SandboxState.PENDING, self.layout.sandbox_dir(sid), slot.cgroup,
                     slot.uid, slot.proc)
        live.snapshot_id = snap.id if snap else None
        live.volumes = tuple(mounts)
        live.ro_binds = tuple((str(src), dest) for src, dest in ro_binds)
        live.build_root = build_root  # root in its user namespace (runtime.rootbuild)
        if image_override is None:  # a build step runs as its step says, not as USER
            live.user = users.image_default(image)
            live.image_layers = tuple(image.lowers)
        live.gpus = grant
        live.images = images
        live.adoptable = image_override is None and not ro_binds and not build_root
        try:
            if sandbox_id is not None:  # a resume: its hibernated row, seen until now
                self.registry.delete(sid)
            info = self.registry.insert(sid, spec, slot.cgroup.path)  # a full disk: StorageFull
            if spec.secrets:  # (masked in the registry) for the next engine to give on
                self.secret_store.put(sid, spec.secret_env())
            self._live[sid] = live
            async with self.criu_gate.place(spec.tenant) if images is not None else nullcontext():
                await self._start(live, slot, lowers)  # a restore: one of CRIU's places
        except BaseException as exc:
            reason = exc.message if isinstance(exc, CorralError) else f"{type(exc).__name__}: {exc}"
            if slot.go_fd >= 0:
                slot.sock.close()
                await asyncio.to_thread(slot.discard)
            else:  # launched: the host's ends only a ready sandbox hands on (Slot.hang_up)
                slot.hang_up()
            await self._release(live)
            self._live.pop(sid, None)
            self.secret_store.remove(sid)  # (a resume that fails keeps them: engine_hibernate)
            with suppress(CorralError):  # a full disk: the restart's reconcile fails the row
                self.registry.delete(sid)  # a failed create leaves nothing, not even a row
            if (full := storage.full_error(exc, self.layout.state_dir)) is not None:
                raise full from exc
            if isinstance(exc, CorralError) or not isinstance(exc, Exception):
                raise
            raise SandboxStartError(f"sandbox failed to start: {reason}") from exc
        finally:
            self._pool.refill()  # (deferred by take() past this sandbox's start)
        info.state = SandboxState.RUNNING
        info.started_at = live.started_at
        self.events.emit(SandboxStarted(sid, spec.snapshot, spec.tenant))
        if entry is not None:
            try:  # as the image's USER, in its WORKDIR, with its ENV (all defaults now)
                await self.spawn(sid, entry, owner=None)  # the engine's own work
            except BaseException:
                with suppress(CorralError):
                    await self.delete(sid, owner=None)
                raise
        return info

    async def _start(self, live: Live, slot: Slot, lowers: list[Path]) -> None:
        spec = live.spec
        if slot.devices_set and (live.gpus is not None or live.images is not None
                                 or spec.storage == Storage.DISK):
            # its launcher opens a loop device, CRIU what it restores: the list comes
            # after READY, as on v2 (devices.py)
            slot.cgroup.allow_all_devices()
            slot.devices_set = False
        self.cgroups.set_limits(
            slot.cgroup, cpus=spec.cpus, memory_mb=spec.memory_mb, pids=spec.pids
        )
        live.cpus = self.cpu_picker.take(spec.cpus, prefer=slot.cpus)
        if live.cpus != slot.cpus:  # (a warm slot's cpuset may hold them already)
            self.cgroups.set_cpus(slot.cgroup, live.cpus)  # enforced, where a cpuset exists
        live.sandbox_dir.mkdir()
        (live.sandbox_dir / "rw").mkdir()
        (live.sandbox_dir / "root").mkdir()
        # whatever the daemon's umask (a CI runner's 077 made them 0700: bwrap, as the
        # sandbox's uid, could not reach its root): modes set, not masked
        for d, mode in ((live.sandbox_dir, 0o711), (live.sandbox_dir / "rw", 0o755),
                        (live.sandbox_dir / "root", 0o755)):
            os.chmod(d, mode)
        if spec.storage == Storage.DISK:
            # (a cancelled create removes the sandbox's directory once the image is made)
            await finish_in_thread(lambda: make_image(live.sandbox_dir, disk_mb=spec.disk_mb,
                                                      inodes=spec.inodes))
        live.log = slot.log
        await self._attach_network(live)  # a policy's namespace (engine_network.py)
        adopted: list[dict[str, Any]] = []  # a restored copy's processes (live_processes)
        old = None  # the control socket a restored agent had until it took its new one
        if live.images is not None:  # a live checkpoint's restore (engine_live.py)
            adopted, old = await self._launch_restore(live, slot, lowers)
        elif spec.checkpointable:  # its agent's channels are made inside it (docs/live.md)
            slot.launch(self._launch_args(live, slot, lowers))
            await slot.take_local_channels()
        channel = AgentChannel(slot.sock, live.id, proc=slot.proc, cgroup=slot.cgroup)
        live.channel = channel
        channel.on_close = lambda: self._on_agent_exit(live)
        streams = live_processes.adopt_streams(channel, adopted)
        if old is not None:  # their output sent on it comes first
            await live_processes.drain_old(old, channel, streams)
        if slot.go_fd >= 0:
            args = self._launch_args(live, slot, lowers)
            slot.launch(args)
            if not live.build_root and live.images is None and "--lower" in args:
                # the next warm slots clone these layers while they wait (launch.c)
                self._pool.prelower = args[args.index("--lower") + 1]
        await channel.start()
        try:
            async with asyncio.timeout(START_TIMEOUT_S):  # wait_for (<3.12) may lose a cancel
                await asyncio.shield(channel.ready)
                await self._settle_network(live)  # its UDP entries, made meanwhile
        except (CorralError, asyncio.TimeoutError):  # before READY no sandbox code has run
            detail = slot.error_output()
            if live.images is not None:
                detail = self._restore_done(live, ok=False) or detail
            raise SandboxStartError(
                f"sandbox {live.id} failed to start"
                + (f": {detail}" if detail else " (no error output; see the daemon log)"),
                details={"sandbox_id": live.id},
            ) from None
        # no sandbox code has run yet (a restore's has: it is checked just below):
        # from here it opens only its own device nodes (a warm slot's group may hold
        # them already: devices.py)
        if not slot.devices_set:
            rules = devices.standard_rules() + [
                devices.rule_for(n) for n in (live.gpus.device_nodes() if live.gpus else ())]
            slot.cgroup.restrict_devices(rules)
        if live.images is not None:
            await self._restored(live, slot)  # or InvalidState: a forged checkpoint
        if live.ending:  # deleted while it started (its id listed): it never runs
            raise SandboxStartError(f"sandbox {live.id} was deleted while it started",
                                    details={"sandbox_id": live.id})
        live.started_at = self.registry.set_running(
            live.id, slot.proc.pid, syscalls.process_start_time(slot.proc.pid)
        )
        live.reattach, slot.reattach = slot.reattach, None
        assert live.reattach is not None
        self._keep_with_warden(live, [live.reattach.fileno(), slot.log_fd])
        os.close(slot.log_fd)
        slot.log_fd = -1
        live.state = SandboxState.RUNNING
        live.touch()
        live_processes.adopt(self, live, adopted, streams)

    def cgroup(self, sandbox_id: str) -> Cgroup:
        """The cgroup of a live sandbox (its usage, its processes)."""
        return self._get_live(sandbox_id).cgroup

    def upper_dir(self, sandbox_id: str) -> Path:
        """The host path of a live sandbox's writable layer (inside its mount namespace)."""
        live = self._get_live(sandbox_id)
        assert live.proc is not None
        # The outer bwrap stays in the launcher's private mount namespace, where the
        # sandbox's tmpfs and overlay are mounted: reach them through its /proc root.
        return Path(f"/proc/{live.proc.pid}/root{live.sandbox_dir}/rw/upper")

    def owner_ids(self, sandbox_id: str) -> dict[int, int]:
        """How a live sandbox's owners are stored when its files are committed."""
        live = self._get_live(sandbox_id)
        return {live.uid: 0} if live.build_root else canonical_owner(live.uid)

    def _launch_args(self, live: Live, slot: Slot, lowers: list[Path]) -> list[str]:
        return launch_args(live, slot, lowers, bwrap=self.bwrap, agent=self.agent_path)

    # ------------------------------------------------------------- lifecycle

    def _on_agent_exit(self, live: Live) -> None:
        """The agent's channel closed. Unless we are ending it, the sandbox died."""
        if live.ending:
            return
        task = asyncio.get_running_loop().create_task(
            self._end(live, SandboxState.FAILED, self._death_reason(live), grace=0))
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    def _death_reason(self, live: Live) -> str:
        # Who ended it (the sandbox itself: "sandbox fault: ...") is the channel's call.
        why = live.channel.reason if live.channel else "the sandbox's agent exited unexpectedly"
        log = live.log.text()[-2000:] if live.log is not None else ""
        return why + (f"; its log: {log}" if log else "")
