"""Translation between corral and the CoreWeave Sandbox wire format (``coreweave.sandbox.v1``).

Kept apart from the servicer (:mod:`corral.server.compat.cwsandbox`) so the mapping
rules can be read in one place:

- a create request becomes a :class:`~corral.schema.SandboxSpec` (image names map to
  corral images, Kubernetes quantities to ``cpus`` / ``memory_mb``); features corral
  does not have are refused with ``UNIMPLEMENTED`` rather than silently dropped;
- a :class:`~corral.schema.SandboxInfo` becomes a ``Sandbox`` message;
- a sandbox of a Tensorlake namespace (made through that front-end, see
  :mod:`corral.server.compat.tensorlake_scope`) is not reachable from here: it answers
  like an id that never existed, is left out of lists, and its tags may not be set
  by a create (no sandbox slips into a namespace through this door);
- a :class:`~corral.errors.CorralError` becomes a gRPC status carrying the AIP-193
  ``google.rpc.ErrorInfo`` (domain ``cwsandbox.com``) and ``BadRequest`` details the
  client maps to its own exceptions (``SandboxNotFoundError``, ``SandboxFileError``,
  ``SandboxValidationError`` ...).
"""

from __future__ import annotations

import errno
import math
import os
import re
from collections.abc import Collection, Iterable
from dataclasses import dataclass, field
from typing import Any

import grpc
from cwsandbox._proto import sandbox_pb2
from google.protobuf import any_pb2, timestamp_pb2
from google.rpc import error_details_pb2, status_pb2

from corral.errors import (
    CapacityExceeded,
    CorralError,
    DaemonUnavailable,
    ExecTimeout,
    FileError,
    FileNotFound,
    FileTooLarge,
    ImageNotFound,
    InvalidArgument,
    InvalidState,
    NotFound,
    SandboxLost,
    SandboxNotFound,
    SandboxTimeout,
    Unauthorized,
    Unsupported,
)
from corral.runtime.distribution import is_reference
from corral.schema import SandboxInfo, SandboxSpec, SandboxState
from corral.server.compat.cwsandbox_network import egress_policy
from corral.server.compat.tensorlake_model import TAG as TENSORLAKE_TAG

DOMAIN = "cwsandbox.com"  # the only ErrorInfo domain whose reasons the client trusts
DEFAULT_IMAGE_ENV = "CORRAL_COMPAT_DEFAULT_IMAGE"  # shared with the Tensorlake front-end
FALLBACK_IMAGE = "rl"
MAIN_CONTAINER = "main"
# The client's default main process: a shell that sleeps until stopped. corral's agent
# keeps a sandbox alive by itself, so this command is not run.
KEEP_ALIVE = ("/bin/sh", ("-c", 'trap "exit 0" TERM INT; sleep infinity & wait'))
_STATUS_DETAILS = "grpc-status-details-bin"
# Bounds of one request, beyond the message size (protobuf fields are typed: nothing
# to coerce, but a list may be long).
MAX_ARGS = 4096  # a command and its arguments
MAX_COMMAND_BYTES = 256 << 10  # ... in bytes (Linux runs no argument over 128 KiB)
MAX_ENV = 1024  # environment variables of a create or a command
MAX_FILES = 1024  # files a create places

_STATES = {
    SandboxState.PENDING: sandbox_pb2.STATE_CREATING,
    SandboxState.RUNNING: sandbox_pb2.STATE_RUNNING,
    SandboxState.PAUSED: sandbox_pb2.STATE_PAUSED,
    SandboxState.STOPPING: sandbox_pb2.STATE_TERMINATING,
    SandboxState.STOPPED: sandbox_pb2.STATE_TERMINATED,
    SandboxState.FAILED: sandbox_pb2.STATE_FAILED,
}
TERMINAL_STATES = frozenset(
    {sandbox_pb2.STATE_COMPLETED, sandbox_pb2.STATE_FAILED, sandbox_pb2.STATE_TERMINATED}
)

