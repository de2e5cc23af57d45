"""What runs on the cluster: a daemon per node, and the supervisor that keeps one there.

- :class:`NodeDaemon` — a Ray actor pinned to one node (node affinity, not soft), that
  owns a ``python -m corral.server`` child listening on the node's address with its
  own state directory (so its own cgroup parent), socket and port. It writes the
  node's entry (``node:<node_id>``: its URL) into the directory (Ray's internal KV)
  once the daemon answers. If the daemon exits, the actor exits too and Ray restarts
  it (``max_restarts=-1``): the new daemon reconciles the state directory as after any
  crash. If the actor dies, the daemon follows (``PR_SET_PDEATHSIG``): it stops its
  sandboxes and exits.
- :class:`Supervisor` — one detached actor that starts a :class:`NodeDaemon` on every
  alive node, now and on nodes that join later (it looks every
  :data:`WATCH_INTERVAL_S`), and shows Ray's autoscaler the sandboxes no node has room
  for (:mod:`corral.cluster.autoscale`).

Each node actor makes (or, restarted, reads again) its daemon's own admin token and
reads the cluster's peer credential from the KV (:mod:`corral.cluster.auth`); they
travel in the daemon's environment, never on a command line or in a log.
"""

from __future__ import annotations

import contextlib
import ctypes
import fcntl
import json
import logging
import os
import shutil
import signal
import socket
import subprocess
import sys
import threading
import time
from collections import Counter
from pathlib import Path
from typing import Any

import httpx

from corral.api.operations import url as api_url
from corral.cluster import _ray, auth, autoscale, proof
from corral.cluster.directory import NODE_KEY
from corral.cluster.ids import node_tag
from corral.cluster.placement import LIVE
from corral.errors import DaemonUnavailable

logger = logging.getLogger("corral.cluster")

SUPERVISOR = "corral-supervisor"
NODE_ACTOR = "corral-node-"  # + the node id
CONFIG_KEY = "config"
WATCH_INTERVAL_S = 2.0
DAEMON_START_TIMEOUT_S = 180.0  # a loaded host (load 35+) started 3 daemons past 60 s; one that exits fails at once
DAEMON_STOP_TIMEOUT_S = 60.0
INFO_TIMEOUT_S = 5.0
_PR_SET_PDEATHSIG = 1


def _die_with_parent() -> None:  # pragma: no cover - runs in the child before exec
    """The daemon gets SIGTERM (and stops its sandboxes) when its actor dies."""
    libc = ctypes.CDLL(None, use_errno=True)
    libc.prctl(_PR_SET_PDEATHSIG, signal.SIGTERM, 0, 0, 0)


def _free_port(host: str) -> int:
    with socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET) as s:
        s.bind((host, 0))
        return s.getsockname()[1]


def _answers(host: str, port: int) -> bool:
    with contextlib.suppress(OSError), socket.create_connection((host, port), timeout=1):
        return True
    return False


