"""The one exception tree of corral, shared by the runtime, the server and the SDK.

Every error carries a stable ``code`` (the wire format's ``error.code``), a message
that says what failed and what to do, and a ``details`` dict. Errors that a caller
would naturally catch as a builtin also inherit it::

    CorralError
    ├── InvalidArgument (ValueError)          400 invalid_argument
    │   ├── PathOutsideSandbox                400 path_outside_sandbox
    │   ├── ImageImportError                  400 image_import_failed
    │   └── DockerfileError                   400 invalid_dockerfile
    ├── Unauthorized (PermissionError)        401 unauthorized
    ├── NotFound (LookupError)                404 not_found
    │   ├── SandboxNotFound                   404 sandbox_not_found
    │   ├── ImageNotFound                     404 image_not_found
    │   ├── SnapshotNotFound                  404 snapshot_not_found
    │   ├── LeaseNotFound                     404 lease_not_found
    │   ├── VolumeNotFound                    404 volume_not_found
    │   ├── NetworkNotFound                   404 network_not_found
    │   └── UploadNotFound                    404 upload_not_found
    ├── FileError (OSError)                   409 file_error
    │   ├── FileNotFound (FileNotFoundError)  404 file_not_found
    │   ├── FileTooLarge                      413 file_too_large
    │   ├── SandboxDiskFull                   507 sandbox_disk_full
    │   └── VolumeFull                        507 volume_full
    ├── InvalidState                          409 invalid_state
    │   └── ImageInUse                        409 image_in_use
    ├── ImageBuildError                       422 image_build_failed
    ├── HeadersTooLarge                       431 headers_too_large
    ├── RequestTimeout (TimeoutError)         408 request_timeout
    ├── CapacityExceeded                      503 capacity_exceeded
    │   ├── TooManyRequests                   429 too_many_requests
    │   ├── QuotaExceeded                     429 quota_exceeded
    │   ├── OutputBudgetExceeded              429 output_budget_exceeded
    │   └── NoGpuCapacity                     503 no_gpu_capacity
    ├── SandboxTimeout (TimeoutError)         408 sandbox_timeout
    ├── ExecTimeout (TimeoutError)            408 exec_timeout
    ├── SandboxLost                           410 sandbox_lost
    ├── SandboxProtocolError                  422 sandbox_protocol_error
    ├── SnapshotTooLarge                      413 snapshot_too_large
    ├── StorageFull                           507 storage_full
    ├── LayerTransferError                    502 layer_transfer_failed
    ├── RegistryError (ConnectionError)       502 registry_failed
    │   └── RegistryAuthError (PermissionError) 502 registry_auth_failed
    ├── PortClosed (ConnectionError)          502 port_closed
    ├── SandboxStartError                     500 sandbox_start_failed
    ├── Unsupported                           501 unsupported
    ├── DaemonUnavailable (ConnectionError)   503 daemon_unavailable
    └── InternalError                         500 internal
"""

from __future__ import annotations

from typing import Any


class CorralError(Exception):
    """Base of every corral error."""

    code: str = "internal"
    status: int = 500

    def __init__(self, message: str, *, details: dict[str, Any] | None = None) -> None:
        super().__init__(message)
        self.message = message
        self.details = dict(details or {})

    def to_dict(self) -> dict[str, Any]:
        return {"code": self.code, "message": self.message, "details": self.details}

    def __reduce__(self):  # keep errors picklable (futures, multiprocessing)
        return (_rebuild, (type(self), self.message, self.details))


def _rebuild(cls: type[CorralError], message: str, details: dict[str, Any]) -> CorralError:
    return cls(message, details=details)


class InvalidArgument(CorralError, ValueError):
    code, status = "invalid_argument", 400


class PathOutsideSandbox(InvalidArgument):
    code, status = "path_outside_sandbox", 400


class ImageImportError(InvalidArgument):
    """An image archive is malformed or unsafe (a path outside the root, a link escaping it)."""

    code, status = "image_import_failed", 400


class DockerfileError(InvalidArgument):
    """A Dockerfile uses what corral cannot build (``HEALTHCHECK``, ``VOLUME``, heredocs,
    ``RUN --mount``, another user...) or is malformed; nothing was built. ``details``:
    ``line`` (from 1) and ``instruction``."""

    code, status = "invalid_dockerfile", 400


class Unauthorized(CorralError, PermissionError):
    code, status = "unauthorized", 401


class Forbidden(CorralError, PermissionError):
    """Authenticated, but this daemon does not allow it (e.g. ``network="host"`` over
    TCP without ``--allow-host-network``)."""

    code, status = "forbidden", 403


