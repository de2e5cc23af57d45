"""Lifetime control: a running sandbox's deadline moved to ``seconds`` from now.

One mechanism for every front-end (``PATCH /v1/sandboxes/{id}``, E2B's
``/sandboxes/{id}/timeout`` and ``connect``): the daemon's ``--max-lifetime`` bounds
how far ahead a deadline may be set; the engine keeps it (the sandbox's ``timeout``
becomes its new lifetime, counted from its start) and its reaper ends the sandbox then,
with the reason ``timeout``.
"""

from __future__ import annotations

import math

from starlette.requests import Request

from corral.errors import InvalidArgument
from corral.schema import SandboxInfo
from corral.server import context as ctx


async def set_lifetime(request: Request, sandbox_id: str, seconds: float) -> SandboxInfo:
    """End the sandbox ``seconds`` from now (0 < seconds <= the daemon's maximum; E2B's
    front-end may pass 0: at once). A stopped sandbox raises ``InvalidState``."""
    limit = ctx.settings(request).max_lifetime
    if not isinstance(seconds, (int, float)) or not math.isfinite(seconds) or seconds < 0:
        raise InvalidArgument(f"timeout must be a number of seconds > 0, got {seconds!r}",
                              details={"field": "timeout"})
    if seconds > limit:
        raise InvalidArgument(
            f"timeout {seconds:g} s is more than this daemon's maximum lifetime of "
            f"{limit:g} s (corral serve --max-lifetime): ask for at most that",
            details={"field": "timeout", "max": limit},
        )
    return await ctx.engine(request).set_timeout(sandbox_id, float(seconds))
