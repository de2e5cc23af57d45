"""Data shared by every layer: the sandbox spec, its states, and what calls return.

The same models are the Python API and the wire format (the server serialises them,
the SDK parses them), so a field added here exists everywhere at once.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from enum import Enum
from typing import Annotated, Any, Literal

from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    SecretStr,
    StrictFloat,
    StrictInt,
    StringConstraints,
    ValidationError,
    ValidationInfo,
    field_validator,
)

from corral._model import Model
from corral.errors import InvalidArgument
from corral.network_schema import NETWORK_NAME_RE, NetworkPolicy
from corral.volume_schema import check_volumes

DEFAULT_IMAGE = "python"
DEFAULT_CPUS = 1.0
DEFAULT_MEMORY_MB = 1024
DEFAULT_PIDS = 256
DEFAULT_DISK_MB = 2048
DEFAULT_INODES = 1 << 17  # files, directories and links the writable layer may hold
DEFAULT_TIMEOUT_S = 3600.0
DEFAULT_OPEN_FILES = 1024
DEFAULT_WORKDIR = "/workspace"
DEFAULT_EXEC_TIMEOUT_S = 60.0
TENANT_NAME = r"^[a-z0-9][a-z0-9_-]{0,62}$"  # a tenant's name: lower-case, digits, - and _
DEFAULT_MAX_OUTPUT = 1 << 20  # bytes kept per stream (stdout, stderr) of one command
MAX_DEFAULT_OUTPUT_TAIL = 8 << 20  # the default tail's ceiling (the agent holds it in memory)
MAX_TIMEOUT_S = 30 * 86400.0  # the longest lifetime, command or process timeout

MAX_TAGS = 64  # per sandbox; each tag is 1-128 characters
MAX_ERRORS = 10  # validation errors listed in one reply (the count is given in full)
MAX_ERROR_CHARS = 200  # each error's field and message are clipped to this

_TAG_RE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.:=/@+-]{0,127}$")
_ENV_KEY_RE = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*$")
_GPU_REF_RE = re.compile(r"^(\d{1,2}|GPU-[0-9a-fA-F-]{8,64}|MIG-[0-9a-fA-F-]{8,64})$")


class SandboxState(str, Enum):
    """Lifecycle: pending → running ⇄ paused → stopping → stopped / failed."""

    PENDING = "pending"
    RUNNING = "running"
    PAUSED = "paused"
    STOPPING = "stopping"
    STOPPED = "stopped"
    FAILED = "failed"

    @property
    def terminal(self) -> bool:
        return self in (SandboxState.STOPPED, SandboxState.FAILED)


TRANSITIONS: dict[SandboxState, frozenset[SandboxState]] = {
    SandboxState.PENDING: frozenset({SandboxState.RUNNING, SandboxState.FAILED}),
    SandboxState.RUNNING: frozenset(
        {SandboxState.PAUSED, SandboxState.STOPPING, SandboxState.FAILED}
    ),
    SandboxState.PAUSED: frozenset(
        {SandboxState.RUNNING, SandboxState.STOPPING, SandboxState.FAILED}
    ),
    SandboxState.STOPPING: frozenset({SandboxState.STOPPED, SandboxState.FAILED}),
    SandboxState.STOPPED: frozenset(),
    SandboxState.FAILED: frozenset(),
}


class Storage(str, Enum):
    """Where a sandbox's writable layer lives (:mod:`corral.runtime.diskimage`)."""

    MEMORY = "memory"  # a tmpfs of disk_mb, charged to its memory (default: fastest)
    DISK = "disk"  # an ext4 image of disk_mb on the host's disk: writes cost no memory


class NetworkMode(str, Enum):
    NONE = "none"  # loopback only (default)
    HOST = "host"  # the host's network namespace: opt-in, for builds and trusted code


