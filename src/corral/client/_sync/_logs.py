# Generated from _async/_logs.py by scripts/gen_sync.py: edit that file, not this one.
# ruff: noqa: I001  (the imports keep the source's order, sorted for _async)
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
from collections.abc import Iterator
from typing import Any

from corral.client._sync._client import Client
from corral.client._validate import integer

LogEntry = dict[str, Any]
Ids = dict[str, str]  # the path's parameters: {"sandbox_id": ...}


def read_logs(client: Client, ids: Ids, after: int = 0) -> list[LogEntry]:
    """Every entry after ``after`` (a ``seq``), oldest first."""
    after = integer("after", after, minimum=0)
    entries: list[LogEntry] = []
    while True:
        reply = (client.call("sandbox_logs", ids, params={"after": after})).json()
        entries += reply["entries"]
        if not reply["entries"] or reply["next"] <= after:
            return entries
        after = reply["next"]


def follow_logs(client: Client, ids: Ids, after: int = 0) -> Iterator[LogEntry]:
    """Entries as they are logged, until the sandbox has ended (the last item is
    ``{"kind": "end", "state": ...}``)."""
    after = integer("after", after, minimum=0)
    response = client.call(
        "sandbox_logs", ids, params={"after": after, "follow": "1"}, timeout=None, stream=True)
    try:
        with client._errors():
            for line in response.iter_lines():
                if line.strip():
                    yield json.loads(line)
    finally:
        response.close()
