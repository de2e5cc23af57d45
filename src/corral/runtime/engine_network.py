"""The engine's network verbs: a policy sandbox's events, a live policy change, and
named networks (``corral.Network``: :mod:`corral.runtime.networks`) of the owner each call names.

Mixed into :class:`~corral.runtime.engine.Engine`; the filter itself is
:mod:`corral.runtime.net`. A sandbox's ``network`` is fixed in kind when it starts:
a policy sandbox may change its policy (:meth:`NetworkOps.update_network`), but a
``"none"`` or ``"host"`` sandbox has no filter to change.
"""

from __future__ import annotations

import asyncio
import os
import socket
import threading
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any, TypeVar

from corral.errors import InvalidArgument, InvalidState, PortClosed
from corral.network_schema import NetworkInfo, NetworkPolicy
from corral.runtime import syscalls
from corral.runtime.ownership import UNSET, OwnerArg
from corral.schema import NetworkMode, SandboxInfo, SandboxSpec

if TYPE_CHECKING:
    from corral.runtime.live import Live
    from corral.runtime.net import NetworkManager
    from corral.runtime.networks import Networks
    from corral.runtime.ownership import Owners
    from corral.runtime.registry import Registry


PORT_CONNECT_TIMEOUT_S = 10.0


class NetworkOps:
    """``network_events``, ``update_network``, ``connect_port``, named networks."""

    if TYPE_CHECKING:
        net: NetworkManager
        networks: Networks
        owners: Owners
        registry: Registry

        def _get_live(self, sandbox_id: str) -> Live: ...
        def _running(self, sandbox_id: str) -> Live: ...
        def get(self, sandbox_id: str, *, owner: OwnerArg = UNSET) -> SandboxInfo: ...
        def _owned(self, sandbox_id: str, owner: OwnerArg) -> None: ...
        async def reclaimed(self) -> None: ...
        _live: dict[str, Live]

    def _policy_live(self, sandbox_id: str, owner: OwnerArg) -> Live:
        self._owned(sandbox_id, owner)
        live = self._get_live(sandbox_id)
        if not isinstance(live.spec.network, NetworkPolicy):
            raise InvalidState(
                f"sandbox {sandbox_id} was created with network="
                f"{getattr(live.spec.network, 'value', live.spec.network)!r}: "
                "only a sandbox created with a policy ({'allow': [...]}) has a filter to "
                "show or change; create a new one with a policy",
                details={"sandbox_id": sandbox_id})
        return live

    def resolve_network(self, spec: SandboxSpec, *, owner: OwnerArg = UNSET) -> SandboxSpec:
        """A spec naming a network (``network="NAME"``) with that network's policy as it
        is now (``owner``'s own network; NetworkNotFound otherwise), joining it if it is
        private. A policy joining one (``"join"``) must name a private network of the
        owner's."""
        owner = self.owners.of(owner)
        if isinstance(spec.network, NetworkPolicy) and spec.network.join is not None:
            joiner = self.owners.stamp(spec, owner).tenant
            if not self.networks.get(joiner, spec.network.join).private:
                raise InvalidArgument(
                    f"network {spec.network.join!r} is not private: only sandboxes of a "
                    "network made with private=True (corral network create NAME --private) "
                    "join one", details={"field": "network.join"})
            return spec
        if type(spec.network) is not str:  # NetworkMode is a str too
            return spec
        owner = self.owners.stamp(spec, owner).tenant  # a tenant's own, whatever it claims
        info = self.networks.get(owner, spec.network)
        policy = info.policy.model_copy(update={"join": info.name}) if info.private \
            else info.policy
        return spec.model_copy(update={"network": policy})

    def create_network(self, name: str, policy: NetworkPolicy, *,
                       private: bool = False, owner: OwnerArg = UNSET) -> NetworkInfo:
        """A named network of ``owner`` (the caller checked its rules' rights)."""
        if policy.join is not None or policy.alias is not None:
            raise InvalidArgument("a named network's policy has no 'join' or 'alias': make "
                                  "it private=True, and give an alias per sandbox",
                                  details={"field": "policy.join"})
        return self.networks.create(self.owners.of(owner), name, policy, private=private)

    def list_networks(self, *, owner: OwnerArg = UNSET) -> list[NetworkInfo]:
        return self.networks.of(self.owners.of(owner))

    def get_network(self, name: str, *, owner: OwnerArg = UNSET) -> NetworkInfo:
        return self.networks.get(self.owners.of(owner), name)

    async def remove_network(self, name: str, *, owner: OwnerArg = UNSET) -> None:
        """Remove it (sandboxes made from it keep their copy of its policy); a private
        one only when no sandbox is on it. A deleted sandbox leaves it in its teardown,
        which a DELETE's reply does not wait for: those are waited for here."""
        owner = self.owners.of(owner)
        private = self.networks.get(owner, name).private
        on = self.net.private.members(owner, name) if private else []
        if set(on) - set(self._live):  # some were deleted: their teardowns take them off
            await self.reclaimed()
            on = self.net.private.members(owner, name)
        if on:
            raise InvalidState(f"private network {name!r} has {len(on)} sandboxes on it "
                               f"({', '.join(on[:5])}): delete them first",
                               details={"network": name, "sandboxes": on[:100]})
        self.networks.remove(owner, name)

    async def _attach_network(self, live: Live) -> None:
        """A policy sandbox's link, made before its launcher starts (which joins it)."""
        policy = live.spec.network
        if not isinstance(policy, NetworkPolicy):
            return
        if policy.join is not None and policy.alias is not None:
            holder = self.net.private.holder(live.spec.tenant, policy.join, policy.alias)
            if holder is not None and holder not in self._live:  # deleted: a DELETE's
                await self.reclaimed()  # reply does not wait for its teardown (its place)
        link = await self.net.attach(live.id, policy, live.spec.tenant)
        live.netns = str(link.netns_path)
        # any nameserver does: nftables sends all DNS to corral's resolver
        resolv = live.sandbox_dir / "resolv.conf"
        resolv.write_text(f"nameserver {link.host_ip}\n")
        os.chmod(resolv, 0o644)  # whatever the daemon's umask: the sandbox user reads it

    async def _settle_network(self, live: Live) -> None:
        if isinstance(live.spec.network, NetworkPolicy):
            await self.net.settle(live.id)

    async def connect_port(self, sandbox_id: str, port: int, *,
                           owner: OwnerArg = UNSET) -> socket.socket:
        """A connected, non-blocking TCP socket to ``port`` on the sandbox's own
        loopback (what an exposed port serves): made in the sandbox's network
        namespace by the daemon, so it works with ``network="none"`` too, and the
        sandbox reaches nothing new."""
        if not 1 <= port <= 65535:
            raise InvalidArgument(f"invalid port {port}: use 1-65535")
        self._owned(sandbox_id, owner)
        live = self._running(sandbox_id)
        netns = live.netns or _namespace_of(live)
        sock = await asyncio.to_thread(socket_in, netns) if netns else socket.socket()
        sock.setblocking(False)
        try:
            async with asyncio.timeout(PORT_CONNECT_TIMEOUT_S):
                await asyncio.get_running_loop().sock_connect(sock, ("127.0.0.1", port))
        except (OSError, TimeoutError) as exc:
            sock.close()
            raise PortClosed(
                f"nothing answers on port {port} in sandbox {sandbox_id} ({exc}): start a "
                f"server there listening on 0.0.0.0:{port} or 127.0.0.1:{port}",
                details={"sandbox_id": sandbox_id, "port": port}) from None
        live.port_conns.add(sock)
        return sock

    def network_events(self, sandbox_id: str, *,
                       owner: OwnerArg = UNSET) -> list[dict[str, Any]]:
        """The connections and DNS queries of a policy sandbox, allowed and refused,
        oldest first (the last 1000): time, kind (tcp, dns), name, ip, port, verdict
        (allowed, refused) and the reason."""
        self._policy_live(sandbox_id, owner)
        return self.net.events(sandbox_id)

    async def update_network(self, sandbox_id: str, network: NetworkPolicy | dict[str, Any],
                             *, owner: OwnerArg = UNSET) -> SandboxInfo:
        """Enforce a new policy on a running policy sandbox; connections it refuses
        are reset at once."""
        live = self._policy_live(sandbox_id, owner)
        if not isinstance(network, NetworkPolicy):
            if not isinstance(network, dict):
                raise InvalidArgument("update_network takes a policy {'allow': [...], "
                                      "'deny': [...]}; 'none' and 'host' are fixed at create")
            network = SandboxSpec.parse(network=network).network  # type: ignore[assignment]
        assert isinstance(network, NetworkPolicy)
        old = live.spec.network
        assert isinstance(old, NetworkPolicy)
        if (network.join, network.alias) != (None, None) and (
                (network.join, network.alias) != (old.join, old.alias)):
            raise InvalidArgument(f"sandbox {sandbox_id} joined network {old.join!r} as "
                                  f"{old.alias!r} at create: that stays; leave 'join' and "
                                  "'alias' out", details={"field": "network.join"})
        network = network.model_copy(update={"join": old.join, "alias": old.alias})
        async with live.lock:
            spec = SandboxSpec.parse({**live.spec.model_dump(mode="json", exclude={"secrets"}),
                                      "secrets": live.spec.secret_env(),
                                      "network": network.model_dump()})
            self.registry.set_spec(live.id, spec)
            live.spec = spec
            await self.net.update(sandbox_id, network)
        return self.get(sandbox_id, owner=None)


