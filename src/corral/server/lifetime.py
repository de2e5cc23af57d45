"""Lifetime control: a running sandbox's deadline moved to ``seconds`` from now.

One mechanism for every front-end (``PATCH /v1/sandboxes/{id}``, E2B's
``/sandboxes/{id}/timeout`` and ``connect``): the daemon's ``--max-lifetime`` (or the
sandbox's tenant's, if lower: ``corral token create --max-lifetime``) bounds its
*total* life counted from its create, however often its deadline is moved
(:meth:`~corral.server.service.SandboxService.set_timeout`); the engine keeps it (the sandbox's ``timeout``
becomes its new lifetime, counted from its start) and its reaper ends the sandbox then,
with the reason ``timeout``.

The same maximum bounds the ``timeout`` a sandbox is created with, on every front-end
(the service's :meth:`~corral.server.service.SandboxService.plan` and ``create``,
:mod:`corral.server.limits`): a timeout asked for above it is refused (a typed 400
naming ``--max-lifetime``: a job that asked for an hour must not be cut at ten minutes
without a word), while the default one (:data:`~corral.schema.DEFAULT_TIMEOUT_S`, what
a create that names none gets) and one inherited (a snapshot's, a fork's, a pool's)
are lowered to it.
"""

from __future__ import annotations

import math

from starlette.requests import Request

from corral.errors import InvalidArgument
from corral.schema import SandboxInfo
from corral.server import context as ctx
from corral.server.caller import caller_of
from corral.server.limits import check_lifetime


async def set_lifetime(request: Request, sandbox_id: str, seconds: float) -> SandboxInfo:
    """End the sandbox ``seconds`` from now (E2B's front-end may pass 0: at once),
    within its owner's maximum lifetime counted from its create. A stopped sandbox
    raises ``InvalidState``."""
    if not isinstance(seconds, (int, float)) or not math.isfinite(seconds) or seconds < 0:
        raise InvalidArgument(f"timeout must be a number of seconds > 0, got {seconds!r}",
                              details={"field": "timeout"})
    service = ctx.service(request)
    caller = caller_of(request)
    check_lifetime(seconds, *service.lifetime_limit(caller.name))  # the caller's first
    return await service.set_timeout(sandbox_id, float(seconds), caller)  # its owner's, in all
