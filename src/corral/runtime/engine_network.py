"""The engine's network verbs: a policy sandbox's events, a live policy change.

Mixed into :class:`~corral.runtime.engine.Engine`; the filter itself is
:mod:`corral.runtime.net`. A sandbox's ``network`` is fixed in kind when it starts:
a policy sandbox may change its policy (:meth:`NetworkOps.update_network`), but a
``"none"`` or ``"host"`` sandbox has no filter to change.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from corral.errors import InvalidArgument, InvalidState
from corral.network_schema import NetworkPolicy
from corral.schema import SandboxInfo, SandboxSpec

if TYPE_CHECKING:
    from corral.runtime.live import Live
    from corral.runtime.net import NetworkManager
    from corral.runtime.registry import Registry


class NetworkOps:
    """``network_events``, ``update_network``."""

    if TYPE_CHECKING:
        net: NetworkManager
        registry: Registry

        def _get_live(self, sandbox_id: str) -> Live: ...
        def get(self, sandbox_id: str) -> SandboxInfo: ...

    def _policy_live(self, sandbox_id: str) -> Live:
        live = self._get_live(sandbox_id)
        if not isinstance(live.spec.network, NetworkPolicy):
            raise InvalidState(
                f"sandbox {sandbox_id} was created with network={live.spec.network.value!r}: "
                "only a sandbox created with a policy ({'allow': [...]}) has a filter to "
                "show or change; create a new one with a policy",
                details={"sandbox_id": sandbox_id})
        return live

    def network_events(self, sandbox_id: str) -> list[dict[str, Any]]:
        """The connections and DNS queries of a policy sandbox, allowed and refused,
        oldest first (the last 1000): time, kind (tcp, dns), name, ip, port, verdict
        (allowed, refused) and the reason."""
        self._policy_live(sandbox_id)
        return self.net.events(sandbox_id)

    async def update_network(self, sandbox_id: str,
                             network: NetworkPolicy | dict[str, Any]) -> SandboxInfo:
        """Enforce a new policy on a running policy sandbox; connections it refuses
        are reset at once."""
        live = self._policy_live(sandbox_id)
        if not isinstance(network, NetworkPolicy):
            if not isinstance(network, dict):
                raise InvalidArgument("update_network takes a policy {'allow': [...], "
                                      "'deny': [...]}; 'none' and 'host' are fixed at create")
            network = SandboxSpec.parse(network=network).network  # type: ignore[assignment]
        assert isinstance(network, NetworkPolicy)
        async with live.lock:
            spec = SandboxSpec.parse({**live.spec.model_dump(mode="json", exclude={"secrets"}),
                                      "secrets": live.spec.secret_env(),
                                      "network": network.model_dump()})
            self.registry.set_spec(live.id, spec)
            live.spec = spec
            await self.net.update(sandbox_id, network)
        return self.get(sandbox_id)
