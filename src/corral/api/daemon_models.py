"""The bodies of the daemon-wide operations (:mod:`corral.api.operations`): tenant
tokens, client leases, a cluster's node list and tenant refresh, and evaluation runs'
reports (bounded: nothing a client reports is trusted), and what daemons of a cluster
ask each other for (:mod:`corral.server.peer_layers`). Shared by the daemon and the
SDK, like :mod:`corral.api.models`."""

from __future__ import annotations

import math
from typing import Any, Literal

from pydantic import (
    ConfigDict,
    Field,
    StrictBool,
    StrictFloat,
    StrictInt,
    field_validator,
)

from corral._model import Model
from corral.schema import MAX_TIMEOUT_S
from corral.volume_schema import VolumeInfo

__all__ = [
    "EvalList", "EvalReport", "EvalRun", "Histogram",
    "ClusterNode", "ClusterNodes", "LeaseInfo", "LeaseRequest", "RefreshReply", "RefreshRequest",
    "TokenCreated", "TokenInfo", "TokenList", "TokenRequest", "TokenUpdate",
    "FetchRequest", "FetchStats", "ImageFetchRequest", "NodeProof", "PeerImage", "PeerLayer", "PeerSnapshot",
    "PeerVolume", "VolumeFetchRequest",
]


class TokenRequest(Model):
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
    max_gpus: StrictInt | None = Field(None, ge=0)


class TokenUpdate(Model):
    """New quotas of a tenant (``PATCH /v1/tokens/{name}``): only the fields sent
    change; ``null`` drops a quota. ``allow_host_network``: grant or take back the
    right to the host's network (taken back: the tenant's sandboxes using it stop)."""

    model_config = ConfigDict(extra="forbid")

    allow_host_network: StrictBool | None = None

    max_sandboxes: StrictInt | None = Field(None, ge=0)
    max_memory_mb: StrictInt | None = Field(None, ge=0)
    max_cpus: StrictFloat | StrictInt | None = Field(None, ge=0)
    max_lifetime: StrictFloat | StrictInt | None = Field(None, gt=0, le=MAX_TIMEOUT_S)
    max_snapshot_mb: StrictInt | None = Field(None, ge=0)
    max_builds: StrictInt | None = Field(None, ge=0)
    max_gpus: StrictInt | None = Field(None, ge=0)


class TokenInfo(Model):
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
    max_gpus: int | None = None
    usage: dict[str, float] = Field(default_factory=dict)


class TokenCreated(TokenInfo):
    token: str
    """The bearer token: shown this once."""


class TokenList(Model):
    tokens: list[TokenInfo]


LEASE_ID_PATTERN = r"^lease-[0-9a-f]{16}$"


class LeaseRequest(Model):
    """``POST /v1/leases``: how long the lease lives without a renewal."""

    ttl: float = Field(description="seconds; renew it more often than this (every ttl/3)")
    id: str | None = Field(
        default=None, pattern=LEASE_ID_PATTERN,
        description="the lease's id, chosen by the client: one lease taken on every node "
        "of a cluster under one id (taking it again renews it); default: a new one")


class LeaseInfo(Model):
    """A lease: its id, the tag its sandboxes carry, and when it ends unless renewed."""

    id: str
    tag: str
    ttl: float
    expires_at: float


class ClusterNode(Model):
    node_id: str
    tag: str
    url: str
    alive: bool = True
    capacity: dict[str, Any] | None = None
    key: str | None = None  # what its daemon proves itself with (cluster/proof.py)


class ClusterNodes(Model):
    nodes: list[ClusterNode]


class RefreshRequest(Model):
    model_config = ConfigDict(extra="forbid")
    name: str | None = Field(None, max_length=64)


class RefreshReply(Model):
    tenants: int
    revoked: bool


MAX_BINS = 50  # an evaluation report's bounds
MAX_TEXT = 300
MAX_ERROR = 1000


class Histogram(Model):
    """Counts of returns in ``len(counts)`` equal bins from ``low`` to ``high``."""

    model_config = ConfigDict(extra="forbid")
    low: float
    high: float
    counts: list[int] = Field(default_factory=list, max_length=MAX_BINS)

    @field_validator("counts")
    @classmethod
    def _non_negative(cls, counts: list[int]) -> list[int]:
        if any(c < 0 for c in counts):
            raise ValueError("histogram counts must be >= 0")
        return counts


