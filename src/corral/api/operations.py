"""Every endpoint of the native HTTP API (``docs/api.md``), declared once: the daemon
serves and documents exactly these (``corral.server.endpoints``), the SDK builds its
requests from them (:func:`url`) and its cluster router dispatches on their
:class:`~corral.api.operation.Routing`. Tests prove every served route is declared,
every declaration is served, and the SDK spells no path of its own.

A new endpoint is one :class:`~corral.api.operation.Operation` here (routing and access
included) plus its handler in ``corral.server.endpoints.HANDLERS``.
"""

from __future__ import annotations

from corral.api.daemon_models import (
    LeaseInfo,
    LeaseRequest,
)
from corral.api.models import (
    DaemonInfo,
    ExecRequest,
    ExecResponse,
    ExposedPort,
    ExposeRequest,
    FileList,
    ForkRequest,
    Health,
    KilledProcesses,
    MkdirRequest,
    NetworkCreate,
    NetworkEvents,
    NetworkList,
    RunRequest,
    RunResponse,
    SandboxDetail,
    SandboxList,
    SandboxLogsReply,
    SnapshotList,
    SnapshotRequest,
    StopRequest,
    TimeoutRequest,
    UploadCreate,
    UploadState,
    VolumeList,
    VolumeSnapshotRequest,
)
from corral.api.operation import (
    COMMON_ERRORS,
    NDJSON,
    RAW,
    TEXT,
    Access,
    Operation,
    Query,
    Routing,
)
from corral.api.operations_daemon import DAEMON_OPERATIONS
from corral.api.process_models import (
    ConsumeResponse,
    ExchangeRequest,
    ExchangeResponse,
    ProcessInfo,
    ProcessList,
    ResizeRequest,
    SignalRequest,
    SpawnRequest,
)
from corral.errors import (
    CapacityExceeded,
    FileError,
    FileNotFound,
    FileTooLarge,
    Forbidden,
    ImageNotFound,
    InvalidArgument,
    InvalidState,
    LeaseNotFound,
    NetworkNotFound,
    NoGpuCapacity,
    NotFound,
    OutputBudgetExceeded,
    PathOutsideSandbox,
    PortClosed,
    QuotaExceeded,
    RegistryError,
    SandboxDiskFull,
    SandboxLost,
    SandboxNotFound,
    SandboxProtocolError,
    SandboxStartError,
    SandboxTimeout,
    SnapshotNotFound,
    SnapshotTooLarge,
    StorageFull,
    Unsupported,
    UploadNotFound,
    VolumeFull,
    VolumeNotFound,
)
from corral.image_schema import (
    ImageList,
)
from corral.network_schema import NetworkInfo, NetworkPolicy
from corral.pool_schema import (
    AcquireRequest,
    PoolDetail,
    PoolInfo,
    PoolList,
    PoolSpec,
    ReserveReply,
    ReserveRequest,
)
from corral.schema import FileInfo, SandboxInfo, SandboxSpec, SandboxState, SnapshotInfo
from corral.volume_schema import VolumeInfo

__all__ = ["COMMON_ERRORS", "OPERATIONS", "PORT_SOCKET", "match", "operation", "request_line",
           "url"]

# A WebSocket, not an HTTP operation: a byte stream to a port of one's own sandbox
# (corral.server.port_socket); format with id= and port=
PORT_SOCKET = "/v1/sandboxes/{id}/ports/{port}/socket"


_SB = "/v1/sandboxes/{sandbox_id}"
_PATH = Query("path", "string", "a path in the sandbox (relative ones start at its workdir)",
              required=True, min_length=1)
_ON_SANDBOX = (SandboxNotFound, InvalidState, SandboxLost)  # any call on one sandbox
_BODY = (InvalidArgument, FileTooLarge)  # a body: parsed, checked, bounded (--max-upload-bytes)
_FILES = (PathOutsideSandbox, FileNotFound, FileError, FileTooLarge, SandboxDiskFull)