# Where a SandboxSpec field came from in the request, for BadRequest field violations.
_SPEC_FIELDS = {
    "tags": "sandbox.spec.tags",
    "env": "sandbox.spec.containers[0].environment_variables",
    "workdir": "sandbox.spec.containers[0].working_dir",
    "cpus": "sandbox.spec.containers[0].resource_requirements.limits.cpu",
    "memory_mb": "sandbox.spec.containers[0].resource_requirements.limits.memory",
    "timeout": "sandbox.spec.max_lifetime_seconds",
    "image": "sandbox.spec.containers[0].image",
}


# ------------------------------------------------------------------------ errors


class RpcFailure(Exception):
    """An error to send as a gRPC status, with the details the client parses."""

    def __init__(
        self,
        code: grpc.StatusCode,
        message: str,
        *,
        reason: str | None = None,
        metadata: dict[str, str] | None = None,
        violations: Iterable[tuple[str, str]] = (),
    ) -> None:
        super().__init__(message)
        self.code = code
        self.message = message
        self.reason = reason
        self.metadata = {k: str(v) for k, v in (metadata or {}).items() if v is not None}
        self.violations = list(violations)

    def trailing_metadata(self) -> tuple[tuple[str, bytes], ...]:
        """``grpc-status-details-bin``: a ``google.rpc.Status`` with ErrorInfo / BadRequest."""
        status = status_pb2.Status(code=self.code.value[0], message=self.message)
        if self.reason:
            info = error_details_pb2.ErrorInfo(
                reason=self.reason, domain=DOMAIN, metadata=self.metadata
            )
            status.details.append(_pack(info))
        if self.violations:
            bad = error_details_pb2.BadRequest(
                field_violations=[
                    error_details_pb2.BadRequest.FieldViolation(field=f, description=d)
                    for f, d in self.violations
                ]
            )
            status.details.append(_pack(bad))
        return ((_STATUS_DETAILS, status.SerializeToString()),)


def _pack(message: Any) -> any_pb2.Any:
    packed = any_pb2.Any()
    packed.Pack(message)
    return packed


def invalid(message: str, field_name: str) -> RpcFailure:
    return RpcFailure(
        grpc.StatusCode.INVALID_ARGUMENT,
        message,
        reason="CWSANDBOX_INVALID_REQUEST",
        violations=[(field_name, message)],
    )


def unsupported(what: str) -> RpcFailure:
    return RpcFailure(
        grpc.StatusCode.UNIMPLEMENTED,
        f"{what} is not supported by corral's CoreWeave Sandbox front-end",
        reason="CWSANDBOX_NOT_IMPLEMENTED",
    )


