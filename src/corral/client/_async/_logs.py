"""A sandbox's log: its commands and lifecycle events, also after it stopped.

Each entry is a dict with ``seq``, ``kind`` and ``at`` (Unix time). A ``"command"``
has ``argv``, ``started_at``, ``ended_at``, ``outcome`` (``exit``, ``timeout``,
``oom`` or ``killed``), ``exit_code`` and the tails of its output, ``stdout_tail`` and
``stderr_tail`` (a few KiB each); an ``"event"`` has ``event`` (``ready``, ``restored``,
``paused``, ``running``, ``stopping``, ``stopped``, ``timeout``, ``idle_timeout``,
``oom``, ``deleted``) and ``reason``. See ``GET /v1/sandboxes/{id}/logs``.
"""

from __future__ import annotations

import json
from collections.abc import AsyncIterator
from typing import Any

from corral.client._async._client import AsyncClient
from corral.client._validate import integer

LogEntry = dict[str, Any]
Ids = dict[str, str]  # the path's parameters: {"sandbox_id": ...}


async def read_logs(client: AsyncClient, ids: Ids, after: int = 0) -> list[LogEntry]:
    """Every entry after ``after`` (a ``seq``), oldest first."""
    after = integer("after", after, minimum=0)
    entries: list[LogEntry] = []
    while True:
        reply = (await client.call("sandbox_logs", ids, params={"after": after})).json()
        entries += reply["entries"]
        if not reply["entries"] or reply["next"] <= after:
            return entries
        after = reply["next"]


async def follow_logs(client: AsyncClient, ids: Ids, after: int = 0) -> AsyncIterator[LogEntry]:
    """Entries as they are logged, until the sandbox has ended (the last item is
    ``{"kind": "end", "state": ...}``)."""
    after = integer("after", after, minimum=0)
    response = await client.call(
        "sandbox_logs", ids, params={"after": after, "follow": "1"}, timeout=None, stream=True)
    try:
        with client._errors():
            async for line in response.aiter_lines():
                if line.strip():
                    yield json.loads(line)
    finally:
        await response.aclose()
