"""The HTTP API's own request and reply bodies (the sandbox models are in ``corral.schema``).

Command output is bytes; JSON carries text. :func:`exec_response` keeps both: ``stdout``
is the text (decoded with replacement characters if need be) and ``stdout_b64`` is
added, with the exact bytes, only when they are not valid UTF-8.
"""

from __future__ import annotations

import base64
import binascii
import dataclasses
import os
from typing import Any, Literal

from pydantic import (
    ConfigDict,
    Field,
    StrictBool,
    StrictFloat,
    StrictInt,
    model_validator,
)

from corral._model import Model
from corral.errors import InvalidArgument
from corral.network_schema import NetworkInfo, NetworkPolicy
from corral.pool_schema import PoolInfo
from corral.schema import (
    DEFAULT_EXEC_TIMEOUT_S,
    DEFAULT_MAX_OUTPUT,
    MAX_TIMEOUT_S,
    ExecResult,
    FileInfo,
    SandboxInfo,
    SandboxSpec,
    SandboxState,
    SnapshotInfo,
)
from corral.volume_schema import VolumeInfo

MAX_OUTPUT_LIMIT = 1 << 30  # bytes per stream a caller may ask the daemon to keep
MAX_STOP_GRACE_S = 300.0
MAX_FORK = 1024


class _Body(Model):
    """A request body: unknown fields refused; numbers and booleans are strict (no
    ``"512"`` for 512, no ``true`` for 1)."""

    model_config = ConfigDict(extra="forbid")


class ExecRequest(_Body):
    """``POST /v1/sandboxes/{id}/exec``: a shell string runs under ``/bin/sh -c``."""

    cmd: list[str] | str
    timeout: StrictFloat | None = Field(DEFAULT_EXEC_TIMEOUT_S, gt=0, le=30 * 86400)
    env: dict[str, str] = Field(default_factory=dict)
    cwd: str | None = None
    user: str | None = Field(None, max_length=64)  # "root" or the sandbox user: docs/users.md
    stdin: str | None = None
    stdin_b64: str | None = None
    max_output: StrictInt = Field(DEFAULT_MAX_OUTPUT, ge=0, le=MAX_OUTPUT_LIMIT)
    output_tail: StrictInt | None = Field(None, ge=0, le=MAX_OUTPUT_LIMIT)

    @model_validator(mode="after")
    def _one_stdin(self) -> "ExecRequest":
        if self.stdin is not None and self.stdin_b64 is not None:
            raise ValueError("pass stdin or stdin_b64, not both")
        if self.output_tail is not None and self.output_tail > self.max_output:
            raise ValueError("output_tail must not be more than max_output")
        return self

    def stdin_bytes(self) -> bytes | None:
        """The command's standard input as bytes, whichever field carried it."""
        if self.stdin_b64 is None:
            return self.stdin.encode() if self.stdin is not None else None
        try:
            return base64.b64decode(self.stdin_b64, validate=True)
        except (binascii.Error, ValueError):
            raise InvalidArgument(
                "stdin_b64 is not valid base64", details={"errors": [{"field": "stdin_b64"}]}
            ) from None


class StopRequest(_Body):
    """``POST /v1/sandboxes/{id}/stop``: seconds between SIGTERM and SIGKILL."""

    grace: StrictFloat = Field(2.0, ge=0, le=MAX_STOP_GRACE_S)


class SnapshotRequest(_Body):
    """``POST /v1/sandboxes/{id}/snapshot``: an optional unique name."""

    name: str | None = Field(None, min_length=1, max_length=64)


class ForkRequest(_Body):
    """``POST /v1/sandboxes/{id}/fork``: how many copies."""

    n: StrictInt = Field(ge=1, le=MAX_FORK)
    # its running processes too (a checkpoint, docs/live.md); default: if it is
    # checkpointable
    live: StrictBool | None = None


class MkdirRequest(_Body):
    """``POST /v1/sandboxes/{id}/files/mkdir``."""

    path: str
    parents: StrictBool = True
    mode: StrictInt = Field(0o755, ge=0, le=0o7777)