def from_corral(
    exc: CorralError, *, sandbox_id: str | None = None, path: str | None = None,
    operation: str | None = None,
) -> RpcFailure:
    """The gRPC status for a corral error, with the reason the client maps."""
    msg = exc.message
    if isinstance(exc, FileError):
        return _file_failure(exc, path or exc.details.get("path"), operation)
    if isinstance(exc, SandboxNotFound):
        sid = sandbox_id or exc.details.get("sandbox_id")
        return RpcFailure(
            grpc.StatusCode.NOT_FOUND, msg, reason="CWSANDBOX_SANDBOX_NOT_FOUND",
            metadata={"sandbox_id": sid},
        )
    if isinstance(exc, ImageNotFound):
        hint = f"{msg}; set {DEFAULT_IMAGE_ENV} to an image this host has"
        return invalid(hint, _SPEC_FIELDS["image"])
    if isinstance(exc, InvalidArgument):
        return RpcFailure(
            grpc.StatusCode.INVALID_ARGUMENT, msg, reason="CWSANDBOX_INVALID_REQUEST",
            violations=_violations(exc),
        )
    if isinstance(exc, Unauthorized):
        return RpcFailure(grpc.StatusCode.UNAUTHENTICATED, msg)
    if isinstance(exc, NotFound):
        return RpcFailure(grpc.StatusCode.NOT_FOUND, msg)
    if isinstance(exc, InvalidState):
        return RpcFailure(grpc.StatusCode.FAILED_PRECONDITION, msg)
    if isinstance(exc, CapacityExceeded):
        return RpcFailure(
            grpc.StatusCode.RESOURCE_EXHAUSTED, msg, reason="CWSANDBOX_RUNNER_CAPACITY_EXHAUSTED",
            metadata={k: v for k, v in exc.details.items() if isinstance(v, (str, int, float))},
        )
    if isinstance(exc, (SandboxTimeout, ExecTimeout)):
        return RpcFailure(grpc.StatusCode.DEADLINE_EXCEEDED, msg)
    if isinstance(exc, DaemonUnavailable):
        return RpcFailure(
            grpc.StatusCode.UNAVAILABLE, msg, reason="CWSANDBOX_BACKEND_UNAVAILABLE"
        )
    if isinstance(exc, Unsupported):
        return RpcFailure(grpc.StatusCode.UNIMPLEMENTED, msg, reason="CWSANDBOX_NOT_IMPLEMENTED")
    if isinstance(exc, SandboxLost):
        return RpcFailure(grpc.StatusCode.ABORTED, msg)
    return RpcFailure(grpc.StatusCode.INTERNAL, msg)


def _file_failure(exc: FileError, path: str | None, operation: str | None) -> RpcFailure:
    meta = {"filepath": path, "operation": operation}
    if isinstance(exc, FileNotFound):
        return RpcFailure(
            grpc.StatusCode.NOT_FOUND, exc.message, reason="CWSANDBOX_FILE_NOT_FOUND", metadata=meta
        )
    if isinstance(exc, FileTooLarge):
        meta.update(size_bytes=exc.details.get("size"), max_size_bytes=exc.details.get("limit"))
        return RpcFailure(
            grpc.StatusCode.RESOURCE_EXHAUSTED, exc.message, reason="CWSANDBOX_FILE_TOO_LARGE",
            metadata=meta,
        )
    err = exc.details.get("errno")
    if err in (errno.EACCES, errno.EPERM, errno.EROFS):
        code, reason = grpc.StatusCode.PERMISSION_DENIED, "CWSANDBOX_FILE_PERMISSION_DENIED"
    elif err == errno.EISDIR:
        code, reason = grpc.StatusCode.FAILED_PRECONDITION, "CWSANDBOX_FILE_IS_DIRECTORY"
    else:
        code, reason = grpc.StatusCode.FAILED_PRECONDITION, "CWSANDBOX_FILE_IO_FAILED"
    return RpcFailure(code, exc.message, reason=reason, metadata=meta)


def _violations(exc: InvalidArgument) -> list[tuple[str, str]]:
    errors = exc.details.get("errors") or []
    out = [
        (_SPEC_FIELDS.get(e.get("field", ""), e.get("field", "")), e.get("message", ""))
        for e in errors
    ]
    return out or [("", exc.message)]


# ------------------------------------------------------------------ reach


def tensorlake_owned(tags: Iterable[str]) -> bool:
    """Whether tags are the Tensorlake front-end's (``tensorlake``, ``tensorlake.*``)."""
    return any(t == TENSORLAKE_TAG or t.startswith(TENSORLAKE_TAG + ".") for t in tags)


def reachable(info: SandboxInfo) -> SandboxInfo:
    """``info``, unless its sandbox belongs to a Tensorlake namespace: then
    :class:`SandboxNotFound`, worded as the engine words an unknown id."""
    if tensorlake_owned(info.spec.tags):
        raise SandboxNotFound(
            f"no sandbox {info.id!r}: it never existed or was deleted",
            details={"sandbox_id": info.id},
        )
    return info


# -------------------------------------------------------------- create request


