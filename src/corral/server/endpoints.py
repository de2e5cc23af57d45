"""The daemon's routes: one table (:data:`ENDPOINTS`) that serves them and documents
them (``GET /openapi.json``), so nothing is served undocumented."""

from __future__ import annotations

from starlette.routing import Route

from corral.image_schema import (
    BuildEvent,
    BuildRequest,
    ImageInfo,
    ImageList,
    PruneResult,
    PullEvent,
    PullRequest,
)
from corral.network_schema import NetworkPolicy
from corral.pool_schema import AcquireRequest, PoolDetail, PoolInfo, PoolList, PoolSpec
from corral.schema import (
    FileInfo,
    SandboxInfo,
    SandboxSpec,
    SandboxState,
    SnapshotInfo,
)
from corral.server.cluster_routes import (
    ClusterNodes,
    RefreshReply,
    RefreshRequest,
    cluster_nodes,
    fetch_own_image,
    fetch_own_snapshot,
    refresh_tenants,
)
from corral.server.dockerfile_routes import build_dockerfile_route
from corral.server.endpoint import NDJSON, RAW, TEXT, Endpoint, Query, handler_of
from corral.server.evals import EvalList, EvalReport, EvalRun, list_evals, put_eval
from corral.server.expose import ExposedPort, ExposeRequest, expose_port
from corral.server.image_routes import (
    build_image,
    delete_image,
    get_image,
    import_image_route,
    list_images,
    prune_images,
    pull_image_route,
)
from corral.server.lease_routes import create_lease, release_lease, renew_lease
from corral.server.leases import LeaseInfo, LeaseRequest
from corral.server.metrics import metrics_endpoint
from corral.server.models import (
    DaemonInfo,
    ExecRequest,
    ExecResponse,
    FileList,
    ForkRequest,
    Health,
    KilledProcesses,
    MkdirRequest,
    SandboxDetail,
    SandboxList,
    SnapshotList,
    SnapshotRequest,
    StopRequest,
)
from corral.server.network_routes import NetworkEvents, network_events, update_network
from corral.server.ops_routes import (
    SandboxLogsReply,
    TimeoutRequest,
    patch_sandbox,
    sandbox_logs,
)
from corral.server.peer_layers import (
    FetchRequest,
    FetchStats,
    ImageFetchRequest,
    PeerImage,
    PeerSnapshot,
    fetch_image,
    fetch_snapshot,
    peer_image,
    peer_layer,
    peer_snapshot,
    peer_stats,
)
from corral.server.processes import (
    ExchangeRequest,
    ExchangeResponse,
    ProcessInfo,
    ProcessList,
    ResizeRequest,
    SignalRequest,
    SpawnRequest,
    exchange,
    exchange_many,
    get_process,
    kill_process,
    list_processes,
    read_output,
    resize_process,
    signal_process,
    spawn_process,
    write_stdin,
)
from corral.server.routes import (
    acquire_from_pool,
    checkpoint_sandbox,
    create_pool,
    create_sandbox,
    delete_pool,
    delete_sandbox,
    delete_snapshot,
    download_file,
    exec_command,
    exec_stream,
    fork_sandbox,
    get_pool,
    get_sandbox,
    get_snapshot,
    health,
    info,
    kill_processes,
    list_files,
    list_pools,
    list_sandboxes,
    list_snapshots,
    make_dir,
    pause_sandbox,
    remove_file,
    resume_sandbox,
    snapshot_sandbox,
    stat_file,
    stop_sandbox,
    upload_file,
)
from corral.server.tenant_routes import (
    TokenCreated,
    TokenInfo,
    TokenList,
    TokenRequest,
    TokenUpdate,
    create_token,
    list_tokens,
    revoke_token,
    update_token,
)
from corral.server.volume_routes import (
    VolumeList,
    create_volume,
    delete_volume,
    get_volume,
    list_volumes,
)
from corral.volume_schema import VolumeInfo

