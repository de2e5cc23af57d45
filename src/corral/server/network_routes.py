"""Routes for a policy sandbox's network (docs/network.md): what it tried to reach
(``GET .../network/events``) and a new policy (``PUT .../network``)."""

from __future__ import annotations

from typing import Literal

from pydantic import Field
from starlette.requests import Request
from starlette.responses import JSONResponse, Response

from corral.network_schema import NetworkPolicy
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
    events = ctx.engine(request).network_events(sid)
    return JSONResponse({"sandbox_id": sid, "events": events})


async def update_network(request: Request, body: NetworkPolicy) -> Response:
    sid = request.path_params["sandbox_id"]
    info = await ctx.service(request).update_network(sid, body, caller_of(request))
    return JSONResponse(info.model_dump(mode="json"))
