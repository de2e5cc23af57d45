"""What a cluster client calls on any node's daemon, tenant or admin (``/v1/cluster/``),
and the one daemon-to-daemon call of the cluster's tenants (``/v1/peer/tenants``).

- ``GET /v1/cluster/nodes``: the directory (each alive node's id, tag, daemon URL and
  capacity, and its daemon's public key; nothing secret) to any authenticated caller,
  so a tenant's client can start from one daemon's URL and key
  (``CORRAL_URL=cluster+http://HOST:PORT?key=KEY``) without being a member of the Ray
  cluster or ever holding its token.
- ``POST /v1/cluster/snapshots/fetch`` ``{"snapshot", "node"}``: make a snapshot of
  the caller's, held by ``node``, restorable here. This daemon asks the holder with
  the cluster's peer credential, as that tenant (``?owner=``): another tenant's snapshot,
  by id or name, answers exactly like one that does not exist, on every node.
- ``POST /v1/cluster/images/fetch`` ``{"image", "node"}``: make a built image of
  ``node`` usable here (images are shared read-only; pulling one changes none).
- ``POST /v1/peer/tenants/refresh`` ``{"name"}``: (the admin or the cluster's peer
  credential, :mod:`corral.server.peer_auth`) read
  the tenant registry again now; ``{"revoked": true}`` once ``name`` is refused here.

The layer routes (``/v1/peer/layers``, ``/v1/peer/snapshots``, ``/v1/peer/images``)
stay the cluster credential's alone: a tenant never reads a layer by digest.
"""

from __future__ import annotations

from typing import Any

from starlette.requests import Request
from starlette.responses import JSONResponse, Response

from corral.api.daemon_models import (
    ClusterNode,
    ClusterNodes,
    RefreshReply,
    RefreshRequest,
)
from corral.cluster import _ray
from corral.cluster.bringup import read_entries
from corral.cluster.ids import node_tag
from corral.errors import InvalidState
from corral.server.caller import require_peer
from corral.server.cluster_tenants import ClusterTenancy, on_gcs
from corral.server.peer_layers import (
    FetchRequest,
    ImageFetchRequest,
    import_snapshot_here,
    pull_image_here,
)
from corral.server.tenants import tenant_of

__all__ = [
    "ClusterNode", "ClusterNodes", "RefreshReply", "RefreshRequest", "cluster_nodes",
    "fetch_own_image", "fetch_own_snapshot", "refresh_tenants",
]






def tenancy(request: Request) -> ClusterTenancy:
    """This daemon's part in the cluster's tenants; :class:`InvalidState` if it serves
    no cluster."""
    found: ClusterTenancy | None = getattr(request.app.state, "cluster_tenancy", None)
    if found is None:
        raise InvalidState("this daemon is not part of a corral cluster: start it with "
                           "`corral cluster up`, or talk to it as one daemon (http://)")
    return found


async def cluster_nodes(request: Request) -> Response:
    here = tenancy(request)
    nodes = await on_gcs(lambda: _listing(here))
    return JSONResponse({"nodes": nodes})


def _listing(here: ClusterTenancy) -> list[dict[str, Any]]:
    states = _ray.node_states(here.gcs)
    capacities = here.capacities()
    return [
        {"node_id": node_id, "tag": node_tag(node_id), "url": str(entry["url"]),
         "alive": True, "capacity": capacities.get(node_id), "key": entry.get("key")}
        for node_id, entry in sorted(read_entries(here.gcs).items())
        if states.get(node_id, {}).get("alive")
    ]


async def fetch_own_snapshot(request: Request, body: FetchRequest) -> Response:
    tenancy(request)
    return await import_snapshot_here(request, body, tenant_of(request))


async def fetch_own_image(request: Request, body: ImageFetchRequest) -> Response:
    tenancy(request)
    return await pull_image_here(request, body)


async def refresh_tenants(request: Request, body: RefreshRequest) -> Response:
    require_peer(request)
    here = tenancy(request)
    await here.refresh()
    revoked = body.name is not None and here.store.revoked(body.name)
    return JSONResponse({"tenants": len(here.store.list()), "revoked": revoked})

