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
other is refused typed, running untouched. A hibernated sandbox does not survive a
daemon restart yet: the restart fails it (its checkpoint stays, listed, restorable).
A resumed sandbox keeps its create and start times: its lifetime is not restarted.
"""

from __future__ import annotations

import asyncio
from typing import TYPE_CHECKING, Any

from corral.errors import InvalidState
from corral.runtime.events import SandboxEnded
from corral.runtime.ownership import UNSET, OwnerArg
from corral.schema import SandboxInfo, SandboxSpec, SandboxState, SnapshotInfo

if TYPE_CHECKING:
    from corral.runtime.events import Events
    from corral.runtime.live import Live
    from corral.runtime.ownership import Owners
    from corral.runtime.registry import Registry

HIBERNATED = "hibernated"  # the reason a hibernated sandbox's row gives


class HibernateOps:
    """``hibernate``, and ``resume``/``wake`` that know a hibernated sandbox."""

    if TYPE_CHECKING:
        _live: dict[str, Live]
        _hibernated: dict[str, str]
        events: Events
        registry: Registry
        _tasks: set[asyncio.Task[Any]]
        owners: Owners

        def _get_live(self, sandbox_id: str) -> Live: ...
        def _owned(self, sandbox_id: str, owner: OwnerArg) -> None: ...
        def get(self, sandbox_id: str, *, owner: OwnerArg = UNSET) -> SandboxInfo: ...
        def _transition(self, live: Live, to: SandboxState, reason: str | None = None) -> None: ...
        async def _release(self, live: Live) -> None: ...
        async def checkpoint(self, sandbox_id: str, name: str | None = None, *,
                             owner: OwnerArg = UNSET) -> SnapshotInfo: ...
        async def delete_snapshot(self, id_or_name: str, *, owner: OwnerArg = UNSET) -> bool: ...
        async def _resume_running(self, sandbox_id: str) -> SandboxInfo: ...
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
        # typed refusals, the sandbox untouched; the engine's own work from here on
        snap = await self.checkpoint(sandbox_id, owner=None)
        async with live.lock:
            if live.ending or live.state != SandboxState.RUNNING:  # ended meanwhile
                await self.delete_snapshot(snap.id, owner=None)
                raise InvalidState(f"sandbox {sandbox_id} is {live.state.value}: only a "
                                   "running sandbox hibernates",
                                   details={"sandbox_id": sandbox_id})
            self._transition(live, SandboxState.PAUSED, HIBERNATED)
            live.hibernated = self._hibernated[sandbox_id] = snap.id
            await self._release(live)  # its processes, slot, uid, cgroup and upper dir
            live.ending, live.proc, live.channel, live.log = False, None, None, None
            live.reattach = None
        return self.get(sandbox_id, owner=None)

    async def resume(self, sandbox_id: str, *, owner: OwnerArg = UNSET) -> SandboxInfo:
        """Thaw ``owner``'s paused sandbox; restore a hibernated one (same id, a new slot)."""
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
            self._live.pop(sandbox_id)
            self.registry.delete(sandbox_id)  # the create writes it again, running
            try:  # its own spec (tenant, tags, secrets, limits), from its checkpoint
                info = await self.create(live.spec.model_copy(update={"snapshot": snap_id}),
                                         sandbox_id=sandbox_id, owner=None)
            except BaseException:
                self.registry.insert(sandbox_id, row.spec, "")  # hibernated still
                self.registry.set_state(sandbox_id, SandboxState.PAUSED, HIBERNATED)
                self._live[sandbox_id] = live
                raise
            live.hibernated = None
            self._hibernated.pop(sandbox_id, None)
            # its lifetime goes on from its first start: a resume is no new one (else a
            # hibernate before each timeout would keep it alive past any maximum)
            self.registry.set_times(sandbox_id, row.created_at, row.started_at)
            woken = self._live.get(sandbox_id)
            if woken is not None and row.started_at:
                woken.started_at = row.started_at
            info = info.model_copy(update={"created_at": row.created_at,
                                           "started_at": row.started_at})
        await self.delete_snapshot(snap_id, owner=None)
        return info

    async def wake(self, sandbox_id: str, *, owner: OwnerArg = UNSET) -> None:
        """Restore ``owner``'s hibernated sandbox before it is used (the service layer
        calls this before an exec or a file operation); nothing for any other."""
        owner = self.owners.of(owner)
        live = self._live.get(sandbox_id)
        if live is not None and live.hibernated is not None and self.owners.sees(live.spec, owner):
            await self.resume(sandbox_id, owner=owner)  # (another's: the verb says not found)

    def _hibernated_ended(self, event: SandboxEnded) -> None:
        """A hibernated sandbox ended (stop, delete, timeout, engine close): its
        checkpoint goes with it."""
        snap = self._hibernated.pop(event.sandbox_id, None)
        if snap is not None:
            task = asyncio.get_running_loop().create_task(
                self.delete_snapshot(snap, owner=None))  # the engine's own work
            self._tasks.add(task)
            task.add_done_callback(self._tasks.discard)
