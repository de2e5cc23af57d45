"""Routes for a policy sandbox's network (docs/network.md): what it tried to reach
(``GET .../network/events``) and a new policy (``PUT .../network``); and the caller's
named networks (``/v1/networks``, ``corral.Network``)."""

from __future__ import annotations

import asyncio
from typing import Literal

from pydantic import Field
from starlette.requests import Request
from starlette.responses import JSONResponse, Response

from corral.network_schema import NetworkInfo, NetworkPolicy
from corral.runtime.networks import check_network_name
from corral.server import context as ctx
from corral.server.caller import caller_of
from corral.server.models import _Body


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


async def network_events(request: Request) -> Response:
    sid = request.path_params["sandbox_id"]
    # off the loop: the kernel's refusals are read with nft (a few ms)
    events = await asyncio.to_thread(ctx.engine(request).network_events, sid)
    return JSONResponse({"sandbox_id": sid, "events": events})


async def update_network(request: Request, body: NetworkPolicy) -> Response:
    sid = request.path_params["sandbox_id"]
    info = await ctx.service(request).update_network(sid, body, caller_of(request))
    return JSONResponse(info.model_dump(mode="json"))


class NetworkCreate(_Body):
    """A named network: its name and policy (``corral network create NAME --allow ...``)."""

    name: str = Field(description="1-63 of a-z 0-9 . _ - ('none' and 'host' are modes)")
    policy: NetworkPolicy


class NetworkList(_Body):
    networks: list[NetworkInfo] = Field(description="the caller's named networks, by name")


async def create_network(request: Request, body: NetworkCreate) -> Response:
    check_network_name(body.name)
    info = ctx.service(request).create_network(body.name, body.policy, caller_of(request))
    return JSONResponse(info.model_dump(mode="json"), status_code=201)


async def list_networks(request: Request) -> Response:
    nets = ctx.engine(request).list_networks()
    return JSONResponse({"networks": [n.model_dump(mode="json") for n in nets]})


async def get_network(request: Request) -> Response:
    info = ctx.engine(request).get_network(request.path_params["name"])
    return JSONResponse(info.model_dump(mode="json"))


async def delete_network(request: Request) -> Response:
    ctx.engine(request).remove_network(request.path_params["name"])
    return Response(status_code=204)