SANDBOX_STATES = tuple(s.value for s in SandboxState)

OPERATIONS: tuple[Operation, ...] = (
    Operation(
        "health", "GET", "/v1/health", "Is the daemon up", reply=Health, access=Access.ANYONE,
        routing=Routing.HOME,
    ),
    Operation(
        "info", "GET", "/v1/info", "Version, limits and what is in use", reply=DaemonInfo,
        routing=Routing.SUM,
    ),
    Operation(
        "metrics_endpoint", "GET", "/metrics",
        "Prometheus metrics (admin only on TCP; 404 with --no-metrics)", reply=TEXT,
        errors=(NotFound,), access=Access.ADMIN, routing=Routing.NODE,
    ),
    Operation(
        "create_sandbox", "POST", "/v1/sandboxes",
        "Create a sandbox (waits for room, and for its tenant's quota)", body=SandboxSpec,
        reply=SandboxInfo, status=201,
        query=(
            Query("wait", "number", "seconds the create may wait for room or for its tenant's "
                  "quota (cap: the daemon's queue_timeout; left out: room is waited for, a "
                  "quota refused at once)"),
        ),
        body_optional=True, body_name="sandbox spec",
        errors=(
            *_BODY, CapacityExceeded, QuotaExceeded, NoGpuCapacity, ImageNotFound,
            SnapshotNotFound, RegistryError, SandboxStartError, SandboxTimeout,
        ),
        routing=Routing.PLACE,
    ),
    Operation(
        "run_once", "POST", "/v1/run",
        "Create a sandbox, run one command in it and delete it, in one call (the "
        "command's result back); on a cluster it runs on the home node",
        body=RunRequest, reply=RunResponse,
        errors=(
            *_BODY, CapacityExceeded, QuotaExceeded, NoGpuCapacity, OutputBudgetExceeded,
            ImageNotFound,
            SnapshotNotFound, RegistryError, SandboxStartError, SandboxTimeout,
        ),
        routing=Routing.HOME,
    ),
    Operation(
        "list_sandboxes", "GET", "/v1/sandboxes", "List sandboxes", reply=SandboxList,
        query=(
            Query("tag", "string", "carries this tag (all must match)", repeat=True),
            Query("state", "string", "is in this state (any may match)", repeat=True,
                  enum=SANDBOX_STATES),
            Query("tenant", "string", "belongs to this tenant (the admin's filter)"),
        ),
        errors=(InvalidArgument,), routing=Routing.MERGE,
    ),
    Operation(
        "get_sandbox", "GET", _SB, "One sandbox, with usage while alive", reply=SandboxDetail,
        errors=(*_ON_SANDBOX,), routing=Routing.SANDBOX,
    ),
    Operation(
        "patch_sandbox", "PATCH", _SB,
        "Set a running sandbox's end to timeout seconds from now (within --max-lifetime)",
        body=TimeoutRequest, reply=SandboxInfo,
        errors=(*_ON_SANDBOX, *_BODY), routing=Routing.SANDBOX,
    ),
    Operation(
        "sandbox_logs", "GET", _SB + "/logs",
        "Its commands and lifecycle events, also after it stopped (and, for the daemon's "
        "--log-retention, after it was deleted); follow=1 streams them as NDJSON",
        reply=SandboxLogsReply,
        query=(
            Query("after", "integer", "only entries with a larger seq"),
            Query("limit", "integer", "at most this many entries (<= 5000)"),
            Query("follow", "boolean", "stream entries as they come, until it ends"),
        ),
        errors=(*_ON_SANDBOX, InvalidArgument), routing=Routing.SANDBOX,
    ),
    Operation(
        "create_volume", "POST", "/v1/volumes",
        "Create a volume from a tar archive (the body); mount it with volumes={PATH: NAME}",
        body=RAW, reply=VolumeInfo, status=201,
        query=(
            Query("name", "string", "the volume's name (a-z 0-9 . _ -)", required=True,
                  min_length=1),
            Query("max_mb", "integer", "a size limit in MiB its rw writers share"),
        ),
        errors=(*_BODY, VolumeNotFound, VolumeFull, InvalidState, StorageFull),
        routing=Routing.HOME,
    ),
    Operation(
        "snapshot_volume", "POST", "/v1/volumes/{name}/snapshot",
        "A new volume holding this one's files as they are now (docs/network.md)",
        body=VolumeSnapshotRequest, reply=VolumeInfo, status=201,
        errors=(*_BODY, VolumeNotFound, VolumeFull, InvalidState, QuotaExceeded, StorageFull),
        routing=Routing.VOLUME,
    ),
    Operation(
        "create_volume_upload", "POST", "/v1/volumes/{name}/uploads",
        "Start a resumable upload of a file of size bytes into a volume (docs/network.md)",
        body=UploadCreate, body_name="upload", reply=UploadState, status=201,
        errors=(*_BODY, VolumeNotFound, VolumeFull, InvalidState, QuotaExceeded, StorageFull),
        routing=Routing.VOLUME,
    ),
    Operation(
        "patch_volume_upload", "PATCH", "/v1/volumes/{name}/uploads/{upload_id}",
        "Send a volume upload's bytes from the offset in the Upload-Offset header; a "
        "dropped connection keeps what arrived", body=RAW, reply=UploadState,
        errors=(*_BODY, VolumeNotFound, VolumeFull, InvalidState, UploadNotFound),
        routing=Routing.VOLUME,
    ),
    Operation(
        "volume_upload_state", "GET", "/v1/volumes/{name}/uploads/{upload_id}",
        "A volume upload's offset (where to resume)", reply=UploadState,
        errors=(VolumeNotFound, UploadNotFound), routing=Routing.VOLUME,
    ),
    Operation(
        "abandon_volume_upload", "DELETE", "/v1/volumes/{name}/uploads/{upload_id}",
        "Abandon a volume upload", status=204,
        errors=(VolumeNotFound, UploadNotFound), routing=Routing.VOLUME,
    ),
    Operation(
        "list_volumes", "GET", "/v1/volumes", "The caller's volumes",
        reply=VolumeList,
        errors=(VolumeNotFound, InvalidState, StorageFull), routing=Routing.HOME,
    ),
    Operation(
        "get_volume", "GET", "/v1/volumes/{name}", "One volume", reply=VolumeInfo,
        errors=(VolumeNotFound, InvalidState, StorageFull), routing=Routing.HOME,
    ),
    Operation(
        "delete_volume", "DELETE", "/v1/volumes/{name}",
        "Remove a volume no running sandbox mounts (on a cluster: its copies too)",
        status=204,
        errors=(VolumeNotFound, InvalidState, StorageFull), routing=Routing.EVERYWHERE,
    ),
    Operation(
        "expose_port", "POST", _SB + "/ports",
        "Expose a port of the sandbox (HTTP, WebSocket) at a URL with its own access token",
        body=ExposeRequest,
        reply=ExposedPort, status=201,
        errors=(*_ON_SANDBOX, *_BODY, PortClosed, Unsupported), routing=Routing.SANDBOX,
    ),
    Operation(
        "create_network", "POST", "/v1/networks",
        "Create a named network (an egress policy sandboxes use by name: network=NAME)",
        body=NetworkCreate, body_name="network", reply=NetworkInfo, status=201,
        errors=(*_BODY, InvalidState, Forbidden, QuotaExceeded), routing=Routing.HOME,
    ),
    Operation(
        "list_networks", "GET", "/v1/networks", "The caller's named networks",
        reply=NetworkList, routing=Routing.HOME,
    ),
    Operation(
        "get_network", "GET", "/v1/networks/{name}", "One named network", reply=NetworkInfo,
        errors=(NetworkNotFound,), routing=Routing.HOME,
    ),
    Operation(
        "delete_network", "DELETE", "/v1/networks/{name}",
        "Remove a named network (sandboxes made from it keep its policy)", status=204,
        errors=(NetworkNotFound,), routing=Routing.HOME,
    ),
    Operation(
        "network_events", "GET", _SB + "/network/events",
        "A policy sandbox's connections and DNS queries, allowed and refused (the last 1000)",
        reply=NetworkEvents,
        errors=(*_ON_SANDBOX, Unsupported), routing=Routing.SANDBOX,
    ),
    Operation(
        "update_network", "PUT", _SB + "/network",
        "Enforce a new egress policy on a running policy sandbox; connections it refuses are "
        "reset",
        body=NetworkPolicy, reply=SandboxInfo, body_name="network policy",
        errors=(*_ON_SANDBOX, *_BODY, Unsupported), routing=Routing.SANDBOX,
    ),
    Operation(
        "pause_sandbox", "POST", _SB + "/pause", "Freeze a sandbox", reply=SandboxInfo,
        errors=(*_ON_SANDBOX,), routing=Routing.SANDBOX,
    ),
    Operation(
        "resume_sandbox", "POST", _SB + "/resume",
        "Thaw a paused sandbox, or restore a hibernated one under its id", reply=SandboxInfo,
        errors=(*_ON_SANDBOX, SandboxStartError), routing=Routing.SANDBOX,
    ),
    Operation(
        "hibernate_sandbox", "POST", _SB + "/hibernate",
        "Write a checkpointable sandbox's processes to disk and free its memory, keeping its "
        "id; resume (or its next command or file operation) restores it (docs/live.md)",
        reply=SandboxInfo, errors=(*_ON_SANDBOX, SnapshotTooLarge, StorageFull, Unsupported),
        routing=Routing.SANDBOX,
    ),
    Operation(
        "kill_processes", "POST", _SB + "/kill-processes",
        "SIGKILL every process the sandbox's code started; the sandbox stays running",
        reply=KilledProcesses, errors=(*_ON_SANDBOX,), routing=Routing.SANDBOX,
    ),
    Operation(
        "stop_sandbox", "POST", _SB + "/stop", "Stop a sandbox (record kept)", body=StopRequest,
        reply=SandboxInfo, body_optional=True, errors=(*_ON_SANDBOX, *_BODY),
        routing=Routing.SANDBOX,
    ),
    Operation(
        "delete_sandbox", "DELETE", _SB, "Delete a sandbox (idempotent)", status=204,
        errors=(*_ON_SANDBOX,), routing=Routing.SANDBOX,
    ),
    Operation(
        "snapshot_sandbox", "POST", _SB + "/snapshot",
        "Commit a sandbox's files as a snapshot (create from it with snapshot=)",
        body=SnapshotRequest, reply=SnapshotInfo, status=201, body_optional=True,
        errors=(*_ON_SANDBOX, *_BODY, SnapshotTooLarge, StorageFull), routing=Routing.SANDBOX,
    ),
    Operation(
        "checkpoint_sandbox", "POST", _SB + "/checkpoint",
        "Save a checkpointable sandbox's running processes and files as a live snapshot "
        "(create from it with snapshot= to run them on; docs/live.md)",
        body=SnapshotRequest, reply=SnapshotInfo, status=201, body_optional=True,
        errors=(*_ON_SANDBOX, *_BODY, SnapshotTooLarge, StorageFull, Unsupported),
        routing=Routing.SANDBOX,
    ),
    Operation(
        "fork_sandbox", "POST", _SB + "/fork",
        "Start n copies of a sandbox's files and spec (each waits for room)", body=ForkRequest,
        reply=SandboxList, status=201,
        errors=(
            *_ON_SANDBOX, *_BODY, CapacityExceeded, QuotaExceeded, SnapshotTooLarge, StorageFull,
            SandboxStartError,
        ),
        routing=Routing.SANDBOX,
    ),
    Operation(
        "exec_command", "POST", _SB + "/exec", "Run a command to completion", body=ExecRequest,
        reply=ExecResponse,
        errors=(*_ON_SANDBOX, *_BODY, SandboxProtocolError, OutputBudgetExceeded),
        routing=Routing.SANDBOX,
    ),
    Operation(
        "exec_stream", "POST", _SB + "/exec/stream", "Run a command, streaming its output",
        body=ExecRequest, reply=NDJSON,
        errors=(*_ON_SANDBOX, *_BODY, SandboxProtocolError, OutputBudgetExceeded),
        routing=Routing.SANDBOX,
    ),
    Operation(
        "spawn_process", "POST", _SB + "/processes",
        "Start an interactive process (stdin stays open; see docs/api.md)",
        body=SpawnRequest,
        reply=ProcessInfo, status=201,
        errors=(*_ON_SANDBOX, *_BODY, SandboxProtocolError, NotFound), routing=Routing.SANDBOX,
    ),
    Operation(
        "list_processes", "GET", _SB + "/processes", "List processes",
        reply=ProcessList, errors=(*_ON_SANDBOX, NotFound),
        routing=Routing.SANDBOX,
    ),
    Operation(
        "get_process", "GET", _SB + "/processes/{process_id}",
        "One process, with its result once exited",
        reply=ProcessInfo, errors=(*_ON_SANDBOX, NotFound),
        routing=Routing.SANDBOX,
    ),
    Operation(
        "write_stdin", "POST", _SB + "/processes/{process_id}/stdin",
        "Write to a process's stdin (raw body); close=true closes it after", body=RAW, status=204,
        query=(Query("close", "boolean", "close stdin after writing the body"),),
        errors=(*_ON_SANDBOX, *_BODY, NotFound), routing=Routing.SANDBOX,
    ),
    Operation(
        "read_output", "GET", _SB + "/processes/{process_id}/output",
        "Stream a process's unread output, then its exit (leaving does not kill it)",
        reply=NDJSON, errors=(*_ON_SANDBOX, NotFound), routing=Routing.SANDBOX,
    ),
    Operation(
        "exchange", "POST", _SB + "/processes/{process_id}/exchange",
        "Write the body to stdin, reply with the next line of stdout (empty: it exited)",
        body=RAW, reply=RAW,
        query=(Query("timeout", "number", "seconds to wait for the line (default: none)"),),
        errors=(*_ON_SANDBOX, *_BODY, SandboxProtocolError, NotFound), routing=Routing.SANDBOX,
    ),
    Operation(
        "consume", "POST", _SB + "/processes/{process_id}/consume",
        "Write the body to stdin, read the next line of stdout, wait for the exit, delete "
        "the sandbox; reply with the line and the exit (the sandbox is gone whatever happened)",
        body=RAW, reply=ConsumeResponse,
        query=(Query("timeout", "number", "seconds to wait for the line (default: none); "
                     "past it the process is killed"),
               Query("exit_timeout", "number", "seconds the process may take to exit after "
                     "its line (default 5); past it, it is killed"),
               Query("delete", "string", "'before' (default: the sandbox is gone when the "
                     "reply comes) or 'after' (the reply comes once the line and the exit "
                     "are known; the deletion, already under way, goes on after it)",
                     enum=("before", "after"))),
        errors=(*_ON_SANDBOX, *_BODY, SandboxProtocolError, NotFound), routing=Routing.SANDBOX,
    ),
    Operation(
        "exchange_many", "POST", "/v1/processes/exchange",
        "Write to many processes, then read one line from each, in one request",
        body=ExchangeRequest,
        reply=ExchangeResponse,
        errors=(*_BODY, SandboxProtocolError, NotFound), routing=Routing.SPLIT,
    ),
    Operation(
        "signal_process", "POST", _SB + "/processes/{process_id}/signal",
        "Signal a process's group", body=SignalRequest,
        status=204, errors=(*_ON_SANDBOX, *_BODY, NotFound), routing=Routing.SANDBOX,
    ),
    Operation(
        "resize_process", "POST", _SB + "/processes/{process_id}/resize",
        "Set the size of a process's terminal (spawned with pty=true; it gets SIGWINCH)",
        body=ResizeRequest, status=204,
        errors=(*_ON_SANDBOX, *_BODY, NotFound), routing=Routing.SANDBOX,
    ),
    Operation(
        "kill_process", "DELETE", _SB + "/processes/{process_id}",
        "Kill a process and forget it (idempotent)", status=204, errors=(*_ON_SANDBOX, NotFound),
        routing=Routing.SANDBOX,
    ),
    Operation(
        "upload_file", "PUT", _SB + "/files", "Write a file (parents created)", body=RAW,
        status=204,
        query=(
            _PATH,
            Query("mode", "string", "octal permissions, e.g. 0644"),
        ),
        errors=(*_ON_SANDBOX, *_FILES, InvalidArgument), routing=Routing.SANDBOX,
    ),
    Operation(
        "create_upload", "POST", _SB + "/uploads",
        "Start a resumable upload of a file of size bytes (docs/network.md)",
        body=UploadCreate, body_name="upload", reply=UploadState, status=201,
        errors=(*_ON_SANDBOX, *_BODY, PathOutsideSandbox), routing=Routing.SANDBOX,
    ),
    Operation(
        "patch_upload", "PATCH", _SB + "/uploads/{upload_id}",
        "Send an upload's bytes from the offset in the Upload-Offset header; a dropped "
        "connection keeps what arrived", body=RAW, reply=UploadState,
        errors=(*_ON_SANDBOX, *_FILES, InvalidArgument, UploadNotFound),
        routing=Routing.SANDBOX,
    ),
    Operation(
        "upload_state", "GET", _SB + "/uploads/{upload_id}",
        "An upload's offset (where to resume)", reply=UploadState,
        errors=(*_ON_SANDBOX, UploadNotFound), routing=Routing.SANDBOX,
    ),
    Operation(
        "abandon_upload", "DELETE", _SB + "/uploads/{upload_id}", "Abandon an upload",
        status=204, errors=(*_ON_SANDBOX, UploadNotFound), routing=Routing.SANDBOX,
    ),
    Operation(
        "download_file", "GET", _SB + "/files", "Read a file", reply=RAW,
        query=(
            _PATH,
        ),
        errors=(*_ON_SANDBOX, *_FILES, InvalidArgument), routing=Routing.SANDBOX,
    ),
    Operation(
        "remove_file", "DELETE", _SB + "/files", "Remove a file or directory", status=204,
        query=(
            _PATH,
            Query("recursive", "boolean", "remove a directory's contents too"),
        ),
        errors=(*_ON_SANDBOX, *_FILES, InvalidArgument), routing=Routing.SANDBOX,
    ),
    Operation(
        "list_files", "GET", _SB + "/files/list", "List a directory", reply=FileList,
        query=(Query("path", "string", "the directory (default: the workdir)", min_length=1),),
        errors=(*_ON_SANDBOX, *_FILES, InvalidArgument), routing=Routing.SANDBOX,
    ),
    Operation(
        "stat_file", "GET", _SB + "/files/stat", "Describe a file", reply=FileInfo,
        query=(
            _PATH,
        ),
        errors=(*_ON_SANDBOX, *_FILES, InvalidArgument), routing=Routing.SANDBOX,
    ),
    Operation(
        "make_dir", "POST", _SB + "/files/mkdir", "Make a directory", body=MkdirRequest,
        status=204, errors=(*_ON_SANDBOX, *_FILES, InvalidArgument), routing=Routing.SANDBOX,
    ),
    Operation(
        "create_pool", "POST", "/v1/pools", "Create a warm pool", body=PoolSpec, reply=PoolInfo,
        status=201, body_optional=True, body_name="pool",
        errors=(*_BODY, InvalidState, ImageNotFound, RegistryError), routing=Routing.POOL_CREATE,
    ),
    Operation(
        "create_lease", "POST", "/v1/leases",
        "Take a client lease: sandboxes tagged with it end once it is not renewed",
        body=LeaseRequest,
        reply=LeaseInfo, status=201, errors=(*_BODY,),
        routing=Routing.LEASE,
    ),
    Operation(
        "renew_lease", "POST", "/v1/leases/{lease_id}/renew", "Renew a lease for another ttl",
        reply=LeaseInfo, errors=(LeaseNotFound,),
        routing=Routing.LEASE,
    ),
    Operation(
        "release_lease", "DELETE", "/v1/leases/{lease_id}",
        "Release a lease: its sandboxes stop now (idempotent)", status=204,
        errors=(LeaseNotFound,), routing=Routing.LEASE,
    ),
    Operation(
        "list_pools", "GET", "/v1/pools", "List warm pools", reply=PoolList,
        routing=Routing.MERGE,
    ),
    Operation(
        "get_pool", "GET", "/v1/pools/{name}", "One pool, with its sandboxes' ids",
        reply=PoolDetail, errors=(NotFound,), routing=Routing.POOL,
    ),
    Operation(
        "delete_pool", "DELETE", "/v1/pools/{name}", "Delete a pool and its ready sandboxes",
        status=204, errors=(NotFound,), routing=Routing.POOL,
    ),
    Operation(
        "acquire_from_pool", "POST", "/v1/pools/{name}/acquire",
        "Hand out a live sandbox of the pool (delete it after use)", body=AcquireRequest,
        reply=SandboxInfo, body_optional=True,
        errors=(
            *_BODY, NotFound, CapacityExceeded, QuotaExceeded, SandboxTimeout, SandboxStartError,
        ),
        routing=Routing.POOL,
    ),
    Operation(
        "reserve_from_pool", "POST", "/v1/pools/{name}/reserve",
        "Take up to count ready sandboxes of the pool at once, held under the caller's "
        "lease (deleted when it ends)", body=ReserveRequest, reply=ReserveReply,
        errors=(*_BODY, NotFound, LeaseNotFound), routing=Routing.POOL,
    ),
    Operation(
        "list_snapshots", "GET", "/v1/snapshots", "List snapshots", reply=SnapshotList,
        errors=(SnapshotNotFound,), routing=Routing.MERGE,
    ),
    Operation(
        "list_images", "GET", "/v1/images", "List images", reply=ImageList, routing=Routing.HOME,
    ),
    *DAEMON_OPERATIONS,
)

_BY_NAME = {op.name: op for op in OPERATIONS}
_PATTERNS = tuple((op, op.pattern()) for op in OPERATIONS)


def operation(name: str) -> Operation:
    """The operation called ``name`` (KeyError if none is)."""
    return _BY_NAME[name]


def url(name: str, /, **params: object) -> str:
    """The path of operation ``name`` with its parameters filled in:
    ``url("exec_command", sandbox_id="sb-1")`` is ``/v1/sandboxes/sb-1/exec``."""
    return _BY_NAME[name].url(**params)


def request_line(name: str, /, **params: object) -> tuple[str, str]:
    """``(method, path)`` of operation ``name`` with its parameters filled in."""
    op = _BY_NAME[name]
    return op.method, op.url(**params)


def match(method: str, path: str) -> tuple[Operation, dict[str, str]] | None:
    """The operation serving ``method path`` and its path parameters (still
    percent-encoded), or None."""
    for op, pattern in _PATTERNS:
        if op.method == method and (found := pattern.fullmatch(path)):
            return op, found.groupdict()
    return None
