"""Lifetimes: the reaper that ends sandboxes past their ``timeout`` or ``idle_timeout``
and removes ended ones past the engine's ``retention``, and :meth:`set_timeout`.

A mixin of :class:`~corral.runtime.engine.Engine` (like :mod:`.engine_commands`).
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable, Coroutine
from typing import TYPE_CHECKING, Any

from corral.errors import InvalidState
from corral.runtime.live import Live
from corral.runtime.ownership import UNSET, OwnerArg
from corral.schema import MAX_TIMEOUT_S, SandboxInfo, SandboxSpec, SandboxState

if TYPE_CHECKING:
    from corral.runtime.registry import Registry

REAPER_INTERVAL_S = 0.5
RETENTION_BATCH = 100  # ended sandboxes removed per reaper pass, past their retention


class LifetimeOps:
    """When sandboxes end by themselves (mixed into the engine)."""

    registry: Registry
    retention: float | None  # ended sandboxes are deleted this long after (None: never)
    _live: dict[str, Live]
    _tasks: set[asyncio.Task[Any]]
    lifetime_cap: Callable[[SandboxInfo], float] | None  # (engine.py)

    if TYPE_CHECKING:
        def _get_live(self, sandbox_id: str) -> Live: ...
        def get(self, sandbox_id: str, *, owner: OwnerArg = UNSET) -> SandboxInfo: ...
        def _owned(self, sandbox_id: str, owner: OwnerArg) -> None: ...
        async def delete(self, sandbox_id: str, *, owner: OwnerArg = UNSET) -> bool: ...
        async def _end(self, live: Live, final: SandboxState, reason: str, *,
                       grace: float) -> None: ...
        async def _hibernate_at_timeout(self, live: Live, reason: str) -> None: ...
        async def _end_hibernated(self, live: Live) -> None: ...

    async def set_timeout(self, sandbox_id: str, seconds: float, *,
                          owner: OwnerArg = UNSET) -> SandboxInfo:
        """End the sandbox ``seconds`` from now instead of when its lifetime said (its
        spec's ``timeout`` becomes the new lifetime, counted from its start)."""
        self._owned(sandbox_id, owner)
        live = self._get_live(sandbox_id)
        async with live.lock:
            if live.ending or live.state.terminal:
                raise InvalidState(f"sandbox {live.id} is ending: its lifetime cannot change",
                                   details={"sandbox_id": live.id, "state": live.state.value})
            lifetime = (time.time() - (live.started_at or time.time())) + max(seconds, 0.001)
            lifetime = min(lifetime, MAX_TIMEOUT_S)
            spec = SandboxSpec.parse({**live.spec.model_dump(mode="json", exclude={"secrets"}),
                                      "secrets": live.spec.secret_env(), "timeout": lifetime})
            self.registry.set_spec(live.id, spec)
            live.spec = spec
        return self.get(sandbox_id, owner=None)

    async def _reap_loop(self) -> None:
        """End sandboxes past their lifetime (``timeout``) or idle for ``idle_timeout``."""
        while True:
            await asyncio.sleep(REAPER_INTERVAL_S)
            now_wall, now = time.time(), time.monotonic()
            if self.retention is not None:
                for sid in self.registry.ended_before(now_wall - self.retention, RETENTION_BATCH):
                    await self.delete(sid, owner=None)  # the engine's own work; its kept files go with it (kept_files.py)
            for live in list(self._live.values()):
                if live.ending or live.state not in (SandboxState.RUNNING, SandboxState.PAUSED):
                    continue
                if live.hibernating:
                    continue
                if live.hibernated is not None:  # its lifetime stands still, its maximum not
                    if self._past_maximum(live):
                        self._spawn(self._end_hibernated(live))
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
                    self._spawn(
                        self._hibernate_at_timeout(live, reason)
                        if reason.startswith("timeout") and spec.on_timeout == "hibernate"
                        and live.state == SandboxState.RUNNING
                        else self._end(live, SandboxState.STOPPED, reason, grace=0)
                    )

    def _spawn(self, work: Coroutine[Any, Any, None]) -> None:
        task = asyncio.create_task(work)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    def _past_maximum(self, live: Live) -> bool:
        """Whether hibernated ``live`` has lived its owner's maximum lifetime (counted
        from its create, hibernated time included): it can never be resumed, and would
        hold its places in the quotas for good."""
        if self.lifetime_cap is None:
            return False
        row = self.registry.get(live.id)
        return row is not None and self.lifetime_cap(row) <= 0
