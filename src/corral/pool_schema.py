"""Warm pools on the wire: what a pool is made of, and how it is doing.

Shared by the runtime (:mod:`corral.runtime.pools`), the server and the SDK, like
:mod:`corral.schema` (kept apart from it only while snapshots change that module).

A pool's sandboxes carry the tag ``pool=<name>`` (:func:`pool_tag`); whether one is
ready or handed out is kept by the pool, not in tags (see :class:`PoolDetail`).
"""

from __future__ import annotations

import re

from pydantic import (
    ConfigDict,
    Field,
    StrictFloat,
    StrictInt,
    field_validator,
    model_validator,
)

from corral._model import Model
from corral.schema import SandboxInfo, SandboxSpec

DEFAULT_MIN_READY = 4
DEFAULT_MAX_SIZE = 64
MAX_POOL_SIZE = 10_000
DEFAULT_ACQUIRE_TIMEOUT_S = 60.0
MAX_RESERVE = 64  # sandboxes one reserve call may take at once
MAX_ACQUIRE_TIMEOUT_S = 3600.0
POOL_TAG_KEY = "pool"

_NAME_RE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.-]{0,62}$")


def pool_tag(name: str) -> str:
    """The tag every sandbox of pool ``name`` carries: ``pool=<name>``."""
    return f"{POOL_TAG_KEY}={name}"


class PoolSpec(Model):
    """``POST /v1/pools``: a pool keeps ``min_ready`` sandboxes of ``spec`` running and
    idle, and never has more than ``max_size`` (ready, starting and handed out) at once.

    ``name`` left out: the daemon picks one (``pool-…``).
    """

    model_config = ConfigDict(extra="forbid", frozen=True)

    name: str | None = None
    spec: SandboxSpec = Field(default_factory=SandboxSpec)
    min_ready: StrictInt = Field(DEFAULT_MIN_READY, ge=0, le=MAX_POOL_SIZE)
    max_size: StrictInt = Field(DEFAULT_MAX_SIZE, ge=1, le=MAX_POOL_SIZE)

    @field_validator("name")
    @classmethod
    def _name(cls, v: str | None) -> str | None:
        if v is not None and not _NAME_RE.match(v):
            raise ValueError(
                f"invalid pool name {v!r}: use 1-63 letters, digits or _.- (e.g. 'python-256')"
            )
        return v

    @model_validator(mode="after")
    def _sizes(self) -> "PoolSpec":
        if self.min_ready > self.max_size:
            raise ValueError(
                f"min_ready ({self.min_ready}) cannot exceed max_size ({self.max_size})"
            )
        return self


class AcquireRequest(Model):
    """``POST /v1/pools/{name}/acquire``: seconds to wait for a sandbox; with ``lease``
    (the caller's), the sandbox is held under it as a reserve's are (:class:`ReserveRequest`)."""

    model_config = ConfigDict(extra="forbid")

    timeout: StrictFloat = Field(DEFAULT_ACQUIRE_TIMEOUT_S, gt=0, le=MAX_ACQUIRE_TIMEOUT_S)
    lease: str | None = Field(None, min_length=1, max_length=100)


class ReserveRequest(Model):
    """``POST /v1/pools/{name}/reserve``: up to ``count`` of the pool's ready sandboxes at
    once (none waited for), held under the caller's lease ``lease``: when the lease ends
    (released, or not renewed: the client died) they end with it, used or not."""

    model_config = ConfigDict(extra="forbid")

    count: StrictInt = Field(ge=1, le=MAX_RESERVE)
    lease: str = Field(min_length=1, max_length=100)


class ReserveReply(Model):
    """The sandboxes a reserve took (maybe none: none was ready)."""

    sandboxes: list[SandboxInfo] = Field(default_factory=list)


class PoolInfo(Model):
    """A pool's settings and numbers.

    ``ready`` sandboxes wait to be handed out, ``starting`` are being made,
    ``acquired`` were handed out and still live, ``waiting`` acquires wait for one.
    Totals since the pool was made: ``created`` sandboxes, ``failed`` creates,
    ``discarded`` ready ones that failed the liveness check (or ended while ready),
    ``acquires`` handed out. ``acquire_wait_ms_p50`` is the median time an acquire spent
    in the daemon (recent ones); ``last_error`` the last create failure, if any.
    """

    name: str
    spec: SandboxSpec
    min_ready: int
    max_size: int
    created_at: float
    ready: int = 0
    starting: int = 0
    acquired: int = 0
    waiting: int = 0
    created: int = 0
    failed: int = 0
    discarded: int = 0
    acquires: int = 0
    acquire_wait_ms_p50: float | None = None
    last_error: str | None = None


class PoolDetail(PoolInfo):
    """``GET /v1/pools/{name}``: a pool, with the ids of its ready and handed-out sandboxes."""

    ready_ids: list[str] = Field(default_factory=list)
    acquired_ids: list[str] = Field(default_factory=list)


class PoolList(Model):
    pools: list[PoolInfo]
