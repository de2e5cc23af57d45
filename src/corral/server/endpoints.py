"""The daemon's native routes: each operation of :mod:`corral.api.operations` (the
wire contract shared with the SDK) served by its handler here, keyed by the operation's
name, and documented at ``GET /openapi.json``. An operation without a handler, or a
handler without an operation, stops the daemon from building its routes."""

from __future__ import annotations

from starlette.routing import Route

from corral.api.operations import OPERATIONS
from corral.server.cluster_routes import (
    cluster_nodes,
    fetch_own_image,
    fetch_own_snapshot,
    refresh_tenants,
)
from corral.server.dockerfile_routes import build_dockerfile_route
from corral.server.endpoint import Endpoint, Handler, bind, handler_of
from corral.server.evals import (
    list_evals,
    put_eval,
)
from corral.server.expose import expose_port
from corral.server.image_routes import (
    build_image,
    delete_image,
    get_image,
    import_image_route,
    list_images,
    prune_images,
    pull_image_route,
)
from corral.server.lease_routes import (
    create_lease,
    release_lease,
    renew_lease,
)
from corral.server.metrics import metrics_endpoint
from corral.server.network_routes import (
    create_network,
    delete_network,
    get_network,
    list_networks,
    network_events,
    update_network,
)
from corral.server.node_proof import node_proof
from corral.server.ops_routes import (
    patch_sandbox,
    sandbox_logs,
)
from corral.server.peer_layers import (
    fetch_image,
    fetch_snapshot,
    peer_checkpoint,
    peer_image,
    peer_layer,
    peer_snapshot,
    peer_stats,
)
from corral.server.peer_volumes import fetch_own_volume, peer_volume
from corral.server.pool_reserve import acquire_from_pool, reserve_from_pool
from corral.server.processes import (
    consume,
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
    hibernate_sandbox,
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
from corral.server.run_once import run_once
from corral.server.tenant_routes import (
    create_token,
    list_tokens,
    revoke_token,
    update_token,
)
from corral.server.upload_routes import (
    abandon_upload,
    create_upload,
    patch_upload,
    upload_state,
)
from corral.server.volume_routes import (
    create_volume,
    delete_volume,
    get_volume,
    list_volumes,
    snapshot_volume,
)
from corral.server.volume_uploads import (
    abandon_volume_upload,
    create_volume_upload,
    patch_volume_upload,
    volume_upload_state,
)

HANDLERS: dict[str, Handler] = {h.__name__: h for h in (
    node_proof, cluster_nodes, fetch_own_image, fetch_own_snapshot, refresh_tenants, build_dockerfile_route,
    list_evals, put_eval, expose_port, build_image, delete_image, get_image, import_image_route,
    list_images, prune_images, pull_image_route, create_lease, release_lease, renew_lease,
    metrics_endpoint, network_events, update_network, patch_sandbox, sandbox_logs, fetch_image,
    fetch_snapshot, peer_checkpoint, peer_image, peer_layer, peer_snapshot, peer_stats, exchange, exchange_many,
    consume,
    get_process, kill_process, list_processes, read_output, resize_process, signal_process,
    spawn_process, write_stdin, acquire_from_pool, reserve_from_pool, run_once, create_pool, create_sandbox, delete_pool,
    delete_sandbox, delete_snapshot, download_file, exec_command, exec_stream, fork_sandbox,
    checkpoint_sandbox, hibernate_sandbox,
    get_pool, get_sandbox, get_snapshot, health, info, kill_processes, list_files, list_pools,
    list_sandboxes, list_snapshots, make_dir, pause_sandbox, remove_file, resume_sandbox,
    snapshot_sandbox, stat_file, stop_sandbox, upload_file, create_token, list_tokens,
    revoke_token, update_token, create_volume, delete_volume, get_volume, list_volumes,
    create_network, list_networks, get_network, delete_network, create_upload, patch_upload,
    upload_state, abandon_upload, fetch_own_volume, peer_volume, create_volume_upload,
    patch_volume_upload, volume_upload_state, abandon_volume_upload, snapshot_volume,
)}
"""Each operation's handler, by the operation's name (the handler's own)."""



def endpoints() -> tuple[Endpoint, ...]:
    """Every operation bound to its handler, in the declarations' order."""
    declared = {op.name for op in OPERATIONS}
    if declared != set(HANDLERS):
        raise RuntimeError(
            f"operations without a handler: {sorted(declared - set(HANDLERS))}; handlers "
            f"without an operation: {sorted(set(HANDLERS) - declared)} (corral.api.operations)"
        )
    return tuple(bind(op, HANDLERS[op.name]) for op in OPERATIONS)


def build_routes() -> list[Route]:
    """Starlette routes for every operation plus ``GET /openapi.json``."""
    from corral.server.openapi import openapi_route

    served = endpoints()
    routes = [Route(e.op.path, handler_of(e), methods=[e.op.method]) for e in served]
    return [*routes, openapi_route(served)]