_SB = "/v1/sandboxes/{sandbox_id}"
_POOL = "/v1/pools/{name}"
_SNAP = "/v1/snapshots/{id_or_name}"
_IMAGE = "/v1/images/{name}"
_PROC = _SB + "/processes/{process_id}"
_PATH = Query(
    "path", "string", "a path in the sandbox (relative ones start at its workdir)", required=True,
    min_length=1,
)

ENDPOINTS: tuple[Endpoint, ...] = (
    Endpoint("GET", "/v1/health", health, "Is the daemon up", reply=Health),
    Endpoint("GET", "/v1/info", info, "Version, limits and what is in use", reply=DaemonInfo),
    Endpoint("GET", "/metrics", metrics_endpoint,
             "Prometheus metrics (admin only on TCP; 404 with --no-metrics)", reply=TEXT),
    Endpoint(
        "POST",
        "/v1/sandboxes",
        create_sandbox,
        "Create a sandbox (waits for room, and for its tenant's quota)",
        body=SandboxSpec,
        body_optional=True, body_name="sandbox spec",
        reply=SandboxInfo,
        status=201,
        query=(Query("wait", "number", "seconds the create may wait for room or for its "
                     "tenant's quota (cap: the daemon's queue_timeout; left out: room is "
                     "waited for, a quota refused at once)"),),
    ),
    Endpoint(
        "GET",
        "/v1/sandboxes",
        list_sandboxes,
        "List sandboxes",
        reply=SandboxList,
        query=(
            Query("tag", "string", "carries this tag (all must match)", repeat=True),
            Query("state", "string", "is in this state (any may match)", repeat=True,
                  enum=tuple(s.value for s in SandboxState)),
            Query("tenant", "string", "belongs to this tenant (the admin's filter)"),
        ),
    ),
    Endpoint("GET", _SB, get_sandbox, "One sandbox, with usage while alive", reply=SandboxDetail),
    Endpoint(
        "PATCH", _SB, patch_sandbox,
        "Set a running sandbox's end to timeout seconds from now (within --max-lifetime)",
        body=TimeoutRequest, reply=SandboxInfo,
    ),
    Endpoint(
        "GET", _SB + "/logs", sandbox_logs,
        "Its commands and lifecycle events, also after it stopped (and, for the daemon's "
        "--log-retention, after it was deleted); follow=1 streams them as NDJSON",
        reply=SandboxLogsReply,
        query=(
            Query("after", "integer", "only entries with a larger seq"),
            Query("limit", "integer", "at most this many entries (<= 5000)"),
            Query("follow", "boolean", "stream entries as they come, until it ends"),
        ),
    ),
    Endpoint(
        "POST", "/v1/volumes", create_volume,
        "Create a volume from a tar archive (the body); mount it with volumes={PATH: NAME}",
        body=RAW, reply=VolumeInfo, status=201,
        query=(Query("name", "string", "the volume's name (a-z 0-9 . _ -)", required=True,
                     min_length=1),),
    ),
    Endpoint("GET", "/v1/volumes", list_volumes, "The caller's volumes", reply=VolumeList),
    Endpoint("GET", "/v1/volumes/{name}", get_volume, "One volume", reply=VolumeInfo),
    Endpoint("DELETE", "/v1/volumes/{name}", delete_volume,
             "Remove a volume no running sandbox mounts", status=204),
    Endpoint(
        "POST", _SB + "/ports", expose_port,
        "Expose a port of the sandbox (HTTP, WebSocket) at a URL with its own access token",
        body=ExposeRequest, reply=ExposedPort, status=201,
    ),
    Endpoint(
        "GET", _SB + "/network/events", network_events,
        "A policy sandbox's connections and DNS queries, allowed and refused (the last 1000)",
        reply=NetworkEvents,
    ),
    Endpoint(
        "PUT", _SB + "/network", update_network,
        "Enforce a new egress policy on a running policy sandbox; connections it refuses "
        "are reset", body=NetworkPolicy, body_name="network policy", reply=SandboxInfo,
    ),
    Endpoint("POST", _SB + "/pause", pause_sandbox, "Freeze a sandbox", reply=SandboxInfo),
    Endpoint("POST", _SB + "/resume", resume_sandbox, "Thaw a sandbox", reply=SandboxInfo),
    Endpoint(
        "POST",
        _SB + "/kill-processes",
        kill_processes,
        "SIGKILL every process the sandbox's code started; the sandbox stays running",
        reply=KilledProcesses,
    ),
    Endpoint(
        "POST",
        _SB + "/stop",
        stop_sandbox,
        "Stop a sandbox (record kept)",
        body=StopRequest,
        body_optional=True,
        reply=SandboxInfo,
    ),
    Endpoint("DELETE", _SB, delete_sandbox, "Delete a sandbox (idempotent)", status=204),
    Endpoint(
        "POST",
        _SB + "/snapshot",
        snapshot_sandbox,
        "Commit a sandbox's files as a snapshot (create from it with snapshot=)",
        body=SnapshotRequest,
        body_optional=True,
        reply=SnapshotInfo,
        status=201,
    ),
    Endpoint(
        "POST",
        _SB + "/checkpoint",
        checkpoint_sandbox,
        "Save a checkpointable sandbox's running processes and files as a live snapshot "
        "(create from it with snapshot= to run them on; docs/live.md)",
        body=SnapshotRequest,
        body_optional=True,
        reply=SnapshotInfo,
        status=201,
    ),
    Endpoint(
        "POST",
        _SB + "/fork",
        fork_sandbox,
        "Start n copies of a sandbox's files and spec (each waits for room)",
        body=ForkRequest,
        reply=SandboxList,
        status=201,
    ),
    Endpoint(
        "POST",
        _SB + "/exec",
        exec_command,
        "Run a command to completion",
        body=ExecRequest,
        reply=ExecResponse,
    ),
    Endpoint(
        "POST",
        _SB + "/exec/stream",
        exec_stream,
        "Run a command, streaming its output",
        body=ExecRequest,
        reply=NDJSON,
    ),
    Endpoint(
        "POST",
        _SB + "/processes",
        spawn_process,
        "Start an interactive process (stdin stays open; see docs/api.md)",
        body=SpawnRequest,
        reply=ProcessInfo,
        status=201,
    ),
    Endpoint("GET", _SB + "/processes", list_processes, "List processes", reply=ProcessList),
    Endpoint("GET", _PROC, get_process, "One process, with its result once exited",
             reply=ProcessInfo),
    Endpoint(
        "POST",
        _PROC + "/stdin",
        write_stdin,
        "Write to a process's stdin (raw body); close=true closes it after",
        body=RAW,
        status=204,
        query=(Query("close", "boolean", "close stdin after writing the body"),),
    ),
    Endpoint(
        "GET",
        _PROC + "/output",
        read_output,
        "Stream a process's unread output, then its exit (leaving does not kill it)",
        reply=NDJSON,
    ),
    Endpoint(
        "POST",
        _PROC + "/exchange",
        exchange,
        "Write the body to stdin, reply with the next line of stdout (empty: it exited)",
        body=RAW,
        reply=RAW,
        query=(Query("timeout", "number", "seconds to wait for the line (default: none)"),),
    ),
    Endpoint(
        "POST",
        "/v1/processes/exchange",
        exchange_many,
        "Write to many processes, then read one line from each, in one request",
        body=ExchangeRequest,
        reply=ExchangeResponse,
    ),
    Endpoint(
        "POST", _PROC + "/signal", signal_process, "Signal a process's group",
        body=SignalRequest, status=204,
    ),
    Endpoint(
        "POST", _PROC + "/resize", resize_process,
        "Set the size of a process's terminal (spawned with pty=true; it gets SIGWINCH)",
        body=ResizeRequest, status=204,
    ),
    Endpoint("DELETE", _PROC, kill_process, "Kill a process and forget it (idempotent)",
             status=204),
    Endpoint(
        "PUT",
        _SB + "/files",
        upload_file,
        "Write a file (parents created)",
        body=RAW,
        status=204,
        query=(_PATH, Query("mode", "string", "octal permissions, e.g. 0644")),
    ),
    Endpoint("GET", _SB + "/files", download_file, "Read a file", reply=RAW, query=(_PATH,)),
    Endpoint(
        "DELETE",
        _SB + "/files",
        remove_file,
        "Remove a file or directory",
        status=204,
        query=(_PATH, Query("recursive", "boolean", "remove a directory's contents too")),
    ),
    Endpoint(
        "GET",
        _SB + "/files/list",
        list_files,
        "List a directory",
        reply=FileList,
        query=(Query("path", "string", "the directory (default: the workdir)", min_length=1),),
    ),
    Endpoint(
        "GET", _SB + "/files/stat", stat_file, "Describe a file", reply=FileInfo, query=(_PATH,)
    ),
    Endpoint(
        "POST", _SB + "/files/mkdir", make_dir, "Make a directory", body=MkdirRequest, status=204
    ),
    Endpoint(
        "POST", "/v1/pools", create_pool, "Create a warm pool", body=PoolSpec, reply=PoolInfo,
        body_optional=True, body_name="pool",
        status=201,
    ),
    Endpoint("POST", "/v1/leases", create_lease,
             "Take a client lease: sandboxes tagged with it end once it is not renewed",
             body=LeaseRequest, reply=LeaseInfo, status=201),
    Endpoint("POST", "/v1/leases/{lease_id}/renew", renew_lease,
             "Renew a lease for another ttl", reply=LeaseInfo),
    Endpoint("DELETE", "/v1/leases/{lease_id}", release_lease,
             "Release a lease: its sandboxes stop now (idempotent)", status=204),
    Endpoint("GET", "/v1/pools", list_pools, "List warm pools", reply=PoolList),
    Endpoint("GET", _POOL, get_pool, "One pool, with its sandboxes' ids", reply=PoolDetail),
    Endpoint("DELETE", _POOL, delete_pool, "Delete a pool and its ready sandboxes", status=204),
    Endpoint(
        "POST",
        _POOL + "/acquire",
        acquire_from_pool,
        "Hand out a live sandbox of the pool (delete it after use)",
        body=AcquireRequest,
        body_optional=True,
        reply=SandboxInfo,
    ),
    Endpoint("GET", "/v1/snapshots", list_snapshots, "List snapshots", reply=SnapshotList),
    Endpoint("GET", "/v1/images", list_images, "List images", reply=ImageList),
    Endpoint("GET", _IMAGE, get_image, "One image", reply=ImageInfo),
    Endpoint(
        "DELETE", _IMAGE, delete_image,
        "Delete an image (idempotent; refused while sandboxes, snapshots or images use it)",
        status=204,
    ),
    Endpoint(
        "POST",
        "/v1/images/build",
        build_image,
        "Build an image from a spec (JSON, or a tar with build.json and context/), "
        "streaming its log",
        body=BuildRequest,
        parse_body=False,
        reply=(NDJSON, BuildEvent),
    ),
    Endpoint(
        "POST",
        "/v1/images/dockerfile",
        build_dockerfile_route,
        "Build a Dockerfile (a tar with dockerfile.json and context/), streaming its log",
        body=RAW,
        reply=(NDJSON, BuildEvent),
    ),
    Endpoint(
        "POST",
        "/v1/images/pull",
        pull_image_route,
        "Pull an image from an OCI/Docker registry, streaming its progress",
        body=PullRequest,
        parse_body=False,
        reply=(NDJSON, PullEvent),
    ),
    Endpoint("POST", "/v1/images/prune", prune_images,
             "Delete the layers no image, cache entry or sandbox holds", reply=PruneResult),
    Endpoint(
        "POST",
        "/v1/images/import",
        import_image_route,
        "Import a docker save tarball or an OCI image layout (as a tar)",
        body=RAW,
        reply=ImageInfo,
        status=201,
        query=(Query("name", "string", "the image's name (one of that name is replaced)",
                     required=True, min_length=1),),
    ),
    Endpoint("POST", "/v1/tokens", create_token, "Make a tenant token (admin only; shown once)",
             body=TokenRequest, reply=TokenCreated, status=201),
    Endpoint("GET", "/v1/tokens", list_tokens, "List tenants: quotas and use (admin only)",
             reply=TokenList),
    Endpoint("PATCH", "/v1/tokens/{name}", update_token,
             "Change a tenant's quotas (admin only; fields left out stay)",
             body=TokenUpdate, reply=TokenInfo),
    Endpoint("DELETE", "/v1/tokens/{name}", revoke_token,
             "Revoke a tenant token: refused from its next request (admin only)", status=204),
    Endpoint("GET", _SNAP, get_snapshot, "One snapshot, by id or name", reply=SnapshotInfo),
    Endpoint("POST", "/v1/peer/snapshots/fetch", fetch_snapshot,
             "Cluster: make a snapshot of another node restorable here (fetches its layers)",
             body=FetchRequest, reply=SnapshotInfo),
    Endpoint("GET", "/v1/peer/snapshots/{id_or_name}", peer_snapshot,
             "Cluster: a snapshot's layers and digests, for another node to fetch",
             reply=PeerSnapshot,
             query=(Query("owner", "string", "find it as this tenant does (its own only)"),)),
    Endpoint("POST", "/v1/peer/tenants/refresh", refresh_tenants,
             "Cluster: read the cluster's tenant registry again now", body=RefreshRequest,
             reply=RefreshReply),
    Endpoint("GET", "/v1/cluster/nodes", cluster_nodes,
             "Cluster: every alive node's daemon (id, URL, capacity), for a cluster client",
             reply=ClusterNodes),
    Endpoint("POST", "/v1/cluster/snapshots/fetch", fetch_own_snapshot,
             "Cluster: make a snapshot of yours on another node restorable here",
             body=FetchRequest, reply=SnapshotInfo),
    Endpoint("POST", "/v1/cluster/images/fetch", fetch_own_image,
             "Cluster: make a built image of another node usable here",
             body=ImageFetchRequest, reply=ImageInfo),
    Endpoint("GET", "/v1/peer/layers/{digest}", peer_layer,
             "Cluster: one layer of a snapshot held here, as a tar stream", reply=RAW),
    Endpoint("POST", "/v1/peer/images/fetch", fetch_image,
             "Cluster: make a built image of another node usable here (fetches its layers)",
             body=ImageFetchRequest, reply=ImageInfo),
    Endpoint("GET", "/v1/peer/images/{name}", peer_image,
             "Cluster: a built image's manifest, for another node to pull", reply=PeerImage),
    Endpoint("GET", "/v1/peer/stats", peer_stats, "Cluster: layers fetched from other nodes",
             reply=FetchStats),
    Endpoint(
        "DELETE", _SNAP, delete_snapshot,
        "Delete a snapshot (idempotent; sandboxes started from it keep running)", status=204,
    ),
    Endpoint(
        "PUT", "/v1/evals/{eval_id}", put_eval,
        "Report an evaluation run's progress (corral.rl.evaluate does; shown at /ui)",
        body=EvalReport, reply=EvalRun,
    ),
    Endpoint("GET", "/v1/evals", list_evals, "Recent evaluation runs, newest first",
             reply=EvalList),
)


def build_routes() -> list[Route]:
    """Starlette routes for :data:`ENDPOINTS` plus ``GET /openapi.json``."""
    from corral.server.openapi import openapi_route

    routes = [Route(e.path, handler_of(e), methods=[e.method]) for e in ENDPOINTS]
    return [*routes, openapi_route(ENDPOINTS)]
