"""Sandboxes no node has room for, shown to Ray's autoscaler.

corral's sandboxes use no Ray resources (each node's daemon is a zero-CPU actor), so
Ray cannot see them. They are made visible as a *resource constraint* — what
``ray.autoscaler.sdk.request_resources(bundles=...)`` sets — of one bundle
``{RESOURCE: 1}`` per sandbox: the sandboxes alive on the cluster plus the creates
that wait because every node is full. A sandbox with GPUs is the bundle
``{RESOURCE: 1, "GPU": n}`` (Ray's own ``num_gpus`` resource): the autoscaler adds a
node type with GPUs for it, never a CPU one. A sandbox sharing a GPU with ``k - 1``
others counts ``1/k`` of it, so sharers do not ask for a GPU each. A node type that advertises ``RESOURCE`` (its
``--max-sandboxes``: ``resources: {"corral_sandbox": 100}`` in the autoscaler's config,
or ``ray start --resources='{"corral_sandbox": 100}'``) is one the autoscaler adds for
them; the live sandboxes in the constraint keep it from scaling the cluster below them.

- A client whose create cannot be placed writes its waiting creates under
  ``demand:<client>`` in the cluster's KV (:func:`publish`; how many ask for how many
  GPUs too), refreshed while it waits,
  deleted when they are placed or give up (:func:`withdraw`); an entry not refreshed
  for :data:`DEMAND_TTL_S` (its process died) no longer counts.
- The supervisor (:mod:`corral.cluster.node`) sums them with the live sandboxes every
  few seconds (:class:`Demand`; each daemon's ``/v1/info`` says what its sandboxes hold
  of its GPUs) and sets the constraint when the sum changes: to none
  at all once nothing is alive or waiting. Bundles of other shapes (someone else's
  ``request_resources``) are kept.
"""

from __future__ import annotations

import json
import logging
import math
import os
import time
from collections import Counter
from collections.abc import Callable, Iterable, Mapping
from typing import Any

from corral.cluster import _ray
from corral.errors import CapacityExceeded, InvalidArgument

logger = logging.getLogger("corral.cluster")

RESOURCE = "corral_sandbox"
"""The custom Ray resource of one sandbox slot (``cluster up --resource`` renames it)."""
GPU = "GPU"
"""Ray's resource of one GPU (what ``num_gpus=`` asks for; a GPU node advertises it)."""
DEMAND_KEY = "demand:"  # + a client's id: {"sandboxes": n, "memory_mb": m, "at": t,
#                        "gpus": {"<GPUs a sandbox>": how many of the n}}
DEMAND_TTL_S = 30.0
MAX_WAITING = 100_000
"""The most creates one entry counts for: the KV is writable by every Ray member, and a
wild entry must not make the supervisor build a constraint of billions of bundles."""
PLACEMENT_WAIT_S = 120.0
"""How long a create no node has room for waits by default (as a daemon's queue does);
``CORRAL_PLACEMENT_WAIT`` sets it."""
REFRESH_S = 5.0
"""How often a waiting client rewrites its entry (well inside :data:`DEMAND_TTL_S`)."""
MAX_GPUS = 1024
"""The most GPUs one sandbox is shown asking for (an entry's larger amounts are dropped)."""

Shapes = Counter[float]
"""How many sandboxes want how much GPU each: ``{0.0: 3, 2.0: 1}`` is three CPU
sandboxes and one with two GPUs."""


def gpu_amount(amount: float) -> float:
    """What one sandbox is shown asking for of ``amount`` GPUs: a share of one GPU to
    four places (as Ray rounds resources), a whole number above one (Ray takes no
    fractions there); 0 for a CPU sandbox."""
    if not amount > 0:
        return 0.0
    return float(math.ceil(amount)) if amount > 1 else max(round(amount, 4), 0.0001)


def shapes_of(counts: Any, limit: int) -> Shapes:
    """``{"<GPUs>": n}`` as sent over the wire (a demand entry, a daemon's
    ``/v1/info``) as :data:`Shapes`, at most ``limit`` sandboxes in all; amounts that do
    not parse, are not finite or are over :data:`MAX_GPUS` are dropped."""
    out: Shapes = Counter()
    if not isinstance(counts, Mapping):
        return out
    for key, n in counts.items():
        try:
            amount, count = float(key), int(n)
        except (TypeError, ValueError, OverflowError):
            continue
        if not (math.isfinite(amount) and 0 < amount <= MAX_GPUS) or count <= 0:
            continue
        count = min(count, limit - sum(out.values()))
        if count <= 0:
            break
        out[gpu_amount(amount)] += count
    return out


def publish(gcs: Any, client_id: str, sandboxes: int, memory_mb: int,
            gpus: Mapping[float, int] | None = None) -> None:
    """This client has ``sandboxes`` creates (``memory_mb`` in all) that no node has room
    for; ``gpus``: how many of them ask for how many GPUs each (``{1: 2}``: two ask for
    one)."""
    entry: dict[str, Any] = {"sandboxes": sandboxes, "memory_mb": memory_mb, "at": time.time()}
    if gpus:
        entry["gpus"] = {f"{gpu_amount(a):g}": n for a, n in gpus.items() if n > 0 and a > 0}
    _ray.kv_put(gcs, DEMAND_KEY + client_id, json.dumps(entry).encode())


def withdraw(gcs: Any, client_id: str) -> None:
    """This client waits for nothing any more."""
    _ray.kv_del(gcs, DEMAND_KEY + client_id)