class NotFound(CorralError, LookupError):
    code, status = "not_found", 404


class SandboxNotFound(NotFound):
    code, status = "sandbox_not_found", 404


class ImageNotFound(NotFound):
    code, status = "image_not_found", 404


class SnapshotNotFound(NotFound):
    code, status = "snapshot_not_found", 404


class LeaseNotFound(NotFound):
    code, status = "lease_not_found", 404


class VolumeNotFound(NotFound):
    code, status = "volume_not_found", 404


class NetworkNotFound(NotFound):
    code, status = "network_not_found", 404


class UploadNotFound(NotFound):
    code, status = "upload_not_found", 404


class FileError(CorralError, OSError):
    code, status = "file_error", 409

    def __init__(self, message: str, *, details: dict[str, Any] | None = None) -> None:
        CorralError.__init__(self, message, details=details)
        self.errno = self.details.get("errno")
        self.strerror = message
        self.filename = self.details.get("path")

    def __str__(self) -> str:
        return self.message


class SandboxDiskFull(FileError):
    """The sandbox's own writable layer is full (its ``disk_mb`` or ``inodes``): free
    space in it, or create it with a larger ``disk_mb``/``inodes``. Not the host's disk
    (that is :class:`StorageFull`). ``details``: ``sandbox_id``, ``path``, ``errno``."""

    code, status = "sandbox_disk_full", 507


class VolumeFull(FileError):
    """An ``rw`` volume reached its size limit (``max_mb``, set at create): remove files
    from it, or make a larger volume. ``details``: ``volume``, ``max_mb``."""

    code, status = "volume_full", 507


class FileNotFound(FileError, FileNotFoundError):
    code, status = "file_not_found", 404


class FileTooLarge(FileError):
    code, status = "file_too_large", 413


class InvalidState(CorralError):
    code, status = "invalid_state", 409


class ImageInUse(InvalidState):
    """An image cannot be removed: sandboxes, snapshots or other images use it."""

    code, status = "image_in_use", 409


class ImageBuildError(CorralError):
    """A step of an image build failed. ``details``: ``step`` (1-based), ``instruction``
    (the step's text), ``output`` (the tail of its stdout and stderr), ``returncode``."""

    code, status = "image_build_failed", 422

    @property
    def step(self) -> int | None:
        return self.details.get("step")

    @property
    def output(self) -> str:
        return self.details.get("output", "")


class CapacityExceeded(CorralError):
    code, status = "capacity_exceeded", 503


class TooManyRequests(CapacityExceeded):
    """One client has as many requests in flight as the daemon allows one client
    (``--max-client-requests``); retry once some have finished."""

    code, status = "too_many_requests", 429


class QuotaExceeded(CapacityExceeded):
    """A tenant token's quota (``corral token create --max-sandboxes/--max-memory-mb/
    --max-cpus``) would be exceeded: delete sandboxes or pools of that tenant first.
    ``details``: ``quota``, ``limit``, ``used``, ``requested``, ``tenant``."""

    code, status = "quota_exceeded", 429


class OutputBudgetExceeded(CapacityExceeded):
    """The daemon's memory for commands' output in flight (``--output-memory-mb``) or
    its tenant's share (``--tenant-output-memory-mb``) has less than 64 KiB per stream
    left for one more command: retry when some have ended, or ask a smaller
    ``max_output``. ``details``: ``used``, ``limit``, ``tenant_used``, ``tenant_limit``,
    ``requested``, ``tenant``, ``sandbox_id``."""

    code, status = "output_budget_exceeded", 429


class NoGpuCapacity(CapacityExceeded):
    """Not enough free GPUs for a sandbox right now: wait for one to end, ask for fewer,
    or share one (``gpu_shared=True``). ``details``: ``requested``, ``free`` (GPU
    indices), ``total``."""

    code, status = "no_gpu_capacity", 503


class HeadersTooLarge(CorralError):
    """A request's line and headers are larger than the daemon reads before auth."""

    code, status = "headers_too_large", 431


class RequestTimeout(CorralError, TimeoutError):
    """A request's headers, or the next piece of its body, did not arrive in time."""

    code, status = "request_timeout", 408


class SandboxTimeout(CorralError, TimeoutError):
    code, status = "sandbox_timeout", 408


class ExecTimeout(CorralError, TimeoutError):
    code, status = "exec_timeout", 408