class ExecResponse(Model):
    """How a command ended, with its output (see the module docstring for ``*_b64``)."""

    returncode: int
    stdout: str = ""
    stderr: str = ""
    stdout_b64: str | None = None
    stderr_b64: str | None = None
    timed_out: bool = False
    oom_killed: bool = False
    stdout_truncated: bool = False
    stderr_truncated: bool = False
    duration: float = 0.0
    stdout_dropped: int = 0
    stderr_dropped: int = 0
    output_tail: int = 0
    output_limited_to: int = 0  # the cap per stream the output budget lowered it to


class RunRequest(_Body):
    """``POST /v1/run``: create a sandbox of ``spec``, run ``exec`` in it, delete it, in
    one round trip (a code reward's pattern)."""

    spec: SandboxSpec = Field(default_factory=SandboxSpec)
    exec: ExecRequest


class RunResponse(Model):
    """The command's result, and the id of the sandbox it ran in (deleted already)."""

    sandbox_id: str
    result: ExecResponse


EXEC_STATUS = tuple(name for name in ExecResponse.model_fields
                    if name not in ("stdout", "stderr", "stdout_b64", "stderr_b64"))
"""How a command ended besides its output: the fields the engine's ``ExecResult``, the
wire's :class:`ExecResponse` and the SDK's ``CommandResult`` share, named once here."""


def wire_bytes(data: dict[str, Any], key: str) -> bytes:
    """A byte string the wire carries as text, or base64 under ``<key>_b64``."""
    b64 = data.get(f"{key}_b64")
    if b64 is not None:
        return base64.b64decode(b64)
    return (data.get(key) or "").encode()


class StreamEvent(Model):
    """One line of ``exec/stream``: output (``data`` or ``data_b64``), ``exit`` or ``error``.
    An output line with ``dropped`` (and empty ``data``) marks the gap between a
    stream's head and its tail."""

    type: Literal["stdout", "stderr", "exit", "error"]
    data: str | None = None
    data_b64: str | None = None
    dropped: int | None = None
    result: ExecResponse | None = None
    error: "ErrorDetail | None" = None


class ErrorDetail(Model):
    """What failed: a stable ``code`` (``corral.errors``), a message, and details."""

    code: str
    message: str
    details: dict[str, Any] = Field(default_factory=dict)


class ErrorResponse(Model):
    """The body of every error reply."""

    error: ErrorDetail


class Health(Model):
    status: Literal["ok"] = "ok"


class Capacity(Model):
    max_sandboxes: int
    max_starting: int
    max_memory_mb: int
    queue_size: int
    queue_timeout: float


class GpuInventory(Model):
    """``GET /v1/info``'s ``gpus``: the host's GPUs; how many are free and who holds how
    much (``{"2": 1}``: one sandbox with two) are host activity, the admin's only."""

    total: int = 0
    free: int | None = None
    holding: dict[str, int] | None = None


class DaemonInfo(Model):
    """``GET /v1/info``: limits and how much of them is in use."""

    version: str
    cgroup_version: int
    capacity: Capacity
    committed_memory_mb: int
    starting: int
    queued: int
    builds: int = 0
    counts: dict[SandboxState, int]
    pools: list[PoolInfo] = Field(default_factory=list)
    gpus: GpuInventory = Field(default_factory=GpuInventory)
    default_lease: float | None = None  # seconds: the SDK's sessions over TCP take one
    state_dir: str | None = None  # the daemon's directories (to the admin only)
    cache_dir: str | None = None


class Usage(Model):
    cpu_seconds: float
    memory_mb: float


class SandboxDetail(SandboxInfo):
    """``GET /v1/sandboxes/{id}``: a sandbox, with its usage while it has processes."""

    usage: Usage | None = None


class KilledProcesses(Model):
    killed: int = Field(description="processes killed (commands, spawned processes, leftovers)")


class SandboxList(Model):
    sandboxes: list[SandboxInfo]


class SnapshotList(Model):
    snapshots: list[SnapshotInfo]


class FileList(Model):
    entries: list[FileInfo]




def text_and_b64(data: bytes) -> tuple[str, str | None]:
    """``data`` as text, plus its base64 when it is not valid UTF-8."""
    try:
        return data.decode(), None
    except UnicodeDecodeError:
        return data.decode(errors="replace"), base64.b64encode(data).decode()