class SandboxSpec(Model):
    """What a sandbox is made of. Every limit has a default; all are validated."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    image: str = DEFAULT_IMAGE
    # Strict numbers: "512" or true is refused, never coerced (an int is a valid float).
    cpus: StrictFloat = Field(DEFAULT_CPUS, gt=0, le=256)
    memory_mb: StrictInt = Field(DEFAULT_MEMORY_MB, ge=16, le=1 << 20)
    pids: StrictInt = Field(DEFAULT_PIDS, ge=4, le=1 << 16)
    disk_mb: StrictInt = Field(DEFAULT_DISK_MB, ge=1, le=1 << 22)
    inodes: StrictInt = Field(DEFAULT_INODES, ge=64, le=1 << 22)
    storage: Storage = Storage.MEMORY
    open_files: StrictInt = Field(DEFAULT_OPEN_FILES, ge=16, le=1 << 16)
    timeout: StrictFloat = Field(DEFAULT_TIMEOUT_S, gt=0, le=MAX_TIMEOUT_S)
    idle_timeout: StrictFloat | None = Field(None, gt=0, le=MAX_TIMEOUT_S)
    env: dict[str, str] = Field(default_factory=dict)
    # Environment variables whose values are never stored or shown: the registry, the
    # API's replies, `corral ls/inspect` and logs hold "**********" (pydantic's
    # SecretStr); commands get the real values. Not inherited from a snapshot.
    secrets: dict[str, SecretStr] = Field(default_factory=dict, max_length=256)
    workdir: str = DEFAULT_WORKDIR
    tags: list[str] = Field(default_factory=list, max_length=MAX_TAGS)
    # "none" (loopback only), "host" (the host's network: admins only), an egress
    # policy {"allow": [...], "deny": [...]} (corral.network_schema, docs/network.md), or
    # the name of a stored one (corral.Network): the daemon puts its policy here at create
    network: NetworkMode | NetworkPolicy | Annotated[
        str, StringConstraints(pattern=NETWORK_NAME_RE.pattern)] = Field(
        NetworkMode.NONE, union_mode="left_to_right")
    # Volumes by mount point: {"/data": "NAME"} ("NAME:ro", "NAME:cow" (the default),
    # "NAME:rw"; an admin may give a host directory, "/srv/data:ro"): corral.volume_schema
    volumes: dict[str, str] = Field(default_factory=dict)
    # GPUs (NVIDIA, :mod:`corral.runtime.gpus`): a count, "all", or GPU indices/UUIDs;
    # held exclusively unless ``gpu_shared`` (then only with other sharers).
    gpus: StrictInt | Literal["all"] | list[str] | None = None
    gpu_shared: bool = False
    # Its running processes can be saved and restored (CRIU, docs/live.md): the
    # sandbox user is uid 0 of its user namespace (still without any capability) and
    # that namespace is not nested, as CRIU needs; nothing else changes.
    checkpointable: bool = False
    # What its ``timeout`` does: "stop" it (the default), or "hibernate" it (processes
    # and files to disk, memory freed; its next use resumes it with a fresh lifetime as
    # long: docs/live.md). "hibernate" needs ``checkpointable`` and what CRIU can dump:
    # loopback alone (network "none"), no volumes, no GPUs.
    on_timeout: Literal["stop", "hibernate"] = "stop"
    # Start the image's ENTRYPOINT + CMD (Dockerfile, OCI config) as a background process
    # once the sandbox is up, as the image's USER, in its WORKDIR, with its ENV
    # (``GET .../processes`` lists it; docs/users.md). Refused for an image with neither.
    run_entrypoint: bool = False
    # Start from a snapshot (its id or name) instead of the bare image. Fields not given
    # explicitly (all but ``tags``) default to those of the sandbox the snapshot was
    # taken from; ``image`` may be left out, and if given must be the snapshot's image.
    snapshot: str | None = Field(None, min_length=1, max_length=128)
    # The tenant (``corral token create NAME``) it belongs to; None: the admin's. Set by
    # the daemon from the caller's token (a tenant's own value is overwritten).
    tenant: str | None = Field(None, pattern=TENANT_NAME)

    @field_validator("env")
    @classmethod
    def _env_keys(cls, env: dict[str, str]) -> dict[str, str]:
        for k, v in env.items():
            if not _ENV_KEY_RE.match(k) or "\0" in v:
                raise ValueError(f"invalid environment variable name or value: {k!r}")
        return env

    @field_validator("secrets")
    @classmethod
    def _secret_keys(cls, secrets: dict[str, SecretStr]) -> dict[str, SecretStr]:
        for k, v in secrets.items():
            if not _ENV_KEY_RE.match(k) or "\0" in v.get_secret_value():
                raise ValueError(f"invalid secret name or value: {k!r}")
        return secrets

    @field_validator("on_timeout")
    @classmethod
    def _hibernates(cls, v: str, info: ValidationInfo) -> str:
        if v == "hibernate":  # (the fields it depends on are declared, so checked, first)
            if not info.data.get("checkpointable"):
                raise ValueError("'hibernate' needs checkpointable=True (its processes "
                                 "are saved with CRIU: docs/live.md)")
            if (info.data.get("network", NetworkMode.NONE) != NetworkMode.NONE
                    or info.data.get("volumes")
                    or info.data.get("gpus")):
                raise ValueError("'hibernate': a sandbox with a network, volumes or GPUs "
                                 "cannot be checkpointed; use network='none' and neither "
                                 "volumes nor GPUs, or on_timeout='stop'")
        return v

    def secret_env(self) -> dict[str, str]:
        """The secrets as environment variables, in clear (for commands only)."""
        return {k: v.get_secret_value() for k, v in self.secrets.items()}

    @field_validator("workdir")
    @classmethod
    def _workdir(cls, v: str) -> str:
        if not v.startswith("/") or "\0" in v or ".." in v.split("/"):
            raise ValueError("workdir must be an absolute path without '..', e.g. /workspace")
        return v.rstrip("/") or "/"

    @field_validator("volumes")
    @classmethod
    def _volumes(cls, volumes: dict[str, str]) -> dict[str, str]:
        return check_volumes(volumes)

    @field_validator("gpus")
    @classmethod
    def _gpus(cls, v: int | str | list[str] | None) -> int | str | list[str] | None:
        if isinstance(v, int) and not 0 <= v <= 64:
            raise ValueError("gpus must be a count from 0 to 64, 'all', or a list of GPU "
                             "indices or UUIDs")
        if isinstance(v, list):
            if not 1 <= len(v) <= 64 or any(not _GPU_REF_RE.match(r) for r in v):
                raise ValueError("gpus: list 1-64 GPU indices ('0') or UUIDs ('GPU-...')")
            v = list(dict.fromkeys(v))
        return v

    @field_validator("tags")
    @classmethod
    def _tags(cls, tags: list[str]) -> list[str]:
        for t in tags:
            if not _TAG_RE.match(t):
                raise ValueError(
                    f"invalid tag {t!r}: use 1-128 letters, digits or _.:=/@+- (e.g. 'job=42')"
                )
        return list(dict.fromkeys(tags))

    @classmethod
    def parse(cls, data: dict[str, Any] | None = None, **kwargs: Any) -> "SandboxSpec":
        """Validate, turning pydantic's error into an :class:`InvalidArgument`."""
        try:
            return cls.model_validate({**(data or {}), **kwargs})
        except ValidationError as exc:
            raise InvalidArgument(
                "invalid sandbox spec: " + _describe(exc), details={"errors": _errors(exc)}
            ) from None


