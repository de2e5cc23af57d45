"""How a daemon is configured: where it listens, what it guards, how much it admits.

Environment variables (read only here, by :meth:`ServerSettings.from_env`):

- ``CORRAL_SOCKET``: the Unix socket to listen on (default ``/run/corral/corral.sock``).
- ``CORRAL_TOKEN``: the bearer token TCP clients must send (no default: TCP is refused
  without one).
- ``CORRAL_PEER_TOKEN``: the cluster's peer credential, sent to other daemons and
  accepted from them on the read-only peer routes only (:mod:`corral.server.peer_auth`).
- ``CORRAL_NODE_KEY``: on a cluster, the key this node's daemon proves who it is with
  before clients send it a credential (:mod:`corral.server.node_proof`).

``CORRAL_STATE_DIR`` and ``CORRAL_CACHE_DIR`` are read by :mod:`corral.runtime.paths`
when ``state_dir`` / ``cache_dir`` are left unset.
"""

from __future__ import annotations

import ipaddress
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from corral.cluster.ids import is_node_id
from corral.errors import InvalidArgument
from corral.runtime.output_budget import OutputBudget
from corral.schema import MAX_TIMEOUT_S

DEFAULT_SOCKET = "/run/corral/corral.sock"
DEFAULT_MAX_STARTING = 8
DEFAULT_MAX_BUILDS = 2  # image builds at once, all tenants together
DEFAULT_MAX_SANDBOXES = 2000
DEFAULT_QUEUE_SIZE = 4096
DEFAULT_QUEUE_TIMEOUT_S = 120.0
DEFAULT_MAX_UPLOAD_BYTES = 256 << 20
DEFAULT_MAX_CLIENT_REQUESTS = 1024  # requests in flight per TCP client address
DEFAULT_MAX_CLIENT_CONNECTIONS = 64  # unauthenticated TCP connections per client address
DEFAULT_MAX_SESSION_STREAMS = 8  # live streams (SSE, followed logs...) per dashboard session
DEFAULT_MAX_TENANT_STREAMS = 256  # ... per tenant
MEMORY_OVERCOMMIT = 8  # default max_memory_mb = this many times the host's RAM
DEFAULT_LOG_RETENTION_S = 86400.0  # a deleted sandbox's logs are kept a day
DEFAULT_SHUTDOWN_GRACE_S = 5.0  # in-flight requests get this long to finish on SIGTERM
DEFAULT_RESTORE_GRACE_S = 300.0  # SIGTERM/crash: sandboxes wait this long for the next daemon
DEFAULT_RETENTION_S = 86400.0  # an ended sandbox's record and kept files, then removed
DEFAULT_WRITE_STALL_S = 60.0  # a TCP client that reads none of a reply this long: cut
# ... or less than this many bytes a second of it, on average over that long (1 KiB/s:
# 8 kbit/s, below any network a client really uses (a 2G GPRS link carries ~5 KB/s, a
# 9600-baud modem 1.2 KB/s) and 40 times a trickle of 1.5 KB a minute)
DEFAULT_WRITE_MIN_RATE = 1024
MEMINFO = "/proc/meminfo"


def host_memory_mb(meminfo: str = MEMINFO) -> int:
    """The host's RAM in MB (``MemTotal`` of ``/proc/meminfo``)."""
    with open(meminfo) as f:
        for line in f:
            if line.startswith("MemTotal:"):
                return int(line.split()[1]) // 1024
    raise RuntimeError(f"{meminfo} has no MemTotal line")


def default_max_memory_mb() -> int:
    """Memory that may be promised to sandboxes: limits are caps, rarely all used."""
    return MEMORY_OVERCOMMIT * host_memory_mb()


def parse_tcp(value: str) -> tuple[str, int]:
    """``HOST:PORT`` (or ``[V6]:PORT``) as ``(host, port)``; port 0 picks a free one."""
    host, sep, port = value.rpartition(":")
    host = host.strip("[]")
    if not sep or not host or not port.isdecimal() or int(port) > 65535:
        raise InvalidArgument(
            f"invalid TCP address {value!r}: use HOST:PORT, e.g. 127.0.0.1:7070 or [::1]:7070"
        )
    return host, int(port)


