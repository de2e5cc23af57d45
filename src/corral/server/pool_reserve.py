"""A client's reserve of pooled sandboxes: ``POST /v1/pools/{name}/reserve``.

An SDK pool made with ``reserve=N`` takes up to ``N`` of the pool's ready sandboxes in
one call and hands them out later with no round trip (``corral.Pool.acquire``). Each is
handed out by the daemon exactly as by an acquire (checked alive, never again offered
to anyone: the pool's ``acquired`` set), belongs to the caller's tenant (its quota
counts it from its create), and is tied to the caller's lease (``corral.server.leases``):
when the lease ends (released when the pool closes, or not renewed because the client
died) every sandbox the reserve took is deleted, used or not. A lease must be the
caller's own tenant's and alive, checked before and again after the take (the take
awaits liveness checks): a reserve never holds sandboxes no lease would end.
"""

from __future__ import annotations

import asyncio

from starlette.requests import Request
from starlette.responses import JSONResponse, Response

from corral.errors import CorralError
from corral.pool_schema import ReserveRequest
from corral.server import context as ctx
from corral.server.caller import caller_of
from corral.server.lease_routes import leases_of
from corral.server.routes import info_json


async def reserve_from_pool(request: Request, body: ReserveRequest) -> Response:
    caller = caller_of(request)
    leases = leases_of(request)
    leases.hold(caller.name, body.lease, ())  # LeaseNotFound before anything is taken
    taken = await ctx.pools(request).take_ready(
        request.path_params["name"], body.count, owner=ctx.owner(request))
    try:
        leases.hold(caller.name, body.lease, [i.id for i in taken])
    except CorralError:  # the lease ended while the liveness checks ran: none is kept
        service = ctx.service(request)
        await asyncio.gather(*(service.delete(i.id, caller) for i in taken))
        raise
    return JSONResponse({"sandboxes": [info_json(i, request) for i in taken]})
