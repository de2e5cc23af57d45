"""Hibernate: a sandbox's processes written to disk and its memory given back, its id
kept; resume brings them back (docs/live.md, "Hibernate").

Mixed into :class:`~corral.runtime.engine.Engine`. ``hibernate`` is a live checkpoint
(:meth:`~corral.runtime.engine_live.LiveOps.checkpoint`: files and processes, taken
frozen) after which the sandbox's processes end and its slot (uid, cgroup, mounts,
writable layer) is freed; the sandbox stays listed, ``paused``, reason ``hibernated``.
``resume`` (or, through the service layer, the next exec or file operation) restores
the checkpoint into a new slot under the same id and deletes it. Ending a hibernated
sandbox deletes its checkpoint.

Only a checkpointable sandbox hibernates (its processes are what CRIU can dump); any
other is refused typed, running untouched. A hibernated sandbox holds no process: its
checkpoint is named in its registry row, so the next engine on the state directory
lists it hibernated again (:meth:`HibernateOps._hibernated_back`), after a handover or
a ``kill -9``.

Hibernated, it announces :class:`~corral.runtime.events.SandboxHibernated` (the
server's caps let go of it) and its resume first holds ``resume_gate`` (the server's
room to start it again: ``CapacityExceeded`` leaves it hibernated, untouched).

Its lifetime stands still while it is hibernated: the reaper skips it, and it resumes
with what was left of its ``timeout`` (its spec's ``timeout`` becomes that, counted
from the resume). One hibernated *by* its timeout (``on_timeout="hibernate"``) has
nothing left: it resumes with a fresh lifetime as long as the one that ran out. Either
way within the owner's maximum lifetime counted from its create (``lifetime_cap``, the
server's).
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable
from contextlib import AbstractAsyncContextManager, nullcontext, suppress
from typing import TYPE_CHECKING, Any

from corral.errors import CorralError, InvalidState
from corral.runtime import rootfs
from corral.runtime.events import SandboxEnded, SandboxHibernated
from corral.runtime.live import Live
from corral.runtime.ownership import UNSET, OwnerArg
from corral.schema import SandboxInfo, SandboxSpec, SandboxState, SnapshotInfo

if TYPE_CHECKING:
    from pathlib import Path

    from corral.runtime.cgroups import CgroupDriver
    from corral.runtime.events import Events
    from corral.runtime.ownership import Owners
    from corral.runtime.paths import Layout
    from corral.runtime.registry import Registry
    from corral.runtime.secret_store import SecretStore
    from corral.runtime.snapshots import Snapshots

log = logging.getLogger("corral.runtime")

HIBERNATED = "hibernated"  # the reason a hibernated sandbox's row gives


class HibernateOps:
    """``hibernate``, and ``resume``/``wake`` that know a hibernated sandbox."""

    if TYPE_CHECKING:
        _live: dict[str, Live]
        _hibernated: dict[str, str]
        _resuming: dict[str, tuple[asyncio.Event, asyncio.Task[Any] | None, str | None]]
        events: Events
        registry: Registry
        _tasks: set[asyncio.Task[Any]]
        owners: Owners
        layout: Layout
        cgroups: CgroupDriver
        snapshots: Snapshots
        cgroup_parent: str
        lifetime_cap: Callable[[SandboxInfo], float] | None
        resume_gate: Callable[[SandboxInfo], AbstractAsyncContextManager[object]] | None
        secret_store: SecretStore

        def _get_live(self, sandbox_id: str) -> Live: ...
        def _kept_secrets(self, sandbox_id: str, spec: SandboxSpec) -> SandboxSpec: ...
        def _owned(self, sandbox_id: str, owner: OwnerArg) -> None: ...
        def get(self, sandbox_id: str, *, owner: OwnerArg = UNSET) -> SandboxInfo: ...
        def _transition(self, live: Live, to: SandboxState, reason: str | None = None, *,
                        record: bool = True) -> None: ...
        async def _release(self, live: Live, *, detach: bool = False) -> None: ...
        async def checkpoint(self, sandbox_id: str, name: str | None = None, *,
                             owner: OwnerArg = UNSET) -> SnapshotInfo: ...
        async def delete_snapshot(self, id_or_name: str, *, owner: OwnerArg = UNSET) -> bool: ...
        async def _resume_running(self, sandbox_id: str) -> SandboxInfo: ...
        async def _past_resume(self, sandbox_id: str, acting: str | None) -> None: ...
        def checkpoint_images(self, snapshot: str, *, owner: OwnerArg = UNSET) -> Path | None: ...
        async def _end(self, live: Live, final: SandboxState, reason: str, *,
                       grace: float, detach: bool = False, record: bool = True) -> None: ...
        async def create(self, spec: SandboxSpec | dict[str, Any] | None = None, *,
                         sandbox_id: str | None = None, owner: OwnerArg = UNSET,
                         **kw: Any) -> SandboxInfo: ...

    async def hibernate(self, sandbox_id: str, *, owner: OwnerArg = UNSET) -> SandboxInfo:
        """Write the sandbox's processes and files to disk, end them and free its memory,
        uid and cgroup; it stays listed (``paused``, reason ``hibernated``) under its id
        until :meth:`resume` or the next use. Idempotent for a hibernated sandbox.
        :class:`InvalidState` for one not created checkpointable (``cause``
        ``not_checkpointable``) or not running; :class:`~corral.errors.Unsupported`
        where CRIU cannot dump it (it keeps running)."""
        self._owned(sandbox_id, owner)  # ``owner``'s (another's answers as unknown)
        live = self._get_live(sandbox_id)
        if live.hibernated is not None:
            return self.get(sandbox_id, owner=None)
        await self._hibernate(live, timed_out=False)
        return self.get(sandbox_id, owner=None)

    async def _hibernate(self, live: Live, *, timed_out: bool) -> None:
        sandbox_id = live.id
        # typed refusals, the sandbox untouched; the engine's own work from here on
        snap = await self.checkpoint(sandbox_id, owner=None)
        async with live.lock:
            if live.ending or live.state != SandboxState.RUNNING:  # ended meanwhile
                await self.delete_snapshot(snap.id, owner=None)
                raise InvalidState(f"sandbox {sandbox_id} is {live.state.value}: only a "
                                   "running sandbox hibernates",
                                   details={"sandbox_id": sandbox_id})
            left = live.started_at + live.spec.timeout - time.time()
            self._transition(live, SandboxState.PAUSED, HIBERNATED)
            self.registry.set_hibernated(sandbox_id, snap.id)  # a restart finds it so
            live.hibernated = self._hibernated[sandbox_id] = snap.id
            if not timed_out and live.started_at and left > 0:  # the rest of its lifetime
                live.spec = live.spec.model_copy(update={"timeout": left})
                self.registry.set_spec(sandbox_id, live.spec)
            await self._release(live)  # its processes, slot, uid, cgroup and upper dir
            live.ending, live.proc, live.channel, live.log = False, None, None, None
            live.reattach, live.uid = None, -1  # (its uid was given back: not again at its end)
        self.events.emit(SandboxHibernated(sandbox_id))  # its room is free (server's caps)

    async def _hibernate_at_timeout(self, live: Live, reason: str) -> None:
        """``on_timeout="hibernate"``: its lifetime ran out; hibernate it, or end it as
        any timeout does if it cannot be (the cause in its reason)."""
        live.hibernating = True
        try:
            # its lifetime is over: it runs no more while it waits its turn at CRIU's
            # gate (the reaper skips it meanwhile; the dump freezes it anyway)
            if live.cgroup is not None:
                with suppress(OSError, CorralError):
                    await asyncio.to_thread(live.cgroup.freeze)
            await self._hibernate(live, timed_out=True)
        except (CorralError, OSError) as exc:
            why = exc.message if isinstance(exc, CorralError) else str(exc)
            log.warning("sandbox %s could not hibernate at its timeout: %s", live.id, why)
            await self._end(live, SandboxState.STOPPED,
                            f"{reason}; it could not hibernate: {why}", grace=0)
        finally:
            live.hibernating = False

    async def _end_hibernated(self, live: Live) -> None:
        """Hibernated ``live`` lived its owner's maximum lifetime (it can never be
        resumed): it ends, its places in the quotas freed; its checkpoint stays, a live
        snapshot of its owner's (in its snapshot quota), to restore as a new sandbox."""
        async with live.lock:
            snap = live.hibernated
            if snap is None or live.ending or self._live.get(live.id) is not live:
                return
            self._hibernated.pop(live.id, None)  # (not deleted with it: _hibernated_ended)
            self.registry.set_hibernated(live.id, None)
            live.hibernated = None
        await self._end(live, SandboxState.STOPPED,
                        "max lifetime: it lived its owner's maximum lifetime while "
                        f"hibernated; its processes are kept in checkpoint {snap}: restore "
                        "it as a new sandbox, or delete it", grace=0)

    async def resume(self, sandbox_id: str, *, owner: OwnerArg = UNSET) -> SandboxInfo:
        """Thaw ``owner``'s paused sandbox; restore a hibernated one (same id, a new slot)."""
        await self._past_resume(sandbox_id, self.owners.of(owner))  # another's, under way
        self._owned(sandbox_id, owner)
        live = self._get_live(sandbox_id)
        if live.hibernated is None:
            return await self._resume_running(sandbox_id)
        async with live.lock:
            if live.hibernated is None or self._live.get(sandbox_id) is not live:
                return self.get(sandbox_id, owner=None)  # woken (or ended) while we waited
            snap_id = live.hibernated
            row = self.registry.get(sandbox_id)
            assert row is not None
            timeout = live.spec.timeout
            if self.lifetime_cap is not None:  # its owner's maximum, counted from its create
                timeout = min(timeout, self.lifetime_cap(row))
                if timeout <= 0:
                    raise InvalidState(
                        f"sandbox {sandbox_id} has lived its maximum lifetime (counted from "
                        "its create, hibernated time included): delete it, or restore its "
                        f"checkpoint {snap_id} as a new sandbox",
                        details={"sandbox_id": sandbox_id, "cause": "max_lifetime"})
            # room to start again first (CapacityExceeded: hibernated still, untouched)
            gate = nullcontext() if self.resume_gate is None else self.resume_gate(row)
            done = asyncio.Event()  # a delete waits for it
            self._resuming[sandbox_id] = (done, asyncio.current_task(), live.spec.tenant)
            try:
                info = await self._resume_as(live, row, snap_id, timeout, gate)
            finally:
                del self._resuming[sandbox_id]
                done.set()
        await self.delete_snapshot(snap_id, owner=None)
        return info

    async def _resume_as(self, live: Live, row: SandboxInfo, snap_id: str, timeout: float,
                         gate: AbstractAsyncContextManager[object]) -> SandboxInfo:
        """Create hibernated ``live`` again from its checkpoint, under ``gate``."""
        sandbox_id = live.id
        async with gate:  # held until it runs again, or given back if it fails
            self._live.pop(sandbox_id)  # its row stays until the create writes it again
            try:  # its own spec (tenant, tags, secrets, limits), from its checkpoint
                info = await self.create(
                    live.spec.model_copy(update={"snapshot": snap_id, "timeout": timeout}),
                    sandbox_id=sandbox_id, owner=None)
            except BaseException:
                self.registry.delete(sandbox_id)  # (if the create wrote it)
                self.registry.insert(sandbox_id, row.spec, "")  # hibernated still
                if live.spec.secrets:  # (the registry's are masked: its own, from memory)
                    self.secret_store.put(sandbox_id, live.spec.secret_env())
                self.registry.set_state(sandbox_id, SandboxState.PAUSED, HIBERNATED)
                self.registry.set_hibernated(sandbox_id, snap_id)
                self.registry.set_created(sandbox_id, row.created_at)
                self._live[sandbox_id] = live
                raise
        self.registry.set_created(sandbox_id, row.created_at)  # (its maximum counts from it)
        info.created_at = row.created_at
        live.hibernated = None
        self._hibernated.pop(sandbox_id, None)
        return info

    async def wake(self, sandbox_id: str, *, owner: OwnerArg = UNSET) -> None:
        """Restore ``owner``'s hibernated sandbox before it is used (the service layer
        calls this before an exec or a file operation); nothing for any other."""
        owner = self.owners.of(owner)
        # another command woke it: it is out of the table, then pending, until its
        # resume ends (the verb would say not found, or pending)
        await self._past_resume(sandbox_id, owner)
        live = self._live.get(sandbox_id)
        if live is not None and live.hibernated is not None and self.owners.sees(live.spec, owner):
            await self.resume(sandbox_id, owner=owner)  # (another's: the verb says not found)

    def awake(self, sandbox_id: str) -> bool:
        """Whether a verb on ``sandbox_id`` needs no :meth:`wake` first (no resume of it
        under way, not hibernated): it may start at once, without awaiting. Any
        tenant's; the verb itself answers for ownership."""
        if sandbox_id in self._resuming:
            return False
        live = self._live.get(sandbox_id)
        return live is None or live.hibernated is None

    def _hibernated_ended(self, event: SandboxEnded) -> None:
        """A hibernated sandbox ended (stop, delete, timeout, engine close): its
        checkpoint goes with it."""
        snap = self._hibernated.pop(event.sandbox_id, None)
        if snap is not None:
            task = asyncio.get_running_loop().create_task(
                self.delete_snapshot(snap, owner=None))  # the engine's own work
            self._tasks.add(task)
            task.add_done_callback(self._tasks.discard)

    def _hibernated_back(self) -> None:
        """At open: the sandboxes hibernated under the engine before (their rows name
        their checkpoints) are listed hibernated again, holding nothing but those."""
        for sid, snap_id in self.registry.hibernated_rows():
            info = self.registry.get(sid)
            images = None
            try:  # its own checkpoint only: its tenant's, taken of it
                if info is not None and self.snapshots.get(
                        snap_id, owner=info.spec.tenant).source_sandbox == sid:
                    images = self.checkpoint_images(snap_id, owner=None)
            except CorralError:  # its snapshot row is gone
                pass
            if info is None or images is None:
                self.registry.set_state(sid, SandboxState.FAILED, "lost: the engine restarted "
                                        "and its hibernation checkpoint was gone")
                continue
            live = Live(sid, self._kept_secrets(sid, info.spec), SandboxState.PAUSED,
                        self.layout.sandbox_dir(sid),
                        # no process, uid or cgroup of its own: a handle on a group that
                        # is not there (its end removes it again, changing nothing)
                        self.cgroups.handle(f"{self.cgroup_parent}/{HIBERNATED}-{sid}"))
            rootfs.remove_dirs(live.sandbox_dir)  # a crash mid-hibernate left it (unmounted)
            live.hibernated = self._hibernated[sid] = snap_id
            live.started_at = info.started_at or 0.0
            self._live[sid] = live