class NodeDaemon:
    """The corral daemon of one node (wrapped by ``ray.remote`` in :func:`node_actor`)."""

    def __init__(self, config: dict[str, Any]) -> None:
        r = _ray.ray()
        self.node_id = r.get_runtime_context().get_node_id()
        self.host = r.util.get_node_ip_address()
        gcs = _ray.gcs(r.get_runtime_context().gcs_address)
        self._gcs = gcs
        base = Path(config["state_dir"]) / node_tag(self.node_id)
        base.mkdir(parents=True, exist_ok=True)
        os.chmod(base, 0o711)  # sandboxes (an unprivileged uid) traverse it to their root
        self.port = int(config.get("port") or 0) or _free_port(self.host)
        self.url = f"http://{self.host}:{self.port}" if ":" not in self.host else (
            f"http://[{self.host}]:{self.port}")
        argv = [
            sys.executable, "-m", "corral.server",
            "--socket", str(base / "corral.sock"), "--state-dir", str(base / "state"),
            "--tcp", f"{self.host}:{self.port}", "--node", self.node_id,
            # {node}: a cache of its own per node; by default one of its own seeded from
            # the host's prepared images (runtime/cache_seed.py), never the host's cache
            *(["--cache-dir", config["cache_dir"].replace("{node}", node_tag(self.node_id))]
              if config.get("cache_dir") else ["--cache-dir", str(base / "cache"), "--seed-cache"]),
            *config.get("daemon_args", []),
        ]
        private, self.key = proof.make_key()  # a new pair per start (cluster/proof.py)
        env = {**os.environ, "CORRAL_TOKEN": auth.node_token(gcs, self.node_id),
               proof.KEY_ENV: private,
               "CORRAL_PEER_TOKEN": auth.peer_token(gcs), "PYTHONUNBUFFERED": "1",
               "CORRAL_RAY_GCS": r.get_runtime_context().gcs_address}  # its peers' directory
        self._stopping = False
        with open(base / "daemon.log", "ab") as log:
            self.proc = subprocess.Popen(
                argv, stdin=subprocess.DEVNULL, stdout=log, stderr=subprocess.STDOUT, env=env,
                preexec_fn=_die_with_parent,
            )
        self._wait_until_listening(base / "daemon.log")
        self.entry = {
            "node_id": self.node_id, "tag": node_tag(self.node_id), "url": self.url,
            "pid": self.proc.pid, "state_dir": str(base), "started_at": time.time(),
            "key": self.key,  # what its daemon proves itself with
        }
        _ray.kv_put(gcs, NODE_KEY + self.node_id, json.dumps(self.entry).encode())
        threading.Thread(target=self._watch, name="corral-daemon-watch", daemon=True).start()

    def _wait_until_listening(self, log: Path) -> None:
        deadline = time.monotonic() + DAEMON_START_TIMEOUT_S
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                tail = log.read_text(errors="replace")[-2000:]
                raise DaemonUnavailable(
                    f"the corral daemon on node {self.node_id} exited with "
                    f"{self.proc.returncode} at start; its log ({log}) ends:\n{tail}"
                )
            if _answers(self.host, self.port):
                return
            time.sleep(0.05)
        self.proc.kill()
        raise DaemonUnavailable(f"the corral daemon on node {self.node_id} did not listen in time")

    def _watch(self) -> None:
        """A daemon that exits unasked takes the actor with it, so Ray restarts both."""
        self.proc.wait()
        if not self._stopping:
            logger.error("corral daemon on node %s exited with %s: restarting",
                         self.node_id, self.proc.returncode)
            os._exit(1)

    def info(self) -> dict[str, Any]:
        """The node's directory entry."""
        return self.entry

    def shutdown(self) -> int | None:
        """Stop the daemon (it stops its sandboxes), drop the node's entry and remove
        its directory (state, snapshots, log: ``cluster down`` leaves nothing); the exit
        status, or None if it had to be killed."""
        self._stopping = True
        with contextlib.suppress(Exception):
            _ray.kv_del(self._gcs, NODE_KEY + self.node_id)
        status = self.proc.returncode
        if self.proc.poll() is None:
            # SIGINT: the daemon stops its sandboxes (SIGTERM hands them over to a next one)
            self.proc.send_signal(signal.SIGINT)
            try:
                status = self.proc.wait(DAEMON_STOP_TIMEOUT_S)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
                status = None
        remove_node_dir(Path(self.entry["state_dir"]))
        return status


def remove_node_dir(base: Path) -> None:
    """Remove a node's directory once its daemon is gone. A daemon that had to be
    killed leaves its cleanup to its warden, which holds the state's lock until it is
    done: wait for that (bounded) so nothing is removed under it."""
    lock = base / "state" / "engine.lock"
    with contextlib.suppress(OSError), open(lock, "a+") as f:
        deadline = time.monotonic() + DAEMON_STOP_TIMEOUT_S
        while time.monotonic() < deadline:
            try:
                fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)
                break
            except BlockingIOError:
                time.sleep(0.05)
    shutil.rmtree(base, ignore_errors=True)


def node_actor(node_id: str, config: dict[str, Any]) -> Any:
    """The :class:`NodeDaemon` actor of ``node_id``, started if it is not running."""
    r = _ray.ray()
    from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

    cls = r.remote(NodeDaemon)
    return cls.options(
        name=NODE_ACTOR + node_id, namespace=_ray.NAMESPACE, lifetime="detached",
        get_if_exists=True, max_restarts=-1, num_cpus=0,
        scheduling_strategy=NodeAffinitySchedulingStrategy(node_id, soft=False),
    ).remote(config)


