# Generated from _async/_network.py by scripts/gen_sync.py: edit that file, not this one.
# ruff: noqa: I001  (the imports keep the source's order, sorted for _async)
"""Named networks on the daemon: egress policies that sandboxes use by name."""

from __future__ import annotations

import builtins
from collections.abc import Sequence

from typing_extensions import Self  # typing's since 3.11 only

from corral.client._sync._client import Client
from corral.network_schema import NetworkInfo, NetworkPolicy


class Network:
    """A named network: an egress policy stored on the daemon (per tenant), used by name::

        Network.create("pip-only", allow=["pypi"])
        sb = Sandbox.create(network=Network("pip-only"))  # or "pip-only"

    ``Network(name)`` is a reference and does no I/O; :meth:`create`, :meth:`get`
    and :meth:`list` ask the daemon. Each sandbox gets the policy as it is when the
    sandbox is created (``update_network`` changes one sandbox's). Unknown names raise
    :class:`~corral.errors.NetworkNotFound`; a tenant's network naming private ranges,
    :class:`~corral.errors.Forbidden`. A private one (``private=True``) also joins its
    sandboxes, which reach each other directly by id or alias. See docs/network.md.
    """

    def __init__(self, name: str, *, info: NetworkInfo | None = None,
                 client: Client | None = None) -> None:
        self._name = name
        self._info = info
        self._client = client

    @property
    def name(self) -> str:
        return self._name

    @property
    def info(self) -> NetworkInfo | None:
        """What the daemon said of it (None for a bare reference)."""
        return self._info

    @property
    def policy(self) -> NetworkPolicy | None:
        return None if self._info is None else self._info.policy

    @classmethod
    def create(cls, name: str, *, allow: Sequence[str] = (), deny: Sequence[str] = (),
                     max_mbps: int | None = None, private: bool = False,
                     client: Client | None = None) -> Self:
        """A new named network (rules as in ``network={"allow": [...], ...}``).

        ``private=True``: its sandboxes also reach each other directly, by id or alias
        (a private network; :meth:`member` gives one an alias and its own rules)."""
        client = client or Client.default()
        policy = NetworkPolicy(allow=list(allow), deny=list(deny), max_mbps=max_mbps)
        response = client.call("create_network", json={
            "name": name, "policy": policy.model_dump(mode="json"), "private": private})
        return cls(name, info=NetworkInfo.model_validate(response.json()), client=client)

    @classmethod
    def get(cls, name: str, *, client: Client | None = None) -> Self:
        client = client or Client.default()
        response = client.call("get_network", {"name": name})
        return cls(name, info=NetworkInfo.model_validate(response.json()), client=client)

    @classmethod
    def list(cls, *, client: Client | None = None) -> builtins.list[Self]:
        client = client or Client.default()
        response = client.call("list_networks")
        return [cls(n["name"], info=NetworkInfo.model_validate(n), client=client)
                for n in response.json()["networks"]]

    def member(self, alias: str | None = None, *, allow: Sequence[str] = (),
               deny: Sequence[str] = (), max_mbps: int | None = None) -> NetworkPolicy:
        """A sandbox's ``network=`` joining this private network as ``alias`` (its id
        works too), reaching outside what ``allow`` / ``deny`` say (nothing by default)::

            db = Sandbox.create(network=net.member("db"))
            app = Sandbox.create(network=net.member("app", allow=["pypi"]))
        """
        return NetworkPolicy(allow=list(allow), deny=list(deny), max_mbps=max_mbps,
                             join=self.name, alias=alias)

    def delete(self) -> None:
        """Remove it (sandboxes made from it keep their copy of its policy)."""
        client = self._client or Client.default()
        client.call("delete_network", {"name": self.name})

    def __repr__(self) -> str:
        return f"<{type(self).__name__} {self.name}>"