@dataclass
class CreatePlan:
    """What a CreateSandbox asks of corral: the spec, a main command, files to place."""

    spec: SandboxSpec
    command: tuple[str, tuple[str, ...]] | None = None  # None: just keep the sandbox alive
    files: list[tuple[str, bytes]] = field(default_factory=list)


SCRATCH_PATH = "/tmp"


def default_image() -> str:
    """The corral image for names corral does not have (``$CORRAL_COMPAT_DEFAULT_IMAGE``)."""
    return os.environ.get(DEFAULT_IMAGE_ENV, "").strip() or FALLBACK_IMAGE


def map_image(requested: str, available: Collection[str]) -> str:
    """A corral image name is used as is; a reference to an image of a
    registry with its host, ``host/repo:tag``) is pulled on first use; any other name
    (``python:3.11``) gets the default image."""
    if is_reference(requested):
        return requested
    return requested if requested in available else default_image()


def _scratch_volumes(spec: Any) -> set[str]:
    """The names of the spec's scratch volumes (any other kind is refused). A scratch
    volume mounted at /tmp is the sandbox's own /tmp, private and writable already;
    its size is not reserved (the sandbox's disk limit applies)."""
    names = set()
    for volume in spec.volumes:
        if volume.WhichOneof("source") != "scratch" or volume.scratch.restore_from_snapshot_id:
            raise unsupported("volumes other than scratch volumes")
        names.add(volume.name)
    return names


def plan_create(request: Any, available_images: Collection[str]) -> CreatePlan:
    """Turn a ``CreateSandboxRequest`` into a :class:`CreatePlan`, or raise RpcFailure."""
    spec = request.sandbox.spec
    for name, what in (
        ("services", "services (exposed ports)"), ("network_ids", "network_ids"),
    ):
        if len(getattr(spec, name)):
            raise unsupported(what)
    scratch = _scratch_volumes(spec)
    if spec.HasField("object_storage_access"):
        raise unsupported("object_storage_access")
    try:
        network = egress_policy(spec.network) if spec.HasField("network") else None
    except ValueError as exc:
        raise unsupported(str(exc)) from None
    if len(spec.containers) > 1:
        raise unsupported("more than one container")
    container = spec.containers[0] if len(spec.containers) else sandbox_pb2.Container()
    for mount in container.volume_mounts:
        if (mount.volume not in scratch or mount.mount_path.rstrip("/") != SCRATCH_PATH
                or mount.read_only or mount.sub_path):
            raise unsupported("volume mounts other than a scratch volume at /tmp")
    if len(container.secret_stores):
        raise unsupported("secrets")
    if tensorlake_owned(spec.tags):
        raise invalid(
            f"tags 'tensorlake' and 'tensorlake.*' are reserved for corral's Tensorlake "
            f"front-end (its namespaces and names), got {list(spec.tags)!r}",
            _SPEC_FIELDS["tags"],
        )
    _check_sizes(
        ("sandbox.spec.containers[0].args", len(container.args) + 1, MAX_ARGS),
        ("sandbox.spec.containers[0].environment_variables",
         len(container.environment_variables), MAX_ENV),
        ("sandbox.spec.containers[0].files", len(container.files), MAX_FILES),
    )
    cpus, memory_mb, gpus = _resources(container)
    fields: dict[str, Any] = {
        "image": map_image(container.image, available_images),
        "tags": list(spec.tags),
        "env": dict(container.environment_variables),
    }
    if container.working_dir:
        fields["workdir"] = container.working_dir
    if cpus is not None:
        fields["cpus"] = cpus
    if memory_mb is not None:
        fields["memory_mb"] = memory_mb
    if network is not None:
        fields["network"] = network  # an egress policy (compat/cwsandbox_network.py)
    if gpus:
        fields["gpus"] = gpus  # exclusive, like a Kubernetes nvidia.com/gpu request
    if spec.max_lifetime_seconds < 0:
        raise invalid("max_lifetime_seconds must be >= 0", _SPEC_FIELDS["timeout"])
    if spec.max_lifetime_seconds:
        fields["timeout"] = spec.max_lifetime_seconds
    try:
        parsed = SandboxSpec.parse(fields)
    except InvalidArgument as exc:
        raise from_corral(exc) from None
    command: tuple[str, tuple[str, ...]] | None = None
    if container.command or len(container.args):
        command = (container.command, tuple(container.args))
        size = sum(len(arg.encode()) for arg in (command[0], *command[1]))
        if size > MAX_COMMAND_BYTES:  # the daemon keeps it while the sandbox lives
            raise invalid(f"the main command and its args take {size} bytes, more than the "
                          f"{MAX_COMMAND_BYTES} allowed: put a long script in a file "
                          "(containers[0].files) and run that",
                          "sandbox.spec.containers[0].args")
        if command == KEEP_ALIVE:
            command = None
        elif not container.command:
            raise invalid(
                "args without a command: corral images have no entrypoint, name the command",
                "sandbox.spec.containers[0].command",
            )
    files = [(f.path, bytes(f.content)) for f in container.files]
    return CreatePlan(parsed, command, files)