def _namespace_of(live: Live) -> str | None:
    """The network namespace of a sandbox without a policy: its agent's (``"none"``:
    bwrap's own), or None for ``"host"`` (the daemon's)."""
    if live.spec.network == NetworkMode.HOST or live.proc is None:
        return None
    bwrap = live.proc.pid
    children = Path(f"/proc/{bwrap}/task/{bwrap}/children").read_text().split()
    if len(children) != 1:
        raise InvalidState(f"sandbox {live.id} is ending", details={"sandbox_id": live.id})
    return f"/proc/{children[0]}/ns/net"


T = TypeVar("T")


def socket_in(netns: str) -> socket.socket:
    """A TCP socket of the network namespace at ``netns``."""
    return made_in(netns, lambda: socket.socket(socket.AF_INET, socket.SOCK_STREAM))


def made_in(netns: str, make: Callable[[], T]) -> T:
    """What ``make`` makes (sockets) in the network namespace at ``netns`` (a socket
    keeps the namespace it was made in). Made in a thread of its own that exits right
    after: setns moves only the calling thread, and a thread that could not move back
    must not serve anything else."""
    made: list[T | BaseException] = []

    def work() -> None:
        try:
            own = os.open("/proc/thread-self/ns/net", os.O_RDONLY | os.O_CLOEXEC)
            target = os.open(netns, os.O_RDONLY | os.O_CLOEXEC)
            try:
                syscalls.setns_net(target, netns)
                try:
                    made.append(make())
                finally:
                    syscalls.setns_net(own, "the daemon's own network namespace")
            finally:
                os.close(own)
                os.close(target)
        except BaseException as exc:  # noqa: BLE001 - handed to the caller
            made.append(exc)

    t = threading.Thread(target=work, name="corral-netns", daemon=True)
    t.start()
    t.join()
    got = made[0]
    if isinstance(got, BaseException):
        raise got
    return got
