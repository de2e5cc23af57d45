# Generated from _async/_snapshot.py by scripts/gen_sync.py: edit that file, not this one.
# ruff: noqa: I001  (the imports keep the source's order, sorted for _async)
"""A snapshot: a sandbox's files, committed so that new sandboxes start from them."""

from __future__ import annotations

import builtins
from typing import Any, Self
from urllib.parse import quote

from corral.client._sync._client import Client
from corral.client._sync._sandbox import Sandbox
from corral.schema import SnapshotInfo


class Snapshot:
    """A snapshot on the daemon; take one with :meth:`Sandbox.snapshot`.

    Every sandbox restored from it starts with the files the sandbox had when the
    snapshot was taken, and the spec fields not given (all but ``tags``); copies never
    see each other's writes::

        snap = base.snapshot(name="with-deps")
        sb = snap.restore(tags=["episode=1"])      # or Sandbox.create(snapshot=snap)
        snap.delete()                              # sb keeps running
    """

    def __init__(self, info: SnapshotInfo, *, client: Client) -> None:
        self._info = info
        self._client = client
        self._path = f"/v1/snapshots/{quote(info.id, safe='')}"

    @classmethod
    def get(cls, id_or_name: str, *, client: Client | None = None) -> Self:
        """A snapshot by id or name; :class:`~corral.errors.SnapshotNotFound` if none."""
        client = client or Client.default()
        response = client.request("GET", f"/v1/snapshots/{quote(id_or_name, safe='')}")
        return cls(SnapshotInfo.model_validate(response.json()), client=client)

    @classmethod
    def list(cls, *, client: Client | None = None) -> builtins.list[Self]:
        """Every snapshot on the daemon."""
        client = client or Client.default()
        response = client.request("GET", "/v1/snapshots")
        return [
            cls(SnapshotInfo.model_validate(d), client=client)
            for d in response.json()["snapshots"]
        ]

    @property
    def info(self) -> SnapshotInfo:
        return self._info

    @property
    def id(self) -> str:
        return self._info.id

    @property
    def name(self) -> str | None:
        return self._info.name

    @property
    def image(self) -> str:
        return self._info.image

    @property
    def layers(self) -> builtins.list[str]:
        return self._info.layers

    @property
    def size_bytes(self) -> int:
        return self._info.size_bytes

    @property
    def created_at(self) -> float:
        return self._info.created_at

    @property
    def client(self) -> Client:
        return self._client

    def restore(self, **overrides: Any) -> Sandbox:
        """A new sandbox on this snapshot's files; ``overrides`` are keyword arguments
        of :meth:`Sandbox.create` (``memory_mb``, ``tags``, ...)."""
        overrides.setdefault("client", self._client)
        return Sandbox.create(snapshot=self.id, **overrides)

    def delete(self) -> None:
        """Delete the snapshot (idempotent); sandboxes restored from it keep running."""
        self._client.request("DELETE", self._path)

    def __repr__(self) -> str:
        name = f" name={self.name!r}" if self.name else ""
        return f"<{type(self).__name__} {self.id}{name} image={self.image!r}>"
