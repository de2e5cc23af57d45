"""The routes of client leases (:mod:`corral.server.leases`): ``POST /v1/leases``,
``POST /v1/leases/{id}/renew``, ``DELETE /v1/leases/{id}``; each acts for its caller's
tenant."""

from __future__ import annotations

from starlette.requests import Request
from starlette.responses import JSONResponse, Response

from corral.api.daemon_models import LeaseRequest
from corral.server.caller import caller_of
from corral.server.leases import Leases


def leases_of(request: Request) -> Leases:
    leases: Leases = request.app.state.leases
    return leases


async def create_lease(request: Request, body: LeaseRequest) -> Response:
    info = leases_of(request).create(caller_of(request).name, body.ttl, body.id)
    return JSONResponse(info.model_dump(mode="json"), status_code=201)


async def renew_lease(request: Request) -> Response:
    info = leases_of(request).renew(caller_of(request).name,
                                    request.path_params["lease_id"])
    return JSONResponse(info.model_dump(mode="json"))


async def release_lease(request: Request) -> Response:
    await leases_of(request).release(caller_of(request).name,
                                     request.path_params["lease_id"])
    return Response(status_code=204)