def _check_sizes(*checks: tuple[str, int, int]) -> None:
    for field_name, size, limit in checks:
        if size > limit:
            raise invalid(f"{field_name} has {size} entries, more than the {limit} allowed",
                          field_name)


def check_command(command: Any, env: Any) -> None:
    """An exec's argv and env within bounds (INVALID_ARGUMENT naming the field)."""
    _check_sizes(("command", len(command), MAX_ARGS), ("env", len(env), MAX_ENV))


def page_start(token: str) -> int:
    """The offset a ``page_token`` stands for: the digits this service handed out,
    nothing else (no sign, spaces or other scripts' digits, as ``int()`` would take)."""
    if not token:
        return 0
    if not (token.isascii() and token.isdigit() and len(token) <= 18):
        raise invalid(f"invalid page_token {token[:40]!r}: pass back a next_page_token",
                      "page_token")
    return int(token)


def _resources(container: Any) -> tuple[float | None, int | None, int | None]:
    """cpus, memory_mb and the GPU count from limits, else requests, else the legacy
    ``resources``."""
    sides = []
    if container.HasField("resource_requirements"):
        rr = container.resource_requirements
        sides += [(rr.limits, "limits"), (rr.requests, "requests")]
    if container.HasField("resources"):
        sides.append((container.resources, "resources"))
    cpus: float | None = None
    memory_mb: int | None = None
    gpus: int | None = None
    for res, where in sides:
        if gpus is None and res.HasField("gpu") and res.gpu.count:
            gpus = int(res.gpu.count)
        if cpus is None and res.cpu:
            cpus = parse_cpu(res.cpu, f"sandbox.spec.containers[0].{where}.cpu")
        if memory_mb is None and res.memory:
            memory_mb = parse_memory_mb(res.memory, f"sandbox.spec.containers[0].{where}.memory")
    return cpus, memory_mb, gpus


_QUANTITY = re.compile(r"^([0-9]+(?:\.[0-9]+)?)([a-zA-Z]*)$")
_MEMORY_UNITS = {
    "": 1, "k": 10**3, "M": 10**6, "G": 10**9, "T": 10**12,
    "Ki": 1 << 10, "Mi": 1 << 20, "Gi": 1 << 30, "Ti": 1 << 40,
}


def parse_cpu(quantity: str, field_name: str) -> float:
    """``"2"``, ``"1.5"`` or ``"500m"`` as a number of CPUs."""
    m = _QUANTITY.match(quantity.strip())
    if not m or m.group(2) not in ("", "m"):
        raise invalid(
            f"invalid CPU quantity {quantity!r}: use e.g. '2', '1.5' or '500m'", field_name
        )
    value = float(m.group(1)) / (1000 if m.group(2) == "m" else 1)
    if not 0 < value < math.inf:
        raise invalid(f"CPU quantity {quantity!r} must be a positive number", field_name)
    return value