@dataclass(frozen=True)
class ServerSettings:
    """Everything a daemon needs to know; build it with :meth:`from_env` to honour
    the environment, or directly in tests."""

    socket: Path = Path(DEFAULT_SOCKET)
    state_dir: Path | None = None
    cache_dir: Path | None = None
    # Link the host's prepared images into cache_dir at start (a cluster node's own
    # cache, runtime/cache_seed.py), from CORRAL_CACHE_DIR or the default cache.
    seed_cache: bool = False
    tcp: tuple[str, int] | None = None
    token: str | None = field(default=None, repr=False)
    peer_token: str | None = field(default=None, repr=False)  # server/peer_auth.py
    # On a cluster: the private key this node's daemon proves itself with (CORRAL_NODE_KEY,
    # set by its node actor; server/node_proof.py, cluster/proof.py)
    node_key: str | None = field(default=None, repr=False)
    # Also serve the CoreWeave Sandbox (cwsandbox) gRPC API here (needs the token too).
    grpc: tuple[str, int] | None = None
    max_starting: int = DEFAULT_MAX_STARTING
    max_builds: int = DEFAULT_MAX_BUILDS  # image builds at once (server/builds.py)
    max_sandboxes: int = DEFAULT_MAX_SANDBOXES
    max_memory_mb: int = field(default_factory=default_max_memory_mb)
    queue_size: int = DEFAULT_QUEUE_SIZE
    queue_timeout: float = DEFAULT_QUEUE_TIMEOUT_S
    max_upload_bytes: int = DEFAULT_MAX_UPLOAD_BYTES
    max_client_requests: int = DEFAULT_MAX_CLIENT_REQUESTS
    # TCP connections held at once (None: the open-file limit less a reserve) and
    # unauthenticated ones per client address (server/conn_limits.py)
    max_connections: int | None = None
    max_client_connections: int = DEFAULT_MAX_CLIENT_CONNECTIONS
    # a TCP connection whose replies wait (its transport paused for writing) and whose
    # client reads none of them for this long is closed (server/limits.py: write stall)
    write_stall_timeout: float = DEFAULT_WRITE_STALL_S
    # ... and one whose client reads less than this many bytes a second of them, on
    # average over that long (0: any byte read is enough)
    write_min_rate: float = DEFAULT_WRITE_MIN_RATE
    # live streams one dashboard session, and one tenant, hold open (server/stream_limits.py)
    max_session_streams: int = DEFAULT_MAX_SESSION_STREAMS
    max_tenant_streams: int = DEFAULT_MAX_TENANT_STREAMS
    # commands' output held in memory at once, by the bytes held
    # (runtime/output_budget.py): in all (None: an eighth of the host's RAM) and per
    # tenant (None: half of that)
    output_memory_mb: int | None = None
    tenant_output_memory_mb: int | None = None
    allow_host_network: bool = False  # network="host" over TCP (always on the Unix socket)
    # What a revoked tenant's running sandboxes become (server/revocation.py): "stop"
    # (their records and files stay for the admin) or "keep" (running, the admin's).
    on_revoke: str = "stop"
    idle_exit: float | None = None
    shutdown_grace: float = DEFAULT_SHUTDOWN_GRACE_S
    log_level: str = "info"
    # How far ahead set_timeout / PATCH may put a sandbox's end (seconds from now).
    max_lifetime: float = MAX_TIMEOUT_S
    # How long a deleted sandbox's logs are kept (seconds; 0: dropped at the next sweep).
    log_retention: float = DEFAULT_LOG_RETENTION_S
    log_format: str = "text"  # "json": JSON lines, one per request too (server/accesslog.py)
    # Live restore (docs/restart.md): after SIGTERM or a crash the sandboxes keep running
    # this long for the next daemon on the state dir to adopt them (0: they end with it).
    restore_grace: float = DEFAULT_RESTORE_GRACE_S
    # How long an ended sandbox (stopped, failed, lost) stays listed with its kept files.
    retention: float = DEFAULT_RETENTION_S
    # The lease the SDK's sessions take by default over TCP (server/leases.py); None: none.
    default_lease: float | None = None
    metrics: bool = True  # GET /metrics (server/metrics.py); off: no listeners, a 404
    # The Ray node this daemon serves in a cluster (`corral cluster up` sets it): its
    # sandboxes' ids then name the node, and their info says which it is.
    node: str | None = None
    # Names corral's resolver answers for policy sandboxes with these addresses instead
    # of the host's resolver's (CORRAL_NETWORK_HOSTS="name=ip,name=ip"; docs/network.md)
    network_hosts: dict[str, str] = field(default_factory=dict)

    def __post_init__(self) -> None:
        for name in ("socket", "state_dir", "cache_dir"):  # accept str paths too
            value = getattr(self, name)
            if value is not None and not isinstance(value, Path):
                object.__setattr__(self, name, Path(value))
        for name in ("max_starting", "max_sandboxes", "max_memory_mb", "max_upload_bytes",
                     "max_client_requests", "max_builds", "max_client_connections",
                     "max_session_streams", "max_tenant_streams"):
            if getattr(self, name) < 1:
                raise InvalidArgument(f"{name} must be at least 1, got {getattr(self, name)}")
        for name in ("output_memory_mb", "tenant_output_memory_mb"):
            if getattr(self, name) is not None and getattr(self, name) < 1:
                raise InvalidArgument(f"{name} must be at least 1, got {getattr(self, name)}")
        if self.max_connections is not None and self.max_connections < 1:
            raise InvalidArgument(f"max_connections must be at least 1, got {self.max_connections}")
        if not 0 < self.write_stall_timeout <= 86400:
            raise InvalidArgument("write_stall_timeout must be > 0 and <= 86400 seconds, got "
                                  f"{self.write_stall_timeout:g}")
        if not 0 <= self.write_min_rate <= 1 << 30:
            raise InvalidArgument("write_min_rate must be >= 0 and <= 1 GiB a second, got "
                                  f"{self.write_min_rate:g}")
        if self.queue_size < 0 or self.queue_timeout < 0 or self.shutdown_grace < 0:
            raise InvalidArgument("queue_size, queue_timeout and shutdown_grace must be >= 0")
        if self.default_lease is not None and not 1 <= self.default_lease <= 86400:
            raise InvalidArgument(
                f"default_lease must be between 1 and 86400 seconds, got {self.default_lease:g}")
        if not 0 <= self.restore_grace <= 86400 or not self.retention >= 0:
            raise InvalidArgument(
                "restore_grace must be between 0 and 86400 seconds and retention >= 0 "
                f"(got {self.restore_grace:g} and {self.retention:g})")
        if not 0 < self.max_lifetime <= MAX_TIMEOUT_S or not 0 <= self.log_retention:
            raise InvalidArgument(
                f"max_lifetime must be > 0 and <= {MAX_TIMEOUT_S:g} s and log_retention >= 0 "
                f"(got {self.max_lifetime:g} and {self.log_retention:g})")
        if self.idle_exit is not None and self.idle_exit <= 0:
            raise InvalidArgument(f"idle_exit must be > 0 seconds, got {self.idle_exit}")
        if self.on_revoke not in ("stop", "keep"):
            raise InvalidArgument(f"--on-revoke is stop or keep, got {self.on_revoke!r}")
        if self.log_format not in ("text", "json"):
            raise InvalidArgument(f"--log-format is text or json, got {self.log_format!r}")
        if self.node is not None and not is_node_id(self.node):
            raise InvalidArgument(f"--node takes a Ray node id (hex), got {self.node!r}")
        if self.tcp is not None and not self.token:
            raise InvalidArgument(
                "listening on TCP needs a bearer token: pass --token TOKEN or set "
                "CORRAL_TOKEN (clients then send 'Authorization: Bearer TOKEN')"
            )
        if self.peer_token is not None and self.peer_token == self.token:
            raise InvalidArgument("the peer token must differ from the daemon's token")
        if self.grpc is not None and not self.token:
            raise InvalidArgument(
                "serving the cwsandbox API (--grpc) needs a token: pass --token TOKEN or "
                "set CORRAL_TOKEN (clients then set CWSANDBOX_API_KEY=TOKEN)"
            )

    def output_budget(self) -> OutputBudget:
        """The memory commands' output may take at once (runtime/output_budget.py)."""
        def size(mb: int | None) -> int | None:
            return None if mb is None else mb << 20
        return OutputBudget(size(self.output_memory_mb), size(self.tenant_output_memory_mb))

    @classmethod
    def from_env(cls, **overrides: Any) -> "ServerSettings":
        """Settings from ``CORRAL_SOCKET`` / ``CORRAL_TOKEN``, then ``overrides``
        (entries that are ``None`` are ignored, so unset CLI options fall through)."""
        base: dict[str, Any] = {"socket": Path(os.environ.get("CORRAL_SOCKET", DEFAULT_SOCKET))}
        for name in ("token", "peer_token", "node_key"):
            if os.environ.get(f"CORRAL_{name.upper()}"):
                base[name] = os.environ[f"CORRAL_{name.upper()}"]
        if os.environ.get("CORRAL_NETWORK_HOSTS"):
            base["network_hosts"] = parse_hosts(os.environ["CORRAL_NETWORK_HOSTS"])
        base.update({k: v for k, v in overrides.items() if v is not None})
        return cls(**base)


def parse_hosts(text: str) -> dict[str, str]:
    """``CORRAL_NETWORK_HOSTS``: ``name=ip`` pairs separated by commas."""
    hosts: dict[str, str] = {}
    for pair in filter(None, (p.strip() for p in text.split(","))):
        name, _, ip = pair.partition("=")
        try:
            ipaddress.IPv4Address(ip.strip())
        except ValueError:
            raise InvalidArgument(f"invalid CORRAL_NETWORK_HOSTS entry {pair!r}: use "
                                  "name=IPv4,name=IPv4") from None
        hosts[name.strip().lower()] = ip.strip()
    return hosts
