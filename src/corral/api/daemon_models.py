"""The bodies of the daemon-wide operations (:mod:`corral.api.operations`): tenant
tokens, client leases, and a cluster's node list and tenant refresh. Shared by the
daemon and the SDK, like :mod:`corral.api.models`."""

from __future__ import annotations

from typing import Any

from pydantic import BaseModel, ConfigDict, Field, StrictBool, StrictFloat, StrictInt

from corral.schema import MAX_TIMEOUT_S

__all__ = [
    "ClusterNode", "ClusterNodes", "LeaseInfo", "LeaseRequest", "RefreshReply", "RefreshRequest",
    "TokenCreated", "TokenInfo", "TokenList", "TokenRequest", "TokenUpdate",
]


class TokenRequest(BaseModel):
    """A new tenant: its name and quotas (left out: only the daemon's own caps)."""

    model_config = ConfigDict(extra="forbid")

    name: str = Field(max_length=64)  # checked by TokenStore.create, with what to do
    max_sandboxes: StrictInt | None = Field(None, ge=0)
    max_memory_mb: StrictInt | None = Field(None, ge=0)
    max_cpus: StrictFloat | None = Field(None, ge=0)
    allow_images: StrictBool = False
    allow_host_network: StrictBool = False
    max_lifetime: StrictFloat | StrictInt | None = Field(None, gt=0, le=MAX_TIMEOUT_S)
    max_snapshot_mb: StrictInt | None = Field(None, ge=0)
    max_builds: StrictInt | None = Field(None, ge=0)


class TokenUpdate(BaseModel):
    """New quotas of a tenant (``PATCH /v1/tokens/{name}``): only the fields sent
    change; ``null`` drops a quota."""

    model_config = ConfigDict(extra="forbid")

    max_sandboxes: StrictInt | None = Field(None, ge=0)
    max_memory_mb: StrictInt | None = Field(None, ge=0)
    max_cpus: StrictFloat | StrictInt | None = Field(None, ge=0)
    max_lifetime: StrictFloat | StrictInt | None = Field(None, gt=0, le=MAX_TIMEOUT_S)
    max_snapshot_mb: StrictInt | None = Field(None, ge=0)
    max_builds: StrictInt | None = Field(None, ge=0)


class TokenInfo(BaseModel):
    """A tenant as listed: quotas, rights, creation time and current use (never its token)."""

    name: str
    max_sandboxes: int | None = None
    max_memory_mb: int | None = None
    max_cpus: float | None = None
    allow_images: bool = False
    allow_host_network: bool = False
    created_at: float
    max_lifetime: float | None = None
    max_snapshot_mb: int | None = None
    max_builds: int | None = None
    usage: dict[str, float] = Field(default_factory=dict)


class TokenCreated(TokenInfo):
    token: str
    """The bearer token: shown this once."""


class TokenList(BaseModel):
    tokens: list[TokenInfo]


class LeaseRequest(BaseModel):
    """``POST /v1/leases``: how long the lease lives without a renewal."""

    ttl: float = Field(description="seconds; renew it more often than this (every ttl/3)")


class LeaseInfo(BaseModel):
    """A lease: its id, the tag its sandboxes carry, and when it ends unless renewed."""

    id: str
    tag: str
    ttl: float
    expires_at: float


class ClusterNode(BaseModel):
    node_id: str
    tag: str
    url: str
    alive: bool = True
    capacity: dict[str, Any] | None = None
    key: str | None = None  # what its daemon proves itself with (cluster/proof.py)


class ClusterNodes(BaseModel):
    nodes: list[ClusterNode]


class RefreshRequest(BaseModel):
    model_config = ConfigDict(extra="forbid")
    name: str | None = Field(None, max_length=64)


class RefreshReply(BaseModel):
    tenants: int
    revoked: bool
