"""``POST /v1/run``: create a sandbox, run one command in it, delete it, in one call.

The pattern of a code reward (a fresh sandbox per completion, one command, the result)
costs three round trips through the SDK (create, exec, delete); this verb costs one.
Nothing is skipped: the create is the create route's (the image pulled, the spec
planned for the caller, admission and the tenant's quota), the command is the exec
route's, and the sandbox is deleted whatever happens — the command failing, timing
out, or the client hanging up (then the command is killed and the sandbox deleted;
the delete is shielded from that cancellation).
"""

from __future__ import annotations

import asyncio

from starlette.requests import Request
from starlette.responses import Response

from corral.api.models import RunRequest, exec_response
from corral.runtime.output_budget import OutputHold
from corral.schema import ExecResult, SandboxInfo
from corral.server import context as ctx
from corral.server.caller import caller_of
from corral.server.context import unless_disconnected
from corral.server.routes import exec_args
from corral.server.wire import HeldJSONResponse


async def run_once(request: Request, body: RunRequest) -> Response:
    service = ctx.service(request)
    caller = caller_of(request)
    spec = service.plan(await service.with_image(body.spec, caller), caller,
                        host_network=ctx.host_network_allowed(request))
    verbs = ctx.sandboxes(request)

    holds: list[OutputHold] = []

    async def work() -> tuple[SandboxInfo, ExecResult]:
        info = await service.create(spec, caller)
        try:  # the output's room, kept until the reply is sent
            holds.append(verbs.reserve_output(info.id, body.exec.max_output))
            return info, await verbs.exec(info.id, **exec_args(body.exec), output_hold=holds[0])
        finally:
            await asyncio.shield(service.delete(info.id, caller))

    try:
        info, result = await unless_disconnected(request, work())
        return HeldJSONResponse({"sandbox_id": info.id, "result": exec_response(result)},
                                holds[0])
    except BaseException:
        for hold in holds:
            hold.release()
        raise