def entry_shapes(raw: bytes | None, now: float) -> Shapes | None:
    """The creates one demand entry (as read from the KV: anyone in the cluster can
    write it) waits with, by GPUs; ``None`` if it is stale or does not parse."""
    try:
        entry = json.loads(raw) if raw else None
        if entry is None or not now - float(entry["at"]) <= DEMAND_TTL_S:
            return None
        count = min(MAX_WAITING, max(0, int(entry["sandboxes"])))
    except (ValueError, TypeError, KeyError, OverflowError):
        return None
    return _with_cpu(entry.get("gpus"), count)


def waiting(gcs: Any, now: float | None = None) -> Shapes:
    """The creates waiting across the cluster, by GPUs; stale entries (their client
    died) are dropped."""
    now = time.time() if now is None else now
    total: Shapes = Counter()
    for key in _ray.kv_keys(gcs, DEMAND_KEY):
        shapes = entry_shapes(_ray.kv_get(gcs, key), now)
        if shapes is None:
            _ray.kv_del(gcs, key)
        else:
            total.update(shapes)
    return total


def pending(gcs: Any, now: float | None = None) -> int:
    """How many creates wait across the cluster (:func:`waiting`, summed)."""
    return sum(waiting(gcs, now).values())


def live_shapes(info: Mapping[str, Any], live: Iterable[str]) -> Shapes:
    """A node's live sandboxes (its ``/v1/info``: ``counts`` in the ``live`` states) by
    the GPUs they hold (``gpus.holding``, the admin's view; none from a daemon before
    GPUs): the CPU ones are the rest."""
    count = max(0, sum(int(info["counts"].get(state, 0)) for state in live))
    return _with_cpu((info.get("gpus") or {}).get("holding"), count)


def _with_cpu(gpus: Any, count: int) -> Shapes:
    """``count`` sandboxes of which ``gpus`` (:func:`shapes_of`) hold GPUs."""
    out = shapes_of(gpus, count)
    out[0.0] = count - sum(out.values())
    return +out


def bundles(sandboxes: int | Mapping[float, int], resource: str = RESOURCE
            ) -> list[dict[str, float]]:
    """The constraint for ``sandboxes`` (a count, or :data:`Shapes`): one slot each,
    and each sandbox's GPUs (Ray's ``GPU``) in its slot's bundle.

    >>> bundles({0.0: 1, 2.0: 1})
    [{'corral_sandbox': 1.0}, {'corral_sandbox': 1.0, 'GPU': 2.0}]
    """
    shapes = {0.0: sandboxes} if isinstance(sandboxes, int) else sandboxes
    out: list[dict[str, float]] = []
    for amount, n in sorted(shapes.items()):
        bundle = {resource: 1.0, **({GPU: float(amount)} if amount > 0 else {})}
        out += [bundle] * max(0, n)
    return out


def ours(bundle: dict[str, float], resource: str) -> bool:
    return resource in bundle


class Demand:
    """The supervisor's side: sets the cluster's constraint to the sandboxes alive
    (``live()``, by GPUs) plus those waiting, when that changes."""

    def __init__(self, gcs: Any, live: Callable[[], Shapes], resource: str = RESOURCE) -> None:
        self.gcs = gcs
        self.live = live
        self.resource = resource
        self.requested: Shapes | None = None  # what the constraint holds now (None: unknown)

    def tick(self) -> int:
        """Bring the constraint up to date; the number of sandboxes it now asks room for."""
        wanted = +(self.live() + waiting(self.gcs))
        if wanted != self.requested:
            others = [b for b in _ray.resource_constraint(self.gcs) if not ours(b, self.resource)]
            _ray.request_resources(self.gcs, others + bundles(wanted, self.resource))
            total, before = sum(wanted.values()), sum((self.requested or {}).values())
            if total != before:
                logger.info("corral: asking Ray's autoscaler for room for %d sandboxes "
                            "(%g GPUs)", total, sum(a * n for a, n in wanted.items()))
            self.requested = wanted
        return sum(wanted.values())


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


def no_room(address: str, memory_mb: int, waited: float, gpus: int = 0) -> CapacityExceeded:
    """The error of a create that waited ``waited`` s for room on the cluster in vain."""
    shape = f"{{{RESOURCE!r}: 1" + (f", {GPU!r}: {gpus}}}" if gpus else "}")
    with_gpus = f" and {gpus} free GPU(s)" if gpus else ""
    gpu_nodes = " with GPUs (Ray's own GPU resource)" if gpus else ""
    return CapacityExceeded(
        f"no node of the Ray cluster at {address} had room for a sandbox of {memory_mb} MB"
        f"{with_gpus} within {waited:g} s (each is at its --max-sandboxes or --max-memory-mb"
        f"{', or has too few GPUs free' if gpus else ''}). The wait was shown to Ray's "
        f"autoscaler as bundles {shape}: to have it add nodes, give a node type{gpu_nodes} "
        f"resources: {{{RESOURCE!r}: N}} in its config (or the name given to `corral cluster "
        "up --resource`; docs/cluster.md); else delete sandboxes, add nodes, or wait "
        f"longer (CORRAL_PLACEMENT_WAIT); `corral cluster status --address {address}` "
        "shows each node's load",
        details={"limit": "cluster", "memory_mb": memory_mb, "waited_s": waited,
                 **({"gpus": gpus} if gpus else {})},
    )
