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
from corral.pool_schema import AcquireRequest, ReserveRequest
from corral.schema import SandboxInfo
from corral.server import context as ctx
from corral.server.caller import caller_of
from corral.server.context import kept_unless_gone, unless_gone
from corral.server.lease_routes import leases_of
from corral.server.routes import info_json


async def reserve_from_pool(request: Request, body: ReserveRequest) -> Response:
    caller = caller_of(request)
    leases_of(request).hold(caller.name, body.lease, ())  # LeaseNotFound before any take
    taken = await ctx.pools(request).take_ready(
        request.path_params["name"], body.count, owner=ctx.owner(request))
    await _hold(request, body.lease, taken)
    return JSONResponse({"sandboxes": [info_json(i, request) for i in taken]})


async def acquire_from_pool(request: Request, body: AcquireRequest) -> Response:
    """An acquire (waiting up to ``timeout``); with ``lease``, held under it: a reserve
    that found none ready waits here, and what it gets ends with its lease too."""
    if body.lease is not None:
        leases_of(request).hold(caller_of(request).name, body.lease, ())
    pools, name, owner = ctx.pools(request), request.path_params["name"], ctx.owner(request)
    ready = pools.acquire_now(name, owner=owner)  # one ready and trusted: no task, no turn
    if ready is not None:
        got = await kept_unless_gone(request, ready)
    else:  # it waits, or asks an agent: raced against the hang-up in a task of its own
        got = await unless_gone(request, pools.acquire(name, body.timeout, owner=owner))
    if body.lease is not None:
        await _hold(request, body.lease, [got])
    return JSONResponse(info_json(got, request))


async def _hold(request: Request, lease: str, taken: list[SandboxInfo]) -> None:
    """``taken`` held under ``lease``; if it ended meanwhile, they are deleted now."""
    caller = caller_of(request)
    try:
        leases_of(request).hold(caller.name, lease, [i.id for i in taken])
    except CorralError:  # the lease ended while the take awaited: none is kept
        service = ctx.service(request)
        await asyncio.gather(*(service.delete(i.id, caller) for i in taken))
        raise
