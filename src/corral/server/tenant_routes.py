"""The admin's routes for tenant tokens: ``/v1/tokens`` (``corral token create|ls|update|revoke``).

Only the admin may call them: a request on the daemon's Unix socket, or one carrying
the daemon's own token; a tenant token gets 403. A token is shown once, in the reply
to its creation; the registry keeps only its hash. On a node of a Ray cluster they act
on the cluster's registry (:mod:`corral.server.cluster_tenants`): a revoke there
replies ``{"name", "confirmed", "unconfirmed", "lease_s"}`` rather than 204.
"""

from __future__ import annotations

import dataclasses

from starlette.requests import Request
from starlette.responses import JSONResponse, Response

from corral.api.daemon_models import (
    TokenCreated,
    TokenInfo,
    TokenList,
    TokenRequest,
    TokenUpdate,
)
from corral.server import context as ctx
from corral.server.builds import builds_gate
from corral.server.cluster_tenants import ClusterTenancy
from corral.server.tenants import Tenants, TokenStore, require_admin

__all__ = [
    "TokenCreated", "TokenInfo", "TokenList", "TokenRequest", "TokenUpdate", "create_token",
    "list_tokens", "revoke_token", "update_token",
]


def _tenants(request: Request) -> Tenants:
    return request.app.state.tenants


def _store(request: Request) -> TokenStore:
    store = _tenants(request).store
    assert isinstance(store, TokenStore)
    return store


def _cluster(request: Request) -> ClusterTenancy | None:
    return getattr(request.app.state, "cluster_tenancy", None)


def _usage(request: Request, name: str) -> dict[str, float]:
    """What the tenant holds: sandboxes (its builds included), their memory and CPUs,
    its running builds, its snapshots' MB on disk (from the registry) and its stopped
    sandboxes' kept files (both count against max_snapshot_mb)."""
    used: dict[str, float] = dataclasses.asdict(ctx.admission(request).quotas.usage(name))
    used["builds"] = builds_gate(request).running_of(name)
    engine = ctx.engine(request)
    used["snapshot_mb"] = round(engine.snapshots.usage_bytes(name) / (1 << 20), 3)
    used["kept_mb"] = round(engine.kept.bytes_of(name) / (1 << 20), 3)  # stopped sandboxes'
    return used


async def create_token(request: Request, body: TokenRequest) -> Response:
    require_admin(request, "creating a tenant token")
    fields = {"max_sandboxes": body.max_sandboxes, "max_memory_mb": body.max_memory_mb,
              "max_cpus": body.max_cpus, "allow_images": body.allow_images,
              "allow_host_network": body.allow_host_network,
              "max_lifetime": None if body.max_lifetime is None else float(body.max_lifetime),
              "max_snapshot_mb": body.max_snapshot_mb, "max_builds": body.max_builds,
              "max_gpus": body.max_gpus}
    cluster = _cluster(request)
    if cluster is not None:  # the cluster's registry: valid on every node
        tenant, token = await cluster.create(name=body.name, **fields)
    else:
        tenant, token = _store(request).create(body.name, **fields)
    made = TokenCreated(**tenant.to_dict(), token=token, usage=_usage(request, tenant.name))
    return JSONResponse(made.model_dump(mode="json"), status_code=201)


async def list_tokens(request: Request) -> Response:
    require_admin(request, "listing tenant tokens")
    tokens = [TokenInfo(**t.to_dict(), usage=_usage(request, t.name)).model_dump(mode="json")
              for t in _tenants(request).store.list()]
    return JSONResponse({"tokens": tokens})


async def update_token(request: Request, body: TokenUpdate) -> Response:
    """Change a tenant's quotas and rights (``corral token update``); what it holds
    stays, but for its sandboxes using the host-network right when that is taken back
    (they stop: :meth:`Revocation.host_network_revoked`)."""
    require_admin(request, "updating a tenant token")
    changes = body.model_dump(include=body.model_fields_set)
    if changes.get("max_cpus") is not None:
        changes["max_cpus"] = float(changes["max_cpus"])
    if changes.get("max_lifetime") is not None:
        changes["max_lifetime"] = float(changes["max_lifetime"])
    cluster = _cluster(request)
    if cluster is not None:  # the cluster's registry: on every node
        tenant = await cluster.update(request.path_params["name"], changes)
    else:
        tenant = _store(request).update(request.path_params["name"], changes)
    if changes.get("allow_host_network") is False:  # on this node (others: docs/tenants.md)
        await request.app.state.revocation.host_network_revoked(tenant.name)
    info = TokenInfo(**tenant.to_dict(), usage=_usage(request, tenant.name))
    return JSONResponse(info.model_dump(mode="json"))


async def revoke_token(request: Request) -> Response:
    """Revoke a token: every call it opened ends, its pools go, and its running
    sandboxes stop or stay as ``--on-revoke`` says (:mod:`corral.server.revocation`);
    their records stay for the admin to see and delete."""
    require_admin(request, "revoking a tenant token")
    name = request.path_params["name"]
    cluster = _cluster(request)
    if cluster is not None:  # on every node, or it says which did not confirm (and
        return JSONResponse(await cluster.revoke(name))  # waited until they refuse it)
    _store(request).revoke(name)
    await request.app.state.revocation(name)
    return Response(status_code=204)