class EvalReport(Model):
    """One evaluation run's progress, as its client reports it (the whole state each time)."""

    model_config = ConfigDict(extra="forbid")
    name: str = Field(max_length=MAX_TEXT, description="the policy's label")
    env: str = Field("", max_length=MAX_TEXT)
    state: Literal["running", "done", "failed"] = "running"
    total: int | None = Field(None, ge=0, le=10**9, description="episodes planned, if known")
    done: int = Field(0, ge=0, le=10**9)
    counts: dict[str, int] = Field(
        default_factory=dict, max_length=8, description="episodes by status (ok, error, ...)"
    )
    n: int = Field(0, ge=0, le=10**9, description="returns in the mean")
    mean: float | None = None
    ci_low: float | None = None
    ci_high: float | None = None
    confidence: float | None = Field(None, gt=0, lt=1)
    histogram: Histogram | None = None
    error: str | None = Field(None, max_length=MAX_ERROR)

    @field_validator("counts")
    @classmethod
    def _short_keys(cls, counts: dict[str, int]) -> dict[str, int]:
        if any(len(k) > 20 or v < 0 for k, v in counts.items()):
            raise ValueError("counts: status names of at most 20 characters, counts >= 0")
        return counts

    @field_validator("mean", "ci_low", "ci_high")
    @classmethod
    def _finite(cls, value: float | None) -> float | None:
        return value if value is None or math.isfinite(value) else None


class EvalRun(EvalReport):
    """A run as the daemon keeps it: the last report, its id, owner and times."""

    id: str
    owner: str | None = None
    started_at: float
    updated_at: float


class EvalList(Model):
    evals: list[EvalRun]


# ------------------------------------------------ daemon to daemon (peer_layers)


class _FromPeer(Model):
    model_config = ConfigDict(extra="forbid")
    node: str = Field(min_length=1, max_length=128)  # a node id (the directory has its URL)


class FetchRequest(_FromPeer):
    """Make ``snapshot`` (id or name) restorable here, from the daemon of ``node``."""

    snapshot: str = Field(min_length=1, max_length=128)


class PeerLayer(Model):
    id: str
    digest: str
    size_bytes: int


class PeerSnapshot(Model):
    """A snapshot as another node restores it: its row, and its layers, top first."""

    id: str
    name: str | None = None
    image: str
    image_digest: str
    created_at: float
    size_bytes: int
    source_sandbox: str | None = None
    spec: dict[str, Any]
    layers: list[PeerLayer]
    kind: str = "files"  # "live": with its process images (docs/live.md)
    live: dict[str, Any] | None = None  # a live one's images: digest, size, kernel, CRIU


class PeerImage(Model):
    """An image as another node pulls it: a built one's manifest (layers top first) and
    its root's content digest, or a root filesystem's ``kind`` and ``content``."""

    model_config = ConfigDict(extra="allow")
    name: str
    digest: str
    kind: str = "built"
    root: dict[str, Any] | None = None
    layers: list[PeerLayer] = []
    content: dict[str, Any] | None = None
    root_content: dict[str, Any] | None = None


class ImageFetchRequest(_FromPeer):
    """Make the built image ``image`` usable here, from the daemon of ``node``."""

    image: str = Field(min_length=1, max_length=128)


class VolumeFetchRequest(_FromPeer):
    """Make the caller's volume ``volume`` of ``node`` usable here (a copy of it)."""

    volume: str = Field(min_length=1, max_length=63)


class PeerVolume(VolumeInfo):
    """A volume as its home describes it to another node: with the digest of its
    content (``{"digest", "size_bytes"}``), by which its tree is fetched."""

    content: dict[str, Any]


class FetchStats(Model):
    layers: int
    bytes: int
    by_digest: dict[str, int]


class NodeProof(Model):
    """``GET /v1/cluster/proof``: a node's daemon signs its node id, the address its
    connection arrived at and the client's nonce with its node key (corral.cluster.proof)."""

    node_id: str
    signature: str
