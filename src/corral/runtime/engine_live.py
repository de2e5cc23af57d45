"""The engine's live checkpoints: a sandbox's running processes saved and restored
(docs/live.md; CRIU's halves are :mod:`.checkpoint` and :mod:`.live_images`).

Mixed into :class:`~corral.runtime.engine.Engine`. A checkpoint is a normal snapshot
of the sandbox's files plus CRIU's images of its processes, both taken while its
cgroup is frozen (so files and memory agree), in ``STATE/checkpoints/<tenant>/<snapshot
id>``. A restore is a create from that snapshot whose launcher runs CRIU's restore in
place of bubblewrap, in the new slot's cgroup, mounts and uid; the restored agent is
sent new channels made in its own network namespace over its reattach socket (``R``,
agent.c) and says READY on the new control socket.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import shutil
import socket
from contextlib import suppress
from pathlib import Path
from typing import TYPE_CHECKING, Any

from corral.errors import InvalidState, SandboxStartError, SnapshotNotFound, StorageFull
from corral.runtime import checkpoint, criu, layer_fetch, live_images, live_processes, syscalls
from corral.runtime.engine_network import made_in
from corral.runtime.ownership import UNSET, OwnerArg, Owners
from corral.runtime.storage import room_above_reserve
from corral.runtime.threadwork import finish_in_thread
from corral.schema import SandboxInfo, SandboxSpec, SandboxState, SnapshotInfo

if TYPE_CHECKING:
    from corral.runtime.criu_gate import CriuGate
    from corral.runtime.launcher import Slot
    from corral.runtime.live import Live
    from corral.runtime.paths import Layout
    from corral.runtime.snapshots import Snapshots

RESTORE_DIR = "images"  # in the new sandbox's directory, while CRIU restores
RESTORE_NETNS_TIMEOUT_S = 60.0
HELPERS_WAIT_S = 2.0  # CRIU's action script exits at once (live_images.action_script)


class LiveOps:
    """``checkpoint``, ``restore_checkpoint``; ``get_snapshot``, ``list_snapshots`` and
    ``delete_snapshot`` that know a live snapshot (its kind, its images)."""

    if TYPE_CHECKING:
        layout: Layout
        snapshots: Snapshots
        _tasks: set[asyncio.Task[Any]]
        _hibernated: dict[str, str]  # sandbox id -> its checkpoint (engine_hibernate)
        criu_gate: CriuGate
        _checkpoint_turns: dict[str | None, asyncio.Lock]  # per tenant with a quota

        owners: Owners

        def _get_live(self, sandbox_id: str) -> Live: ...
        def _owned(self, sandbox_id: str, owner: OwnerArg) -> None: ...
        def upper_dir(self, sandbox_id: str) -> Path: ...
        def owner_ids(self, sandbox_id: str) -> dict[int, int]: ...
        def _launch_args(self, live: Live, slot: Slot, lowers: list[Path]) -> list[str]: ...
        async def create(self, spec: SandboxSpec | dict[str, Any] | None = None,
                         **kw: Any) -> SandboxInfo: ...

    async def checkpoint(self, sandbox_id: str, name: str | None = None, *,
                         owner: OwnerArg = UNSET) -> SnapshotInfo:
        """Save a running sandbox's processes and files as a live snapshot; it keeps
        running. :class:`~corral.errors.Unsupported` (``details.cause``) where CRIU
        cannot, the sandbox untouched; :class:`InvalidState` for a sandbox not created
        checkpointable."""
        self.snapshots.valid_name(name)
        self._owned(sandbox_id, owner)
        live = self._get_live(sandbox_id)
        if not live.spec.checkpointable:
            raise InvalidState(
                f"sandbox {sandbox_id} was not created checkpointable: create it with "
                "checkpointable=True to checkpoint its processes (docs/live.md)",
                details={"sandbox_id": sandbox_id, "cause": "not_checkpointable"})
        self.snapshots.check_name(name, live.spec.tenant)
        async with self._checkpoint_turn(live.spec.tenant):
            return await self._checkpoint(live, name)

    def _checkpoint_turn(self, tenant: str | None) -> contextlib.AbstractAsyncContextManager[Any]:
        """One checkpoint at a time per tenant with a snapshot quota: checked before its
        dump only against what is there, several at once would each pass and together
        pass the quota (or each count the others' dumps and all be refused). One by one,
        each is checked again with its real size before it is installed (``commit``),
        and CRIU's images on disk pass the quota by one dump's at most, meanwhile."""
        if self.snapshots.quota_of(tenant) is None:
            return contextlib.nullcontext()
        return self._checkpoint_turns.setdefault(tenant, asyncio.Lock())

    async def _checkpoint(self, live: Live, name: str | None) -> SnapshotInfo:
        sandbox_id = live.id
        self.snapshots.check_quota(live.spec.tenant, {})
        # CRIU writes its images straight under the state directory: up to the
        # sandbox's memory, never below the disk's reserve (as a snapshot's copy)
        room = await asyncio.to_thread(room_above_reserve, self.layout.state_dir)
        if room < live.spec.memory_mb << 20:
            raise StorageFull(
                f"no room to checkpoint sandbox {sandbox_id}: its process images may take "
                f"its memory_mb ({live.spec.memory_mb} MiB) and the disk under "
                f"{self.layout.state_dir} keeps its reserve free; delete snapshots or free "
                "space there", details={"path": str(self.layout.state_dir),
                                        "sandbox_id": sandbox_id})
        async with live.lock:
            if live.ending or live.state != SandboxState.RUNNING or live.proc is None:
                raise InvalidState(f"sandbox {sandbox_id} is {live.state.value}: only a "
                                   "running sandbox can be checkpointed",
                                   details={"sandbox_id": sandbox_id})
            # then one of CRIU's places (a dump runs outside the sandbox's limits), not
            # frozen while it waits; the sandbox's lock before the place, as a resume
            # takes them (its restore's place under its lock): never the other way round
            async with self.criu_gate.place(live.spec.tenant):
                for conn in list(live.port_conns):  # CRIU dumps no connected TCP socket
                    syscalls.reset_tcp(conn.fileno())
                live.port_conns.clear()
                # frozen with no process mid-vfork (CRIU could not stop it); a cancel
                # while it freezes (a client that left) does not leave it frozen
                await checkpoint.freeze_for_dump(live.cgroup, sandbox_id)
                try:
                    images = await checkpoint.dump(
                        cache_dir=self.layout.cache_dir, state_dir=self.layout.state_dir,
                        sandbox_id=sandbox_id, tenant=live.spec.tenant,
                        launcher_pid=live.proc.pid, uid=live.uid,
                        freezer=live.cgroup.freezer_dir())
                    try:  # its interactive processes, as its copies' engines need them
                        await live_processes.settle(live)
                        live_processes.write(images.path, live_processes.record(live))
                        staged = await self.snapshots.stage(
                            self.upper_dir(sandbox_id), None, source=sandbox_id,
                            spec=live.spec, ids=self.owner_ids(sandbox_id))
                    except BaseException:
                        shutil.rmtree(images.path, ignore_errors=True)
                        raise
                finally:
                    live.cgroup.thaw()
        try:  # QuotaExceeded: its images (on disk, counted) and its layer are gone again
            snap = await self.snapshots.commit(staged, name=name, spec=live.spec,
                                               parent=live.snapshot_id, source=sandbox_id)
        except BaseException:
            await asyncio.to_thread(shutil.rmtree, images.path, ignore_errors=True)
            raise
        images.path.rename(images.path.with_name(snap.id))
        return snap.model_copy(update={"kind": "live"})

    def get_snapshot(self, id_or_name: str, *, owner: OwnerArg = UNSET) -> SnapshotInfo:
        """A snapshot by id or name (its ``kind``); :class:`SnapshotNotFound` if none."""
        return self._kind(self.snapshots.get(id_or_name, owner=owner))

    def list_snapshots(self, *, owner: OwnerArg = UNSET) -> list[SnapshotInfo]:
        return [self._kind(s) for s in self.snapshots.list(owner=owner)]

    def _kind(self, snap: SnapshotInfo) -> SnapshotInfo:
        live = self.checkpoint_images(snap.id, owner=None) is not None
        return snap.model_copy(update={"kind": "live"}) if live else snap

    async def describe_snapshot(self, id_or_name: str, owner: str | None) -> dict[str, Any]:
        """What another node needs to restore ``owner``'s snapshot
        (:func:`~corral.runtime.layer_fetch.describe`), with its ``kind``: a live one's
        process images travel on their own route (:mod:`~corral.runtime.live_travel`).
        Waits for its layers' digests (:meth:`Snapshots.settled`)."""
        await self.snapshots.settled(self.snapshots.get(id_or_name, owner=owner).layers)
        desc = layer_fetch.describe(self.snapshots, id_or_name, owner)
        desc["kind"] = self.get_snapshot(desc["id"], owner=owner).kind
        return desc

    def checkpoint_images(self, snapshot: str, *, owner: OwnerArg = UNSET) -> Path | None:
        """The process images of ``owner``'s live snapshot (by id or name); None for a
        snapshot of files only."""
        snap = self.snapshots.get(snapshot, owner=owner)
        tenant = self.snapshots.resolve(SandboxSpec(snapshot=snap.id), owner=None).tenant
        path = checkpoint.images_root(self.layout.state_dir, tenant) / snap.id
        return path if path.is_dir() else None

    async def restore_checkpoint(self, snapshot: str, *, owner: OwnerArg = UNSET,
                                 **spec: Any) -> SandboxInfo:
        """A new sandbox running the processes of the live snapshot ``snapshot``, from
        where they were: its own slot, uid, cgroup and namespaces. (``create`` with
        ``snapshot=`` a live snapshot does the same.)"""
        if self.checkpoint_images(snapshot, owner=owner) is None:
            raise InvalidState(f"snapshot {snapshot} holds files only, not processes: "
                               "create(snapshot=...) starts from its files")
        return await self.create(SandboxSpec.parse(snapshot=snapshot, **spec), owner=owner)

    async def delete_snapshot(self, id_or_name: str, *, owner: OwnerArg = UNSET) -> bool:
        """Delete a snapshot (see :meth:`SnapshotOps.delete_snapshot
        <corral.runtime.engine_snapshots.SnapshotOps.delete_snapshot>`) and, for a live
        one, its process images at once (no restore is started from it any more).
        :class:`InvalidState` for the checkpoint a hibernated sandbox sleeps in."""
        try:
            images = self.checkpoint_images(id_or_name, owner=owner)
        except SnapshotNotFound:
            return False
        if images is not None and images.name in self._hibernated.values():
            holder = next(s for s, c in self._hibernated.items() if c == images.name)
            raise InvalidState(
                f"snapshot {images.name} holds the processes of hibernated sandbox {holder}: "
                "resume or delete the sandbox instead",
                details={"snapshot_id": images.name, "sandbox_id": holder})
        if images is not None:  # gone at once; its bytes removed meanwhile
            await asyncio.to_thread(checkpoint.discard, images, self.layout.state_dir)
            task = asyncio.get_running_loop().create_task(
                asyncio.to_thread(checkpoint.empty_trash, self.layout.state_dir))
            self._tasks.add(task)
            task.add_done_callback(self._tasks.discard)
        return await self.snapshots.delete(id_or_name, owner=owner)

    def images_bytes(self, tenant: str | None) -> int:
        """Disk held by ``tenant``'s live snapshots' process images (its snapshot quota)."""
        return checkpoint.images_bytes(self.layout.state_dir, tenant)

    async def _launch_restore(self, live: Live, slot: Slot, lowers: list[Path]
                              ) -> tuple[list[dict[str, Any]], socket.socket]:
        """Start CRIU's restore of ``live.images`` in ``slot`` and give the restored agent
        a new control socket (it answers READY on it); the records of the interactive
        processes it keeps (:mod:`~corral.runtime.live_processes`), and the control
        socket it was restored with (:func:`~corral.runtime.live_processes.drain_old`)."""
        assert live.images is not None and slot.reattach is not None
        binary = criu.require(self.layout.cache_dir)
        meta = live_images.read_meta(live.images)
        records = live_processes.read(live.images)
        dest = live.sandbox_dir / RESTORE_DIR
        try:  # whatever ends it here (a refused image, a cancel): the read access goes
            # (on a cancel, the staging ends before _restore_done removes what it staged)
            images, uid = live.images, live.uid
            await finish_in_thread(lambda: live_images.stage(images, dest, uid=uid))
            live.kdat = str(checkpoint.kdat_cache(self.layout.state_dir, binary))
            live.program = tuple(live_images.restore_argv(
                binary.path, dest, sandbox_dir=live.sandbox_dir, meta=meta,
                ctl_fd=slot.ctl_fd, reattach_fd=slot.reattach_fd, nofile=live.spec.open_files))
            slot.launch(self._launch_args(live, slot, lowers))
        except BaseException:
            self._restore_done(live, ok=False)
            raise
        # its new channels are made in its own network namespace, as a checkpointable
        # sandbox's are, so that it can be checkpointed again; sent over the reattach
        # socket it was restored with ('R', agent.c), which they replace
        try:
            netns = await _restored_netns(slot)
            (ours, theirs), (r_ours, r_theirs) = await asyncio.to_thread(made_in, netns, _pairs)
        except (SandboxStartError, OSError) as exc:  # CRIU failed, or its sandbox died
            detail = self._restore_done(live, ok=False)
            raise SandboxStartError(f"sandbox {live.id} failed to start: "
                                    f"{detail or exc}") from None
        except BaseException:  # cancelled while CRIU restores
            self._restore_done(live, ok=False)
            raise
        try:
            socket.send_fds(slot.reattach, [live_processes.reattach_message(records)],
                            [theirs.fileno(), r_theirs.fileno()])
        except BaseException:
            ours.close()
            r_ours.close()
            raise
        finally:
            theirs.close()
            r_theirs.close()
        old = slot.sock
        slot.reattach.close()
        slot.sock, slot.reattach = ours, r_ours
        return records, old

    async def _restored(self, live: Live, slot: Slot) -> None:
        """The restored agent answered: drop the staged images and check that every
        restored process is confined as a sandbox's are (a forged image cannot lift
        that: :func:`~corral.runtime.live_images.check_restored`). CRIU's own short-lived
        children (its action script, run for each of its steps) are waited out: a
        child of CRIU that is still there after :data:`HELPERS_WAIT_S` is not one."""
        self._restore_done(live, ok=True)
        outer = slot.proc.pid
        loop = asyncio.get_running_loop()
        deadline = loop.time() + HELPERS_WAIT_S
        while True:
            try:
                live_images.check_restored(live.cgroup.pids(), outer=outer, uid=live.uid,
                                           nofile=live.spec.open_files,
                                           sandbox_dir=live.sandbox_dir)
                # every tenant's restores start from these probes: only a confined one's
                await asyncio.to_thread(checkpoint.keep_kdat, outer, Path(live.kdat))
                return
            except InvalidState as exc:
                if loop.time() > deadline or _parent(exc.details["pid"]) not in (outer, None):
                    raise
            await asyncio.sleep(0.005)

    def _restore_done(self, live: Live, ok: bool) -> str:
        """Remove a restore's staged images (and its read access to the checkpoint's);
        CRIU's errors if it failed."""
        dest = live.sandbox_dir / RESTORE_DIR
        if live.images is not None:
            with suppress(OSError):
                live_images.unstage(live.images, uid=live.uid)
        errors = ""
        if not ok:
            try:
                log = (dest / "restore.log").read_text(errors="replace")
                errors = "; ".join(ln.split("): ", 1)[-1] for ln in log.splitlines()
                                   if "Error (" in ln and not checkpoint.is_noise(ln))[:2000]
            except OSError:
                pass
        shutil.rmtree(dest, ignore_errors=True)
        return errors


def _parent(pid: int) -> int | None:
    """The parent of host pid ``pid``; None once it is gone."""
    try:
        status = Path(f"/proc/{pid}/status").read_text()
    except OSError:
        return None
    return int(status.split("PPid:", 1)[1].split()[0])


def _pairs() -> tuple[tuple[socket.socket, socket.socket], tuple[socket.socket, socket.socket]]:
    """An agent's two channels: control (stream) and reattach (seqpacket)."""
    return (socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM),
            socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET))


async def _restored_netns(slot: Slot, timeout: float = RESTORE_NETNS_TIMEOUT_S) -> str:
    """``/proc/PID/ns/net`` of the sandbox CRIU restored in ``slot``: its root task's,
    once that task is itself again (CRIU names its tasks ``criu`` until it restores
    their names, last; before, the task may still move to another namespace)."""
    outer = slot.proc.pid
    ours = os.stat("/proc/self/ns/net").st_ino
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout
    pause = 0.002  # then longer: the CPU it takes from the restores of a fork (~0.1 s)
    while slot.proc.poll() is None and loop.time() < deadline:
        try:
            children = Path(f"/proc/{outer}/task/{outer}/children").read_text().split()
            if (children and Path(f"/proc/{children[0]}/comm").read_text().strip() != "criu"
                    and os.stat(f"/proc/{children[0]}/ns/net").st_ino != ours):
                return f"/proc/{children[0]}/ns/net"
        except OSError:
            pass  # a child that came and went: look again
        await asyncio.sleep(pause)
        pause = min(pause * 1.5, 0.01)
    raise SandboxStartError("CRIU's restore ended (or stalled) before the sandbox's "
                            "network namespace existed")
