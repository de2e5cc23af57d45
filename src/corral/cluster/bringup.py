"""``corral cluster up | status | down``: a corral daemon on every node of a Ray cluster.

``up`` starts the :class:`~corral.cluster.node.Supervisor` and waits until every alive
node's daemon answers; each node actor makes its daemon's own token, kept in Ray's
internal KV (:mod:`corral.cluster.auth`: on a cluster without Ray's token
authentication anyone who reaches the GCS port reads them, and :func:`up`'s caller is
warned). Running it again changes nothing. ``down`` stops every daemon (each stops its
sandboxes) and forgets the tokens. ``status`` reads the directory and asks each daemon
for its load.
"""

from __future__ import annotations

import contextlib
import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx

from corral.api.operations import url as api_url
from corral.cluster import _ray, auth, autoscale, proof
from corral.cluster.directory import NODE_KEY
from corral.cluster.ids import node_tag
from corral.cluster.node import (
    CONFIG_KEY,
    NODE_ACTOR,
    SUPERVISOR,
    remove_node_dir,
    supervisor_actor,
)
from corral.cluster.tenant_registry import CAPACITY_KEY, USAGE_KEY
from corral.errors import DaemonUnavailable, InvalidArgument

DEFAULT_STATE_DIR = "/var/lib/corral/cluster"
"""Where each node's daemon keeps its state: ``<this>/<node tag>/`` on that node."""
STATUS_TIMEOUT_S = 5.0
UP_ERROR_CHARS = 1500  # of a failed start's cause (the end of the daemon's log)


@contextlib.contextmanager
def joined(address: str) -> Iterator[Any]:
    """This process as a driver of the cluster at ``address`` (the ``ray`` module), for
    as long as the block runs; a process that already is one stays one."""
    r = _ray.ray()
    if r.is_initialized():
        yield r
        return
    gcs_address = _ray.resolve(address)
    _ray.gcs(gcs_address)  # a clear error, not Ray's retries, if nothing answers there
    r.init(address=gcs_address, namespace=_ray.NAMESPACE, logging_level="WARNING",
           log_to_driver=False)
    try:
        yield r
    finally:
        r.shutdown()


def up(
    address: str,
    *,
    state_dir: str = DEFAULT_STATE_DIR,
    cache_dir: str | None = None,
    daemon_args: list[str] | None = None,
    resource: str = autoscale.RESOURCE,
) -> list[dict[str, Any]]:
    """Start a daemon on every alive node (and, through the supervisor, on nodes that join
    later); return the nodes' directory entries. Idempotent. If a daemon cannot start,
    everything started is stopped again and :class:`DaemonUnavailable` says why.
    ``resource`` names the Ray resource of a sandbox slot that sandboxes no node has
    room for are shown to Ray's autoscaler as (:mod:`corral.cluster.autoscale`)."""
    if not state_dir.startswith("/"):
        raise InvalidArgument(f"--state-dir must be an absolute path, got {state_dir!r}")
    if not resource or not resource.replace("_", "").isalnum():
        raise InvalidArgument(
            f"--resource must be a Ray resource name (letters, digits, _), got {resource!r}")
    config = {"state_dir": state_dir, "cache_dir": cache_dir, "daemon_args": daemon_args or [],
              "resource": resource}
    with joined(address) as r:
        gcs = _ray.gcs(r.get_runtime_context().gcs_address)
        auth.peer_token(gcs)
        _ray.kv_put(gcs, CONFIG_KEY, json.dumps(config).encode(), overwrite=False)
        stored = json.loads(_ray.kv_get(gcs, CONFIG_KEY) or b"{}")
        supervisor = supervisor_actor(stored)
        try:
            entries = r.get(supervisor.ensure.remote())
        except Exception as exc:  # a daemon failed to start (Ray wraps its error)
            _stop_all(r, gcs)
            cause = str(exc).strip()[-UP_ERROR_CHARS:]
            raise DaemonUnavailable(
                f"the corral daemons could not start, so none was left running: {cause}\n"
                f"(each node's log: {stored['state_dir']}/<node>/daemon.log; corral must be "
                "installed on every node and the daemons run as root)"
            ) from None
        return sorted(entries, key=lambda e: e["node_id"])


def down(address: str) -> int:
    """Stop every node's daemon and its sandboxes, the supervisor, and forget the token;
    how many daemons were stopped. Idempotent."""
    with joined(address) as r:
        return _stop_all(r, _ray.gcs(r.get_runtime_context().gcs_address))


