"""What the engine answers about its sandboxes: one (:meth:`get`), a listing
(:meth:`list`), a live one's usage and the counts by state, each filtered to what the
owner it names may see (:mod:`.ownership`).

A mixin of :class:`~corral.runtime.engine.Engine` (like :mod:`.engine_lifetime`).
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import TYPE_CHECKING, Any

from corral.errors import InvalidArgument, SandboxNotFound
from corral.runtime.live import Live
from corral.runtime.ownership import UNSET, OwnerArg, Owners
from corral.schema import SandboxInfo, SandboxState

if TYPE_CHECKING:
    from corral.runtime.gpus import GpuAllocator
    from corral.runtime.registry import Registry


class QueryOps:
    """Sandboxes as the owner a call names sees them (mixed into the engine)."""

    registry: Registry
    owners: Owners
    gpus: GpuAllocator
    _live: dict[str, Live]

    if TYPE_CHECKING:
        def _get_live(self, sandbox_id: str) -> Live: ...
        def _owned(self, sandbox_id: str, owner: OwnerArg) -> None: ...

    def get(self, sandbox_id: str, *, owner: OwnerArg = UNSET) -> SandboxInfo:
        """The sandbox ``sandbox_id`` as ``owner`` sees it (:mod:`.ownership`)."""
        acting = self.owners.of(owner)
        # another tenant's is not even read (registry.get): it answers like an unknown id
        info = self.registry.get(sandbox_id, owner=acting)
        if info is None or not self.owners.sees(info.spec, acting):
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
        owner: OwnerArg = UNSET,
    ) -> list[SandboxInfo]:
        """``owner``'s sandboxes carrying every tag in ``tags``, in any of the given states."""
        acting = self.owners.of(owner)
        if state is None:
            states: list[SandboxState] = []
        elif isinstance(state, (str, SandboxState)):
            states = [_state(state)]
        else:
            states = [_state(s) for s in state]
        return [i for i in self.registry.list(tags=list(tags), states=states)
                if self.owners.sees(i.spec, acting)]

    def agent_connected(self, sandbox_id: str) -> bool:
        """Whether ``sandbox_id`` runs and its agent is connected and idle, from the
        kernel's view of its channel (:meth:`AgentChannel.connected
        <corral.runtime.channel.AgentChannel.connected>`; no round trip). The daemon's
        own question (warm pools): no owner."""
        live = self._live.get(sandbox_id)
        return (live is not None and live.state == SandboxState.RUNNING and not live.ending
                and live.channel is not None and live.channel.connected())

    def usage(self, sandbox_id: str, *, owner: OwnerArg = UNSET) -> dict[str, Any]:
        """Current CPU seconds and memory (MB) of a live sandbox; for one holding GPUs,
        ``gpus``, ``gpu_memory_mb`` and ``gpu_utilization`` (percent) too."""
        self._owned(sandbox_id, owner)
        live = self._get_live(sandbox_id)
        out: dict[str, Any] = {
            "cpu_seconds": live.cgroup.cpu_seconds(),
            "memory_mb": live.cgroup.memory_bytes() / (1 << 20),
        }
        if live.gpus is not None:  # its GPUs' memory (its processes') and busy percent
            out.update(self.gpus.usage(live.id, live.cgroup.pids()))
        return out

    def counts(self, *, owner: OwnerArg = UNSET) -> dict[str, int]:
        """Sandboxes by state: ``owner``'s own (the admin's: all of them)."""
        acting = self.owners.of(owner)
        if acting is None:
            return self.registry.counts()
        mine = [i.state.value for i in self.list(owner=acting)]
        return {state: mine.count(state) for state in set(mine)}


def _state(s: SandboxState | str) -> SandboxState:
    try:
        return SandboxState(s)
    except ValueError:
        raise InvalidArgument(
            f"unknown state {s!r}: use one of {', '.join(x.value for x in SandboxState)}"
        ) from None




_Live = Live  # the name the runtime's other modules knew it by