class Supervisor:
    """Keeps a :class:`NodeDaemon` on every alive node (wrapped by ``ray.remote``)."""

    def __init__(self, config: dict[str, Any]) -> None:
        self.config = config
        self._actors: dict[str, Any] = {}
        self._gcs = _ray.gcs(_ray.ray().get_runtime_context().gcs_address)
        self._demand = autoscale.Demand(self._gcs, self._live_sandboxes,
                                        config.get("resource") or autoscale.RESOURCE)
        self._stop = threading.Event()
        self._lock = threading.Lock()
        threading.Thread(target=self._watch, name="corral-supervisor", daemon=True).start()

    def _alive_nodes(self) -> list[str]:
        return sorted(n["NodeID"] for n in _ray.ray().nodes() if n["Alive"])

    def _start_missing(self) -> dict[str, Any]:
        with self._lock:
            alive = self._alive_nodes()
            for node_id in alive:
                if node_id not in self._actors:
                    self._actors[node_id] = node_actor(node_id, self.config)
            for node_id in list(self._actors):
                if node_id not in alive:  # the node died: its actor is gone with it
                    del self._actors[node_id]
            return dict(self._actors)

    def _watch(self) -> None:
        while not self._stop.wait(WATCH_INTERVAL_S):
            try:
                self._start_missing()
                self._demand.tick()
            except Exception:  # a GCS hiccup: look again next time
                logger.exception("corral supervisor: could not check the nodes")

    def _live_sandboxes(self) -> autoscale.Shapes:
        """Sandboxes alive or starting on every node, by the GPUs they hold, as their
        daemons count them."""
        tokens = auth.node_tokens(self._gcs)
        entries = [json.loads(raw) for key in _ray.kv_keys(self._gcs, NODE_KEY)
                   if (raw := _ray.kv_get(self._gcs, key))]
        total: autoscale.Shapes = Counter()
        # each daemon proves who it is before its token is sent (cluster/proof.py)
        with proof.proven_client(proof.pins_of(entries), timeout=INFO_TIMEOUT_S) as http:
            for entry in entries:
                bearer = {"Authorization": f"Bearer {tokens.get(entry['node_id'], '')}"}
                try:
                    info = http.get(entry["url"] + api_url("info"), headers=bearer
                                    ).raise_for_status().json()
                except httpx.HTTPError:  # a node that just died or restarts: not counted
                    continue
                total.update(autoscale.live_shapes(info, LIVE))
        return total

    def ensure(self, timeout: float = DAEMON_START_TIMEOUT_S) -> list[dict[str, Any]]:
        """Start the missing daemons and wait for every alive node's; their entries."""
        actors = self._start_missing()
        r = _ray.ray()
        return r.get([a.info.remote() for a in actors.values()], timeout=timeout)

    def demand(self) -> int:
        """Bring the autoscaler's constraint up to date now; the sandboxes it asks for."""
        return self._demand.tick()

    def stop(self, timeout: float = DAEMON_STOP_TIMEOUT_S) -> int:
        """Stop watching, then stop every node's daemon; how many were stopped."""
        self._stop.set()
        r = _ray.ray()
        with self._lock:
            actors = dict(self._actors)
            self._actors.clear()
        for node_id in self._alive_nodes():  # also daemons an earlier supervisor started
            if node_id not in actors:
                with contextlib.suppress(ValueError):
                    actors[node_id] = r.get_actor(NODE_ACTOR + node_id, namespace=_ray.NAMESPACE)
        stopped = 0
        for actor in actors.values():
            try:
                r.get(actor.shutdown.remote(), timeout=timeout)
                stopped += 1
            except Exception:  # its node died meanwhile: nothing left to stop there
                pass
            r.kill(actor, no_restart=True)
        return stopped


def supervisor_actor(config: dict[str, Any]) -> Any:
    """The cluster's :class:`Supervisor`, started if it is not running."""
    r = _ray.ray()
    return r.remote(Supervisor).options(
        name=SUPERVISOR, namespace=_ray.NAMESPACE, lifetime="detached", get_if_exists=True,
        max_restarts=-1, max_concurrency=4, num_cpus=0,
    ).remote(config)
