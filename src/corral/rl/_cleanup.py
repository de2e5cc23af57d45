"""Sandboxes a run could not delete, deleted again at its end (:mod:`corral.rl.episodes`)."""

from __future__ import annotations

import asyncio
import logging

import corral
from corral.errors import CorralError, SandboxNotFound

logger = logging.getLogger("corral.rl")


async def delete_again(left: dict[str, corral.AsyncSandbox], tries: int, backoff: float) -> None:
    """Delete each sandbox of ``left`` (by id), up to ``tries`` rounds ``backoff × round``
    seconds apart; one deleted (or gone already) leaves ``left``, what stays is logged."""
    error: CorralError | None = None
    for attempt in range(tries):
        if not left:
            return
        if attempt:
            await asyncio.sleep(backoff * attempt)
        for sid, sb in list(left.items()):
            try:
                await sb.delete()
            except SandboxNotFound:
                pass
            except CorralError as exc:
                error = exc
                continue
            left.pop(sid, None)
    if left:
        logger.warning("could not delete sandboxes %s after %d tries: %s",
                       ", ".join(sorted(left)), tries, error)
