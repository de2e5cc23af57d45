"""The engine's snapshots and forks (the storage is :mod:`corral.runtime.snapshots`).

Mixed into :class:`~corral.runtime.engine.Engine`. :func:`fork_from` is the one fork:
the engine's own (:meth:`SnapshotOps.fork`) and the service layer's (through admission
control) both call it with their own ``create`` and ``delete``.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

from corral.errors import InvalidArgument, InvalidState
from corral.runtime.events import Events, Forking
from corral.runtime.ownership import UNSET, OwnerArg, Owners
from corral.runtime.snapshots import Snapshots
from corral.schema import SandboxInfo, SandboxSpec, SandboxState, SnapshotInfo

if TYPE_CHECKING:
    from corral.runtime.live import Live


class Abandoned(Exception):
    """The caller of a fork left while its sandboxes were being made; they were deleted."""


class SnapshotOps:
    """``snapshot``, ``fork``, ``fork_spec``, ``resolve_spec`` and the snapshot store."""

    if TYPE_CHECKING:
        _live: dict[str, Live]
        snapshots: Snapshots
        events: Events

        def _get_live(self, sandbox_id: str) -> Live: ...
        owners: Owners

        def get(self, sandbox_id: str, *, owner: OwnerArg = UNSET) -> SandboxInfo: ...
        def _owned(self, sandbox_id: str, owner: OwnerArg) -> None: ...
        def upper_dir(self, sandbox_id: str) -> Path: ...
        def owner_ids(self, sandbox_id: str) -> dict[int, int]: ...
        async def create(self, spec: SandboxSpec, *, owner: OwnerArg = UNSET) -> SandboxInfo: ...
        async def delete(self, sandbox_id: str, *, owner: OwnerArg = UNSET,
                         wait: bool = True) -> bool: ...
        async def checkpoint(self, sandbox_id: str, name: str | None = None, *,
                             owner: OwnerArg = UNSET) -> SnapshotInfo: ...
        async def write_file(
            self, sandbox_id: str, path: str, data: bytes | bytearray | memoryview | str, *,
            mode: int = 0o644, parents: bool = True, owner: OwnerArg = UNSET,
        ) -> None: ...

    async def snapshot(self, sandbox_id: str, name: str | None = None, *,
                       shared_rw: bool = False, owner: OwnerArg = UNSET) -> SnapshotInfo:
        """Commit a sandbox's files as a snapshot that new sandboxes start from
        (``create(snapshot=...)``). Its processes are frozen while its writable layer is
        copied (a paused sandbox stays paused), then go on. See
        :mod:`corral.runtime.snapshots`.

        Volumes: ``ro`` and ``cow`` ones are referenced by name (a sandbox made from the
        snapshot mounts them again, as they are then; a ``cow`` volume's private writes
        are not in the snapshot); a sandbox with an ``rw`` volume is refused
        (:class:`InvalidState`: its files are shared, live state no snapshot can
        freeze), but for a fork (``shared_rw``: the copies share the volume too)."""
        self.snapshots.valid_name(name)  # a bad name first
        self._owned(sandbox_id, owner)
        live = self._get_live(sandbox_id)
        rw = [dest for mode, _, dest in live.volumes if mode == "rw"]
        if rw and not shared_rw:
            raise InvalidState(
                f"sandbox {sandbox_id} mounts rw volumes at {', '.join(rw)}: their files are "
                "shared with other sandboxes and cannot be snapshotted; mount them cow or "
                "ro, or copy what you need into the sandbox first",
                details={"sandbox_id": sandbox_id, "volumes": rw})
        self.snapshots.check_name(name, live.spec.tenant)  # free in its owner's namespace
        self.snapshots.check_quota(live.spec.tenant, {})  # quota full: before copying
        async with live.lock:
            if live.ending or live.state not in (SandboxState.RUNNING, SandboxState.PAUSED):
                raise InvalidState(
                    f"sandbox {sandbox_id} is {live.state.value}: only a running or paused "
                    "sandbox can be snapshotted",
                    details={"sandbox_id": sandbox_id, "state": live.state.value},
                )
            if live.proc is None:  # hibernated: its files are in its checkpoint only
                raise InvalidState(
                    f"sandbox {sandbox_id} is hibernated: resume it first (or create from "
                    "its checkpoint)", details={"sandbox_id": sandbox_id, "cause": "hibernated"})
            cgroup = None if live.state == SandboxState.PAUSED else live.cgroup
            upper = self.upper_dir(sandbox_id)
            staged = await self.snapshots.stage(upper, cgroup, source=sandbox_id, spec=live.spec,
                                                ids=self.owner_ids(sandbox_id))
        return await self.snapshots.commit(
            staged, name=name, spec=live.spec, parent=live.snapshot_id, source=sandbox_id
        )

    async def fork(self, sandbox_id: str, n: int, *, live: bool | None = None,
                   owner: OwnerArg = UNSET) -> list[SandboxInfo]:
        """``n`` new sandboxes with a copy of this one's files and its spec, made
        concurrently from a snapshot that goes away when the last of them ends.
        All or nothing: if one fails to start, the others are deleted. ``live``: its
        running processes too (default: when it is checkpointable; docs/live.md)."""
        acting = self.owners.of(owner)

        async def delete(sid: str) -> bool:
            return await self.delete(sid, owner=acting)

        async def create(spec: SandboxSpec) -> SandboxInfo:
            return await self.create(spec, owner=acting)

        return await fork_from(self, sandbox_id, n, create=create, delete=delete,
                               live=live, owner=acting)

    def fork_spec(self, sandbox_id: str, snapshot_id: str, *,
                  owner: OwnerArg = UNSET) -> SandboxSpec:
        """The spec of a copy of ``sandbox_id`` started from its snapshot: its own, with
        its secrets, which only the live sandbox holds (the registry keeps them masked)."""
        live = self._live.get(sandbox_id)
        secrets = live.spec.secrets if live is not None else {}
        return self.get(sandbox_id, owner=owner).spec.model_copy(
            update={"snapshot": snapshot_id, "secrets": secrets}
        )

    def resolve_spec(self, spec: SandboxSpec, *, owner: OwnerArg = UNSET) -> SandboxSpec:
        """The effective spec of a sandbox ``owner`` creates from ``spec``: with
        ``snapshot``, the fields not given come from the snapshot
        (:class:`SnapshotNotFound` if ``owner`` has none)."""
        return self.snapshots.resolve(spec, owner=owner)

    def list_snapshots(self, *, owner: OwnerArg = UNSET) -> list[SnapshotInfo]:
        return self.snapshots.list(owner=owner)

    def get_snapshot(self, id_or_name: str, *, owner: OwnerArg = UNSET) -> SnapshotInfo:
        """A snapshot by id or name; :class:`SnapshotNotFound` if there is none."""
        return self.snapshots.get(id_or_name, owner=owner)

    async def delete_snapshot(self, id_or_name: str, *, owner: OwnerArg = UNSET) -> bool:
        """Delete a snapshot. Sandboxes started from it keep running; its layers are
        removed when the last of them ends. Idempotent: False if it did not exist."""
        return await self.snapshots.delete(id_or_name, owner=owner)

    async def verify_snapshot(self, id_or_name: str, *, owner: OwnerArg = UNSET) -> SnapshotInfo:
        """Re-read a snapshot's layers against their checksums (:class:`InvalidState`
        if one was changed on disk). Done by itself before a layer's first use after a
        restart."""
        return await self.snapshots.verify(id_or_name, owner=owner)

    async def gc_layers(self) -> list[str]:
        """Remove the layers no snapshot or sandbox references; returns their ids."""
        return await self.snapshots.gc()


FORK_INDEX_ENV = "CORRAL_FORK_INDEX"
FORK_INDEX_FILE = "/tmp/.corral-fork-index"


def _indexed(spec: SandboxSpec, i: int) -> SandboxSpec:
    """A live fork's copy ``i``: its commands get ``CORRAL_FORK_INDEX``."""
    return spec.model_copy(update={"env": {**spec.env, FORK_INDEX_ENV: str(i)}})


