"""Routes for a policy sandbox's network (docs/network.md): what it tried to reach
(``GET .../network/events``) and a new policy (``PUT .../network``)."""

from __future__ import annotations

from starlette.requests import Request
from starlette.responses import JSONResponse, Response

from corral.network_schema import NetworkPolicy
from corral.server import context as ctx
from corral.server.caller import caller_of


async def network_events(request: Request) -> Response:
    sid = request.path_params["sandbox_id"]
    events = ctx.engine(request).network_events(sid)
    return JSONResponse({"sandbox_id": sid, "events": events})


async def update_network(request: Request, body: NetworkPolicy) -> Response:
    sid = request.path_params["sandbox_id"]
    info = await ctx.service(request).update_network(sid, body, caller_of(request))
    return JSONResponse(info.model_dump(mode="json"))