class SandboxLost(CorralError):
    """The sandbox went away for a reason outside it: stopped, deleted, its lifetime ran
    out, the engine stopped, or its processes were killed from the host. An RL runner
    retries such an attempt (``corral.rl.INFRA_ERRORS``)."""

    code, status = "sandbox_lost", 410


SANDBOX_FAULT = "sandbox fault: "
"""How the ``reason`` of a sandbox ended by its own doing starts (state ``failed``)."""


class SandboxProtocolError(CorralError):
    """The sandbox broke the engine's protocol, or its agent stopped answering or hung up
    without being asked: the sandbox's own doing (the code it ran), never the machine's.

    The engine ends the sandbox (state ``failed``, its ``reason`` starting with
    :data:`SANDBOX_FAULT`); every later call on it raises this error again. Not a
    :class:`SandboxLost`, on purpose: ``corral.rl`` scores it as the policy's error and
    never retries it. ``details``: ``sandbox_id``, ``violation`` (a short code such as
    ``duplicate_exit``, ``frame_too_large``, ``agent_unresponsive``,
    ``agent_disconnected``). 422 rather than a 5xx: nothing failed on the server's side
    that a retry could fix.
    """

    code, status = "sandbox_protocol_error", 422


class SnapshotTooLarge(CorralError):
    """A snapshot, fork or image-build step would copy more than the sandbox could hold:
    more bytes than its ``disk_mb`` or more files than its ``inodes``, or a directory tree
    deeper than a layer may be, or a sparse file larger than the host's filesystem stores.
    Nothing was kept. ``details``: ``limit`` (``disk_mb``, ``inodes``, ``depth`` or
    ``file_size``), ``value`` (the limit) and ``sandbox_id`` when known. 413: the
    sandbox's content, not the server, is at fault; a retry fails the same way.
    """

    code, status = "snapshot_too_large", 413


def is_sandbox_fault(reason: str | None) -> bool:
    """True if a sandbox's ``reason`` says it was ended by its own doing."""
    return bool(reason) and reason.startswith(SANDBOX_FAULT)  # type: ignore[union-attr]


class StorageFull(CorralError):
    """The host's filesystem under the daemon's state directory (or cache) is full: the
    message names the path; nothing was left half-made. Free space there and retry.
    ``details``: ``path``, ``errno`` or ``sqlite`` (what failed)."""

    code, status = "storage_full", 507


class LayerTransferError(CorralError):
    """A layer fetched from another node's daemon was refused: its bytes do not hash to
    its digest, the stream was truncated or held an unsafe entry, or the peer did not
    serve it. Nothing of it was kept; retry, and check the peer named in the message.
    ``details``: ``digest`` (and ``received``, ``path``, ``peer`` when known)."""

    code, status = "layer_transfer_failed", 502


class RegistryError(CorralError, ConnectionError):
    """A container registry could not be reached or broke the distribution protocol
    (a manifest too large or malformed, an unexpected status). The message names the
    registry; nothing half-pulled was kept as an image. ``details``: ``registry``,
    ``ref`` (and ``status`` when the registry answered)."""

    code, status = "registry_failed", 502


class RegistryAuthError(RegistryError, PermissionError):
    """A container registry refused the credentials (or wanted some and none were
    configured): add them to ``~/.docker/config.json`` or the file named by
    ``REGISTRY_AUTH_FILE`` of the daemon's user (``docker login`` / ``skopeo login``
    write it). The credentials themselves are never in the message. ``details``:
    ``registry``, ``ref``."""

    code, status = "registry_auth_failed", 502


class PortClosed(CorralError, ConnectionError):
    """Nothing listens on an exposed port inside the sandbox (docs/network.md)."""

    code, status = "port_closed", 502


class SandboxStartError(CorralError):
    code, status = "sandbox_start_failed", 500


class Unsupported(CorralError):
    code, status = "unsupported", 501


class DaemonUnavailable(CorralError, ConnectionError):
    code, status = "daemon_unavailable", 503


class InternalError(CorralError):
    code, status = "internal", 500


def _all_subclasses(cls: type) -> list[type]:
    out = []
    for sub in cls.__subclasses__():
        out.append(sub)
        out.extend(_all_subclasses(sub))
    return out


def error_from_dict(payload: dict[str, Any]) -> CorralError:
    """Rebuild the typed error a server sent as ``{"code", "message", "details"}``."""
    by_code: dict[str, type[CorralError]] = {}
    for c in _all_subclasses(CorralError):  # parents first: a family's code is its root's
        by_code.setdefault(c.code, c)
    cls = by_code.get(payload.get("code", ""), CorralError)
    return cls(payload.get("message", "unknown error"), details=payload.get("details") or {})
