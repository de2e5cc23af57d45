"""Routes for a policy sandbox's network (docs/network.md): what it tried to reach
(``GET .../network/events``) and a new policy (``PUT .../network``); and the caller's
named networks (``/v1/networks``, ``corral.Network``)."""

from __future__ import annotations

import asyncio

from starlette.requests import Request
from starlette.responses import JSONResponse, Response

from corral.api.models import NetworkCreate
from corral.network_schema import NetworkPolicy
from corral.runtime.networks import check_network_name
from corral.server import context as ctx
from corral.server.caller import caller_of


async def network_events(request: Request) -> Response:
    sid = request.path_params["sandbox_id"]
    # off the loop: the kernel's refusals are read with nft (a few ms)
    events = await asyncio.to_thread(ctx.sandboxes(request).network_events, sid)
    return JSONResponse({"sandbox_id": sid, "events": events})


async def update_network(request: Request, body: NetworkPolicy) -> Response:
    sid = request.path_params["sandbox_id"]
    info = await ctx.service(request).update_network(sid, body, caller_of(request))
    return JSONResponse(info.model_dump(mode="json"))


async def create_network(request: Request, body: NetworkCreate) -> Response:
    check_network_name(body.name)
    info = ctx.service(request).create_network(body.name, body.policy, caller_of(request),
                                               private=body.private)
    return JSONResponse(info.model_dump(mode="json"), status_code=201)


async def list_networks(request: Request) -> Response:
    nets = ctx.engine(request).list_networks(owner=ctx.owner(request))
    return JSONResponse({"networks": [n.model_dump(mode="json") for n in nets]})


async def get_network(request: Request) -> Response:
    info = ctx.engine(request).get_network(request.path_params["name"], owner=ctx.owner(request))
    return JSONResponse(info.model_dump(mode="json"))


async def delete_network(request: Request) -> Response:
    await ctx.engine(request).remove_network(request.path_params["name"], owner=ctx.owner(request))
    return Response(status_code=204)