def parse_memory_mb(quantity: str, field_name: str) -> int:
    """``"512Mi"``, ``"1Gi"``, ``"2G"`` or bytes, rounded up to whole MiB."""
    m = _QUANTITY.match(quantity.strip())
    if not m or m.group(2) not in _MEMORY_UNITS:
        raise invalid(
            f"invalid memory quantity {quantity!r}: use e.g. '512Mi', '1Gi' or '2G'", field_name
        )
    mib = float(m.group(1)) * _MEMORY_UNITS[m.group(2)] / (1 << 20)
    if not math.isfinite(mib):
        raise invalid(f"memory quantity {quantity!r} is too large", field_name)
    return math.ceil(mib)


# -------------------------------------------------------------------- sandboxes


def cw_state(info: SandboxInfo, exit_code: int | None) -> int:
    """The v1 ``State`` of a sandbox: a main command that exited makes it COMPLETED."""
    if info.state == SandboxState.STOPPED and exit_code is not None:
        return sandbox_pb2.STATE_COMPLETED
    return _STATES[info.state]


def corral_states(state: int) -> list[SandboxState] | None:
    """The corral states a v1 state filter may match (None: filter after conversion)."""
    starting = (sandbox_pb2.STATE_CREATING, sandbox_pb2.STATE_PENDING, sandbox_pb2.STATE_PREPARING)
    if state in starting:
        return [SandboxState.PENDING]
    for corral_state, v1 in _STATES.items():
        if v1 == state and state != sandbox_pb2.STATE_TERMINATED:
            return [corral_state]
    return None


def timestamp(seconds: float) -> timestamp_pb2.Timestamp:
    ts = timestamp_pb2.Timestamp()
    ts.FromNanoseconds(int(seconds * 1e9))
    return ts


def cpu_quantity(cpus: float) -> str:
    return str(int(cpus)) if cpus == int(cpus) else f"{round(cpus * 1000)}m"


def sandbox_message(
    info: SandboxInfo,
    *,
    exit_code: int | None = None,
    command: tuple[str, tuple[str, ...]] | None = None,
    state: int | None = None,
    ended_at: float | None = None,
) -> Any:
    """A v1 ``Sandbox`` describing ``info`` (``state`` / ``ended_at`` override them)."""
    spec = info.spec
    limits = sandbox_pb2.Resources(cpu=cpu_quantity(spec.cpus), memory=f"{spec.memory_mb}Mi")
    container = sandbox_pb2.Container(
        name=MAIN_CONTAINER,
        image=spec.image,
        command=(command or KEEP_ALIVE)[0],
        args=list((command or KEEP_ALIVE)[1]),
        environment_variables=spec.env,
        working_dir=spec.workdir,
        resource_requirements=sandbox_pb2.ResourceRequirements(requests=limits, limits=limits),
        primary=True,
    )
    status = sandbox_pb2.SandboxStatus(
        state=state if state is not None else cw_state(info, exit_code),
        state_reason=info.reason or "",
        create_time=timestamp(info.created_at),
        effective_max_lifetime_seconds=int(spec.timeout),
        effective_resources=limits,
        effective_resource_requirements=sandbox_pb2.ResourceRequirements(
            requests=limits, limits=limits
        ),
        effective_runtime_class="corral",
    )
    if info.started_at:
        status.start_time.CopyFrom(timestamp(info.started_at))
    end = ended_at if ended_at is not None else info.ended_at
    if end:
        status.end_time.CopyFrom(timestamp(end))
    if exit_code is not None:
        status.exit_code = exit_code
    return sandbox_pb2.Sandbox(
        sandbox_id=info.id,
        spec=sandbox_pb2.SandboxSpec(
            containers=[container],
            tags=spec.tags,
            max_lifetime_seconds=int(spec.timeout),
        ),
        status=status,
    )


def exit_status(returncode: int) -> int:
    """A POSIX exit status: a process killed by signal N exits 128+N, as in a shell."""
    return 128 - returncode if returncode < 0 else returncode
