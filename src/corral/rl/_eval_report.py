"""An evaluation's progress, reported to the daemon it runs on (shown at its ``/ui``).

:class:`EvalReporter` sends the run's whole summary (episodes done of planned, counts
by status, mean and CI, a histogram of returns) with ``PUT /v1/evals/{id}``: at most
every :data:`REPORT_INTERVAL_S` while it runs, and once at the end. Reporting never
changes or slows the evaluation: one request at a time, sent in the background, and
the first failure (an older daemon without the endpoint, a Ray cluster's router)
turns reporting off for the run. ``report=False`` turns it off from the start.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import math
import secrets
import time
from collections.abc import Callable, Iterable
from typing import Any

from corral.errors import CorralError

logger = logging.getLogger("corral.rl")

REPORT_INTERVAL_S = 0.5
HISTOGRAM_BINS = 20
MAX_NAME = 300


def histogram(values: Iterable[float], bins: int = HISTOGRAM_BINS) -> dict[str, Any] | None:
    """``{"low", "high", "counts"}`` of the finite ``values`` in ``bins`` equal bins."""
    finite = [v for v in values if math.isfinite(v)]
    if not finite:
        return None
    low, high = min(finite), max(finite)
    if high == low:
        return {"low": low, "high": high, "counts": [len(finite)]}
    counts = [0] * bins
    width = (high - low) / bins
    for v in finite:
        counts[min(bins - 1, int((v - low) / width))] += 1
    return {"low": low, "high": high, "counts": counts}


class EvalReporter:
    """Reports one evaluation run to ``client``'s daemon (see the module docstring)."""

    def __init__(self, client: Any, *, name: str, env: str, enabled: bool = True) -> None:
        self.client = client
        self.id = "ev-" + secrets.token_hex(8)
        self.name, self.env = name[:MAX_NAME], env[:MAX_NAME]
        self.enabled = enabled and getattr(client, "router", None) is None
        self._task: asyncio.Task[None] | None = None
        self._last = 0.0
        self._pending: dict[str, Any] | Callable[[], dict[str, Any]] | None = None

    def update(self, summary: Callable[[], dict[str, Any]]) -> None:
        """Note that the run's state changed; send it (``summary()``, made only when
        sent: the live bar's statistics cost ~1 ms per finished sandbox) if none is on
        its way and it is time."""
        if not self.enabled:
            return
        self._pending = summary
        if (self._task is None or self._task.done()) and (
            time.monotonic() - self._last >= REPORT_INTERVAL_S
        ):
            self._task = asyncio.ensure_future(self._send_pending())

    async def finish(self, summary: dict[str, Any]) -> None:
        """Send the final state (waiting for one still on its way first)."""
        if not self.enabled:
            return
        if self._task is not None:
            with contextlib.suppress(Exception):
                await self._task
        self._pending = summary
        await self._send_pending()

    async def _send_pending(self) -> None:
        summary, self._pending = self._pending, None
        if summary is None or not self.enabled:
            return
        if callable(summary):
            summary = summary()
        self._last = time.monotonic()
        body = {"name": self.name, "env": self.env, **summary}
        try:
            await self.client.call("put_eval", {"eval_id": self.id}, json=body, timeout=10.0)
        except (CorralError, OSError) as exc:
            logger.debug("not reporting evaluation %s to the daemon: %s", self.id, exc)
            self.enabled = False
