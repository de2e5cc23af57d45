"""The cluster's one tenant registry, and each node's use of its tenants' quotas, in
Ray's internal KV.

Every node's daemon reads tenants from here (:mod:`corral.server.cluster_tenants`),
so a token made through any daemon is valid on every node, on nodes that join later
and on daemons Ray restarts; the registry outlives ``corral cluster down``, as a
daemon's own registry outlives a restart.

- ``tenant:<name>``: ``{"name", "token_sha256" (hex), quotas..., "created_at"}``, or
  after a revoke a tombstone ``{"name", "revoked_at"}`` (no hash): the name is never
  given again, since ownership is by name. A revoke first adds ``tenant:<name>/revoked``
  (never overwritten; a name has no ``/``), which wins over whatever ``tenant:<name>``
  holds: an update that read the entry before the revoke and writes it back after
  cannot bring the token back (the KV has no compare-and-swap). Only the SHA-256 of a
  token is written: the token itself exists in the reply to its creation alone. A new name is claimed with
  an insert that fails if the key exists, so two concurrent creates of one name
  cannot both win.
- ``tenant-usage:<node id>``: ``{tenant: [sandboxes, memory_mb, cpus]}``, what that
  node's daemon holds for each tenant (its creates starting and its sandboxes alive);
  the daemons add them up for cluster-wide quotas (:mod:`corral.server.cluster_quotas`).
- ``capacity:<node id>``: that node's daemon's caps (``max_sandboxes``, ...), which
  ``GET /v1/cluster/nodes`` lists (nothing secret).

Blocking calls (Ray's GCS client); the daemons run them on threads.
"""

from __future__ import annotations

import json
import time
from typing import Any

from corral.cluster import _ray

TENANT_KEY = "tenant:"  # + the tenant's name
REVOKED = "/revoked"  # TENANT_KEY + name + this: the revoke's own mark, never overwritten
USAGE_KEY = "tenant-usage:"  # + a node id
CAPACITY_KEY = "capacity:"  # + a node id: its daemon's caps, for the HTTP directory
MAX_RECORD = 4096  # bytes of one entry: the KV is writable by every Ray member


def _decode(raw: bytes | None) -> dict[str, Any] | None:
    if not raw or len(raw) > MAX_RECORD:
        return None
    try:
        value = json.loads(raw)
    except ValueError:
        return None
    return value if isinstance(value, dict) else None


def add(gcs: Any, record: dict[str, Any]) -> bool:
    """Claim ``record["name"]``; False if the name is taken (alive or revoked)."""
    return _ray.kv_put(gcs, TENANT_KEY + record["name"], json.dumps(record).encode(),
                       overwrite=False)


def get(gcs: Any, name: str) -> dict[str, Any] | None:
    """A tenant's entry (a tombstone too), or None."""
    mark = _decode(_ray.kv_get(gcs, TENANT_KEY + name + REVOKED))
    return _tombstone(name, mark) if mark is not None else \
        _decode(_ray.kv_get(gcs, TENANT_KEY + name))


def _tombstone(name: str, mark: dict[str, Any]) -> dict[str, Any]:
    return {"name": name, "revoked_at": mark.get("revoked_at") or 1.0}


def replace(gcs: Any, record: dict[str, Any]) -> None:
    """Write ``record`` over its tenant's entry (new quotas; its hash unchanged)."""
    _ray.kv_put(gcs, TENANT_KEY + record["name"], json.dumps(record).encode())


def revoke(gcs: Any, name: str) -> None:
    """Replace the tenant's entry by a tombstone: no hash is left to match a token."""
    tomb = json.dumps({"name": name, "revoked_at": time.time()}).encode()
    _ray.kv_put(gcs, TENANT_KEY + name + REVOKED, tomb, overwrite=False)
    _ray.kv_put(gcs, TENANT_KEY + name, tomb)


def read_all(gcs: Any) -> dict[str, dict[str, Any]]:
    """Every entry, tombstones included, by name (two calls to the GCS)."""
    found = _multi(gcs, TENANT_KEY)
    entries = {name: entry for name, entry in found.items() if entry.get("name") == name}
    for key, mark in found.items():
        name = key.removesuffix(REVOKED)
        if name != key and mark.get("name") == name:  # revoked, whatever tenant:<name> says
            entries[name] = _tombstone(name, mark)
    return entries


def is_alive(entry: dict[str, Any]) -> bool:
    """Whether an entry is a tenant (not a tombstone)."""
    return not entry.get("revoked_at") and isinstance(entry.get("token_sha256"), str)


def publish_usage(gcs: Any, node_id: str, usage: dict[str, list[float]]) -> None:
    """This node's use of each tenant's quotas (it replaces what the node wrote last)."""
    _ray.kv_put(gcs, USAGE_KEY + node_id, json.dumps(usage).encode())


def drop_usage(gcs: Any, node_id: str) -> None:
    """Forget the book of a node Ray marks dead (its sandboxes died with it)."""
    _ray.kv_del(gcs, USAGE_KEY + node_id)


def read_usage(gcs: Any) -> dict[str, dict[str, list[float]]]:
    """``{node id: {tenant: [sandboxes, memory_mb, cpus]}}`` as every node last wrote it."""
    return _multi(gcs, USAGE_KEY, limit=1 << 20)


def publish_capacity(gcs: Any, node_id: str, capacity: dict[str, Any]) -> None:
    _ray.kv_put(gcs, CAPACITY_KEY + node_id, json.dumps(capacity).encode())


def read_capacities(gcs: Any) -> dict[str, dict[str, Any]]:
    """``{node id: capacity}`` as each node's daemon wrote it at start."""
    return _multi(gcs, CAPACITY_KEY)


def _multi(gcs: Any, prefix: str, limit: int = MAX_RECORD) -> dict[str, Any]:
    keys = _ray.kv_keys(gcs, prefix)
    if not keys:
        return {}
    raw = gcs.internal_kv_multi_get([k.encode() for k in keys], _ray.NAMESPACE.encode(),
                                    timeout=_ray.GCS_TIMEOUT_S)
    out = {}
    for key, value in raw.items():
        name = (key.decode() if isinstance(key, bytes) else str(key))[len(prefix):]
        if value and len(value) <= limit:
            try:
                decoded = json.loads(value)
            except ValueError:
                continue
            if isinstance(decoded, dict):
                out[name] = decoded
    return out