def _stop_all(r: Any, gcs: Any) -> int:
    stopped = 0
    config = json.loads(_ray.kv_get(gcs, CONFIG_KEY) or b"{}")
    entries = read_entries(gcs)
    try:
        supervisor = r.get_actor(SUPERVISOR, namespace=_ray.NAMESPACE)
    except ValueError:
        supervisor = None
    if supervisor is not None:
        try:
            stopped = r.get(supervisor.stop.remote())
        except Exception:  # Ray restarts it (its node died): stop the daemons from here
            stopped = -1
        r.kill(supervisor, no_restart=True)
    if supervisor is None or stopped < 0:  # no supervisor (killed by hand?): daemons may remain
        stopped = 0
        for node_id, state in _ray.node_states(gcs).items():
            try:
                actor = r.get_actor(NODE_ACTOR + node_id, namespace=_ray.NAMESPACE)
            except ValueError:
                continue
            if state["alive"]:
                with contextlib.suppress(Exception):  # it restarts: killed below, its
                    stopped += r.get(actor.shutdown.remote()) is not None  # daemon follows
            r.kill(actor, no_restart=True)
    for prefix in (NODE_KEY, USAGE_KEY, CAPACITY_KEY):  # per-node keys: none outlives it
        for key in _ray.kv_keys(gcs, prefix):
            _ray.kv_del(gcs, key)
    _remove_node_dirs(config, entries, _ray.node_states(gcs))
    autoscale.clear(gcs, config.get("resource") or autoscale.RESOURCE)
    _ray.kv_del(gcs, CONFIG_KEY)
    auth.forget(gcs)
    return stopped


def _remove_node_dirs(config: dict[str, Any], entries: dict[str, dict[str, Any]],
                      nodes: dict[str, Any]) -> None:
    """The directories of nodes whose actor could not remove its own (a dead node's, a
    daemon's that failed to start), those on this host (a local cluster's), within the
    cluster's state directory only."""
    root = config.get("state_dir")
    if not root:
        return
    bases = {Path(e["state_dir"]) for e in entries.values() if e.get("state_dir")}
    bases |= {Path(root) / node_tag(node_id) for node_id in nodes}
    for base in bases:
        if base.is_relative_to(Path(root)) and base != Path(root) and base.is_dir():
            remove_node_dir(base)


def status(address: str) -> dict[str, Any]:
    """``{"nodes": [{"node_id", "address", "alive", "daemon", "sandboxes", "capacity",
    ...}], "autoscaler": {"resource", "waiting", "requested"}, "gcs_authenticated"}``:
    every node Ray knows (dead ones too), with its daemon's load; the creates waiting for
    room, and the sandbox slots Ray's autoscaler is asked for; whether Ray's GCS refuses
    clients without its token (:mod:`corral.cluster.auth`)."""
    gcs_address = _ray.resolve(address)
    gcs = _ray.gcs(gcs_address)
    tokens = auth.node_tokens(gcs)
    entries = read_entries(gcs)
    nodes = []
    states = _ray.node_states(gcs)
    alive = [e for n, e in entries.items() if states.get(n, {}).get("alive")]
    # each daemon proves who it is before its token is sent (cluster/proof.py)
    with proof.proven_client(proof.pins_of(alive), timeout=STATUS_TIMEOUT_S) as http:
        for node_id, state in sorted(states.items()):
            entry = entries.get(node_id)
            row: dict[str, Any] = {
                "node_id": node_id, "address": state["address"], "alive": state["alive"],
                "daemon": entry["url"] if entry and state["alive"] else None,
                "sandboxes": None, "capacity": None,
            }
            if row["daemon"]:
                try:
                    info = http.get(row["daemon"] + api_url("info"), headers={
                        "Authorization": f"Bearer {tokens.get(node_id, '')}"},
                    ).raise_for_status().json()
                except httpx.HTTPError as exc:
                    row["error"] = f"the daemon does not answer: {type(exc).__name__}: {exc}"
                else:
                    counts = info["counts"]
                    row.update(
                        sandboxes=counts.get("running", 0) + counts.get("paused", 0)
                        + counts.get("pending", 0),
                        capacity=info["capacity"],
                        committed_memory_mb=info["committed_memory_mb"],
                        starting=info["starting"], queued=info["queued"],
                    )
            nodes.append(row)
    resource = json.loads(_ray.kv_get(gcs, CONFIG_KEY) or b"{}").get("resource") or (
        autoscale.RESOURCE)
    demand = {"resource": resource, "waiting": autoscale.pending(gcs),
              "requested": autoscale.count(_ray.resource_constraint(gcs), resource)}
    return {"nodes": nodes, "autoscaler": demand,
            "gcs_authenticated": _ray.gcs_authenticated(gcs_address)}


def open_warning(address: str) -> str | None:
    """A one-line warning if the Ray cluster at ``address`` lets anyone who reaches its
    GCS read corral's tokens (no Ray token authentication), else None."""
    return auth.open_warning(_ray.resolve(address))


def read_entries(gcs: Any) -> dict[str, dict[str, Any]]:
    """The directory: ``{node_id: entry}`` of every node whose daemon registered."""
    entries = {}
    for key in _ray.kv_keys(gcs, NODE_KEY):
        raw = _ray.kv_get(gcs, key)
        if raw:
            entry = json.loads(raw)
            entries[entry["node_id"]] = entry
    return entries
