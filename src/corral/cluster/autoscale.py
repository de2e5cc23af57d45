"""Sandboxes no node has room for, shown to Ray's autoscaler.

corral's sandboxes use no Ray resources (each node's daemon is a zero-CPU actor), so
Ray cannot see them. They are made visible as a *resource constraint* — what
``ray.autoscaler.sdk.request_resources(bundles=...)`` sets — of one bundle
``{RESOURCE: 1}`` per sandbox: the sandboxes alive on the cluster plus the creates
that wait because every node is full. A node type that advertises ``RESOURCE`` (its
``--max-sandboxes``: ``resources: {"corral_sandbox": 100}`` in the autoscaler's config,
or ``ray start --resources='{"corral_sandbox": 100}'``) is one the autoscaler adds for
them; the live sandboxes in the constraint keep it from scaling the cluster below them.

- A client whose create cannot be placed writes its waiting creates under
  ``demand:<client>`` in the cluster's KV (:func:`publish`), refreshed while it waits,
  deleted when they are placed or give up (:func:`withdraw`); an entry not refreshed
  for :data:`DEMAND_TTL_S` (its process died) no longer counts.
- The supervisor (:mod:`corral.cluster.node`) sums them with the live sandboxes every
  few seconds (:class:`Demand`) and sets the constraint when the sum changes: to none
  at all once nothing is alive or waiting. Bundles of other shapes (someone else's
  ``request_resources``) are kept.
"""

from __future__ import annotations

import json
import logging
import os
import time
from collections.abc import Callable, Iterable
from typing import Any

from corral.cluster import _ray
from corral.errors import CapacityExceeded, InvalidArgument

logger = logging.getLogger("corral.cluster")

RESOURCE = "corral_sandbox"
"""The custom Ray resource of one sandbox slot (``cluster up --resource`` renames it)."""
DEMAND_KEY = "demand:"  # + a client's id: {"sandboxes": n, "memory_mb": m, "at": t}
DEMAND_TTL_S = 30.0
MAX_WAITING = 100_000
"""The most creates one entry counts for: the KV is writable by every Ray member, and a
wild entry must not make the supervisor build a constraint of billions of bundles."""
PLACEMENT_WAIT_S = 120.0
"""How long a create no node has room for waits by default (as a daemon's queue does);
``CORRAL_PLACEMENT_WAIT`` sets it."""
REFRESH_S = 5.0
"""How often a waiting client rewrites its entry (well inside :data:`DEMAND_TTL_S`)."""


def publish(gcs: Any, client_id: str, sandboxes: int, memory_mb: int) -> None:
    """This client has ``sandboxes`` creates (``memory_mb`` in all) that no node has room for."""
    entry = {"sandboxes": sandboxes, "memory_mb": memory_mb, "at": time.time()}
    _ray.kv_put(gcs, DEMAND_KEY + client_id, json.dumps(entry).encode())


def withdraw(gcs: Any, client_id: str) -> None:
    """This client waits for nothing any more."""
    _ray.kv_del(gcs, DEMAND_KEY + client_id)


def pending(gcs: Any, now: float | None = None) -> int:
    """The creates waiting across the cluster; stale entries (their client died) are
    dropped."""
    now = time.time() if now is None else now
    total = 0
    for key in _ray.kv_keys(gcs, DEMAND_KEY):
        raw = _ray.kv_get(gcs, key)
        try:
            entry = json.loads(raw) if raw else None
            fresh = entry is not None and now - float(entry["at"]) <= DEMAND_TTL_S
            count = min(MAX_WAITING, max(0, int(entry["sandboxes"]))) if fresh else 0
        except (ValueError, TypeError, KeyError, OverflowError):
            fresh, count = False, 0
        if not fresh:
            _ray.kv_del(gcs, key)
        total += count
    return total


def bundles(sandboxes: int, resource: str = RESOURCE) -> list[dict[str, float]]:
    """The constraint for ``sandboxes`` sandboxes: one slot each."""
    return [{resource: 1.0}] * sandboxes


def ours(bundle: dict[str, float], resource: str) -> bool:
    return resource in bundle


class Demand:
    """The supervisor's side: sets the cluster's constraint to the sandboxes alive
    (``live()``) plus those waiting, when that changes."""

    def __init__(self, gcs: Any, live: Callable[[], int], resource: str = RESOURCE) -> None:
        self.gcs = gcs
        self.live = live
        self.resource = resource
        self.requested: int | None = None  # what the constraint holds now (None: unknown)

    def tick(self) -> int:
        """Bring the constraint up to date; the number of sandboxes it now asks room for."""
        wanted = self.live() + pending(self.gcs)
        if wanted != self.requested:
            others = [b for b in _ray.resource_constraint(self.gcs) if not ours(b, self.resource)]
            _ray.request_resources(self.gcs, others + bundles(wanted, self.resource))
            if wanted != (self.requested or 0):
                logger.info("corral: asking Ray's autoscaler for room for %d sandboxes", wanted)
            self.requested = wanted
        return wanted


def clear(gcs: Any, resource: str = RESOURCE) -> None:
    """Forget every client's demand and take corral's bundles out of the constraint
    (``cluster down``)."""
    for key in _ray.kv_keys(gcs, DEMAND_KEY):
        _ray.kv_del(gcs, key)
    current = _ray.resource_constraint(gcs)
    others = [b for b in current if not ours(b, resource)]
    if len(others) != len(current):
        _ray.request_resources(gcs, others)


def count(constraint: Iterable[dict[str, float]], resource: str = RESOURCE) -> int:
    """How many sandbox slots a constraint (:func:`corral.cluster._ray.resource_constraint`)
    asks for."""
    return int(sum(b.get(resource, 0) for b in constraint))


def placement_wait() -> float:
    """Seconds a create no node has room for waits: ``CORRAL_PLACEMENT_WAIT``, else
    :data:`PLACEMENT_WAIT_S`."""
    raw = os.environ.get("CORRAL_PLACEMENT_WAIT", "").strip()
    try:
        wait = float(raw) if raw else PLACEMENT_WAIT_S
    except ValueError:
        wait = -1.0
    if not wait >= 0:
        raise InvalidArgument(
            f"CORRAL_PLACEMENT_WAIT must be a number of seconds >= 0, got {raw!r}")
    return wait


def no_room(address: str, memory_mb: int, waited: float) -> CapacityExceeded:
    """The error of a create that waited ``waited`` s for room on the cluster in vain."""
    return CapacityExceeded(
        f"no node of the Ray cluster at {address} had room for a sandbox of {memory_mb} MB "
        f"within {waited:g} s (each is at its --max-sandboxes or --max-memory-mb). The wait "
        f"was shown to Ray's autoscaler as bundles {{{RESOURCE!r}: 1}}: to have it add "
        f"nodes, give a node type resources: {{{RESOURCE!r}: N}} in its config (or the name "
        "given to `corral cluster up --resource`; docs/cluster.md); else delete "
        "sandboxes, add nodes, or wait longer (CORRAL_PLACEMENT_WAIT); "
        f"`corral cluster status --address {address}` shows each node's load",
        details={"limit": "cluster", "memory_mb": memory_mb, "waited_s": waited},
    )