def safe_text(name: str) -> tuple[str, str | None]:
    """A name read from a sandbox's filesystem (``surrogateescape``-decoded, so any
    bytes) as valid UTF-8 text, plus the base64 of its exact bytes when it is not UTF-8."""
    try:
        name.encode()
    except UnicodeEncodeError:
        return text_and_b64(os.fsencode(name))
    return name, None


def file_json(info: FileInfo) -> dict[str, Any]:
    """The JSON of a :class:`FileInfo`: ``path``/``name`` always text (invalid bytes
    replaced by U+FFFD), ``path_b64``/``name_b64`` added with the exact bytes if need be."""
    reply = dataclasses.asdict(info)
    for key in ("path", "name"):
        reply[key], exact = safe_text(reply[key])
        if exact is not None:
            reply[f"{key}_b64"] = exact
    return reply


def exec_response(result: ExecResult) -> dict[str, Any]:
    """The JSON of an :class:`ExecResult` (``*_b64`` only when needed)."""
    stdout, stdout_b64 = text_and_b64(result.stdout)
    stderr, stderr_b64 = text_and_b64(result.stderr)
    reply = ExecResponse(
        stdout=stdout, stderr=stderr, stdout_b64=stdout_b64, stderr_b64=stderr_b64,
        **{name: getattr(result, name) for name in EXEC_STATUS},
    )
    return reply.model_dump(mode="json", exclude_none=True)


# ------------------------------------------------- sandbox operations' bodies


class TimeoutRequest(_Body):
    """``PATCH /v1/sandboxes/{id}``: end the sandbox this many seconds from now."""

    timeout: StrictFloat | StrictInt = Field(..., gt=0, le=MAX_TIMEOUT_S)


class LogEntry(_Body):
    """A command (``kind="command"``: argv, started_at, ended_at, outcome =
    exit|timeout|oom|killed, exit_code, stdout_tail, stderr_tail) or a lifecycle event
    (``kind="event"``: event = ready|restored|paused|running|stopping|stopped|timeout|
    idle_timeout|oom|deleted, reason)."""

    model_config = {"extra": "allow"}
    seq: int
    kind: str
    at: float


class SandboxLogsReply(_Body):
    sandbox_id: str
    entries: list[LogEntry]
    next: int = Field(description="pass as ?after= to get only newer entries")


class ExposeRequest(_Body):
    port: StrictInt = Field(..., ge=1, le=65535)


class ExposedPort(_Body):
    port: int
    token: str = Field(description="the port's access token (also in url)")
    url: str = Field(description="where the port is served: <daemon>/expose/<token>/")


class NetworkEvent(_Body):
    """One connection or DNS query of a policy sandbox and the filter's verdict."""

    time: float
    kind: Literal["tcp", "dns", "udp", "other"]
    name: str | None = None
    ip: str | None = None
    port: int | None = None
    verdict: Literal["allowed", "refused"]
    reason: str
    protocol: int | str | None = Field(None, description="kind 'other': the IP protocol")


class NetworkEvents(_Body):
    sandbox_id: str
    events: list[NetworkEvent] = Field(description="oldest first, the last 1000")


class VolumeList(_Body):
    volumes: list[VolumeInfo] = Field(description="the caller's volumes, by name")


class NetworkCreate(_Body):
    """A named network: its name and policy (``corral network create NAME --allow ...``)."""

    name: str = Field(description="1-63 of a-z 0-9 . _ - ('none' and 'host' are modes)")
    policy: NetworkPolicy
    private: bool = Field(False, description="its sandboxes reach each other directly "
                          "(a private network, docs/network.md)")


class NetworkList(_Body):
    networks: list[NetworkInfo] = Field(description="the caller's named networks, by name")


class VolumeSnapshotRequest(_Body):
    name: str = Field(min_length=1, max_length=63, description="the new volume's name")


class UploadCreate(_Body):
    path: str = Field(min_length=1, max_length=4096, description="where, in the sandbox")
    size: StrictInt = Field(ge=0, description="the file's size in bytes")
    mode: str = Field("0644", pattern=r"^0?[0-7]{3,4}$", description="octal permissions")


class UploadState(_Body):
    upload_id: str
    sandbox_id: str | None = None  # an upload into a sandbox...
    volume: str | None = None  # ...or into a volume (docs/network.md)
    path: str
    size: int
    offset: int = Field(description="bytes received: the next PATCH's Upload-Offset")
    done: bool