async def fork_from(
    engine: SnapshotOps,
    sandbox_id: str,
    n: int,
    *,
    create: Callable[[SandboxSpec], Awaitable[SandboxInfo]],
    delete: Callable[[str], Awaitable[object]],
    tags: Sequence[str] | None = None,
    abandoned: Callable[[], Awaitable[bool]] | None = None,
    live: bool | None = None,
    each: bool = False,
    owner: OwnerArg = UNSET,
) -> list[Any]:
    """``n`` new sandboxes with ``sandbox_id``'s files and spec (``tags`` replaces its
    tags), made by ``create`` from one snapshot that goes away at once (its layers stay
    while the copies run). All or nothing: on any failure, or if ``abandoned()`` says
    the caller left, what was made is deleted and the error (or :class:`Abandoned`)
    raised. ``live`` (default: if the sandbox is checkpointable): from a checkpoint,
    so the copies run its processes on (:mod:`corral.runtime.engine_live`); copy ``i``
    knows it is one: ``CORRAL_FORK_INDEX=i`` for its commands, and ``i`` in
    ``/tmp/.corral-fork-index`` (written once it runs) for the processes restored.
    ``each`` (E2B's fork): each copy stands alone, the list holds the
    :class:`SandboxInfo` or the exception of each, in order; only a caller that left
    still deletes them all."""
    if isinstance(n, bool) or not isinstance(n, int) or n < 1:
        raise InvalidArgument(f"fork needs n >= 1 copies, got {n!r}")
    if live is None:
        live = engine.get(sandbox_id, owner=owner).spec.checkpointable
    snap = await (engine.checkpoint(sandbox_id, owner=owner) if live
                  else engine.snapshot(sandbox_id, shared_rw=True, owner=owner))
    engine.events.emit(Forking(sandbox_id, snap.id))  # the copies' logs say "forked"
    try:
        spec = engine.fork_spec(sandbox_id, snap.id, owner=owner)
        if tags is not None:
            spec = spec.model_copy(update={"tags": list(tags)})
        specs = [_indexed(spec, i) if live else spec for i in range(n)]
        made = await asyncio.gather(*(create(s) for s in specs), return_exceptions=True)
        if live:  # processes that were running learn it from a file
            await asyncio.gather(*(
                engine.write_file(r.id, FORK_INDEX_FILE, f"{i}\n", owner=owner)
                for i, r in enumerate(made) if isinstance(r, SandboxInfo)),
                return_exceptions=True)
    finally:
        engine.events.emit(Forking(sandbox_id, snap.id, done=True))
        await engine.delete_snapshot(snap.id, owner=owner)  # its layers: deferred while the copies run
    ok = [r for r in made if isinstance(r, SandboxInfo)]
    failed = [r for r in made if isinstance(r, BaseException)]
    if each:
        failed = [r for r in failed if not isinstance(r, Exception)]  # a cancel: all go
    if failed or (abandoned is not None and await abandoned()):
        await asyncio.gather(*(delete(r.id) for r in ok))
        if failed:
            raise failed[0]
        raise Abandoned()
    return list(made) if each else ok