def _clip(text: str) -> str:
    return text if len(text) <= MAX_ERROR_CHARS else text[: MAX_ERROR_CHARS - 1] + "…"


def _errors(exc: ValidationError) -> list[dict[str, Any]]:
    """The first :data:`MAX_ERRORS` errors, each clipped: a reply stays small however
    many elements of a request are wrong."""
    listed = exc.errors(include_url=False, include_context=False, include_input=False)
    return [
        {"field": _clip(".".join(str(p) for p in e["loc"])), "message": _clip(e["msg"])}
        for e in listed[:MAX_ERRORS]
    ]


def _describe(exc: ValidationError) -> str:
    more = exc.error_count() - MAX_ERRORS
    tail = f" (and {more} more errors)" if more > 0 else ""
    return "; ".join(f"{e['field']}: {e['message']}" for e in _errors(exc)) + tail


def validate_model(model: type[BaseModel], data: Any, what: str) -> Any:
    """Validate ``data`` as ``model`` or raise :class:`InvalidArgument` naming the fields."""
    try:
        return model.model_validate(data)
    except ValidationError as exc:
        raise InvalidArgument(
            f"invalid {what}: " + _describe(exc), details={"errors": _errors(exc)}
        ) from None


class SandboxInfo(Model):
    """A sandbox as listed: identity, state, spec and timestamps (unix seconds)."""

    id: str
    state: SandboxState
    spec: SandboxSpec
    created_at: float
    started_at: float | None = None
    ended_at: float | None = None
    reason: str | None = None
    node: str | None = None
    """The Ray node whose daemon runs it (on a cluster, see ``corral cluster up``)."""

    @property
    def tags(self) -> list[str]:
        return self.spec.tags

    @property
    def tenant(self) -> str | None:
        return self.spec.tenant

    @property
    def image(self) -> str:
        return self.spec.image


class SnapshotInfo(Model):
    """A snapshot: a sandbox's files, committed so that new sandboxes can start from them.

    ``layers`` are the ids of its filesystem layers, top first (the image lies below the
    last); ``size_bytes`` is their disk usage, the image excluded (layers shared with
    other snapshots are counted in each).
    """

    id: str
    name: str | None = None
    image: str
    layers: list[str]
    size_bytes: int
    created_at: float
    source_sandbox: str | None = None
    # "files": the writable layer only; "live": its processes too (a checkpoint,
    # docs/live.md): a sandbox created from it runs them on from where they were
    kind: Literal["files", "live"] = "files"


def default_output_tail(max_output: int) -> int:
    """Bytes of ``max_output`` kept from the end of a stream when ``output_tail`` is not
    given: half, at most :data:`MAX_DEFAULT_OUTPUT_TAIL`."""
    return min(max_output // 2, MAX_DEFAULT_OUTPUT_TAIL)


@dataclass
class ExecResult:
    """How a command ended. ``returncode`` is negative (-signal) if a signal killed it.

    A stream that went over ``max_output`` is ``*_truncated``: it holds its head and
    its last ``output_tail`` bytes, and ``*_dropped`` bytes were left out between them
    (with ``output_tail=0``, the head only: the bytes were dropped at its end).
    ``output_limited_to`` (0: as asked) is the lower cap per stream the daemon gave the
    command, mid-stream, when its output memory budget could hold no more of it
    (:mod:`corral.runtime.output_budget`).
    """

    returncode: int
    stdout: bytes = b""
    stderr: bytes = b""
    timed_out: bool = False
    oom_killed: bool = False
    stdout_truncated: bool = False
    stderr_truncated: bool = False
    duration: float = 0.0
    stdout_dropped: int = 0
    stderr_dropped: int = 0
    output_tail: int = 0
    output_limited_to: int = 0

    @property
    def truncated(self) -> bool:
        return self.stdout_truncated or self.stderr_truncated

    @property
    def ok(self) -> bool:
        return self.returncode == 0 and not self.timed_out and not self.oom_killed


OutputStream = Literal["stdout", "stderr"]
ExecEventKind = Literal["stdout", "stderr", "exit"]


@dataclass
class ExecEvent:
    """One item of a streamed command: a chunk of ``stdout``/``stderr`` or the ``exit``.

    A stream over its cap has one event with ``dropped`` bytes (and no data) where they
    were left out: after its head, before its tail.
    """

    kind: ExecEventKind
    data: bytes = b""
    result: ExecResult | None = field(default=None)
    dropped: int = 0


@dataclass
class FileInfo:
    """A file or directory inside a sandbox."""

    path: str
    name: str
    size: int
    mode: int
    mtime: float
    is_dir: bool
    is_symlink: bool
