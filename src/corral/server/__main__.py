"""``python -m corral.server``: run a daemon (``corral serve`` calls the same :func:`serve`).

Environment variables: ``CORRAL_SOCKET`` and ``CORRAL_TOKEN`` (read in
:mod:`corral.server.settings`), ``CORRAL_STATE_DIR`` and ``CORRAL_CACHE_DIR`` (read in
:mod:`corral.runtime.paths`). Options given on the command line win.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence
from pathlib import Path

from corral.errors import CorralError
from corral.server.daemon import serve
from corral.server.settings import (
    DEFAULT_MAX_BUILDS,
    DEFAULT_MAX_CLIENT_CONNECTIONS,
    DEFAULT_MAX_CLIENT_REQUESTS,
    DEFAULT_MAX_SANDBOXES,
    DEFAULT_MAX_SESSION_STREAMS,
    DEFAULT_MAX_STARTING,
    DEFAULT_MAX_TENANT_STREAMS,
    DEFAULT_MAX_UPLOAD_BYTES,
    DEFAULT_QUEUE_SIZE,
    DEFAULT_QUEUE_TIMEOUT_S,
    DEFAULT_SHUTDOWN_GRACE_S,
    DEFAULT_WRITE_MIN_RATE,
    DEFAULT_WRITE_STALL_S,
    MEMORY_OVERCOMMIT,
    ServerSettings,
    parse_tcp,
)

# Options besides --socket/--state-dir/--cache-dir/--tcp/--token/--log-level: each sets
# the ServerSettings field of the same name.
_TUNING: tuple[tuple[str, type, str, str], ...] = (
    ("--max-starting", int, "N", f"sandboxes starting at once (default {DEFAULT_MAX_STARTING})"),
    ("--max-sandboxes", int, "N", f"sandboxes alive at once (default {DEFAULT_MAX_SANDBOXES})"),
    ("--max-builds", int, "N", f"image builds at once (default {DEFAULT_MAX_BUILDS})"),
    (
        "--max-memory-mb",
        int,
        "N",
        f"memory promised to live sandboxes (default {MEMORY_OVERCOMMIT}x the host's RAM)",
    ),
    ("--queue-size", int, "N", f"creates that may wait for room (default {DEFAULT_QUEUE_SIZE})"),
    (
        "--queue-timeout",
        float,
        "SECONDS",
        f"how long a create may wait (default {DEFAULT_QUEUE_TIMEOUT_S:g})",
    ),
    (
        "--max-upload-bytes",
        int,
        "N",
        f"largest upload, download or JSON body (default {DEFAULT_MAX_UPLOAD_BYTES})",
    ),
    (
        "--max-client-requests",
        int,
        "N",
        "requests one TCP client address may have in flight; more get 429 "
        f"(default {DEFAULT_MAX_CLIENT_REQUESTS})",
    ),
    (
        "--max-connections",
        int,
        "N",
        "TCP connections held at once; past it idle ones are closed, then new ones refused "
        "(default: the open-file limit less a reserve)",
    ),
    (
        "--max-client-connections",
        int,
        "N",
        "connections one TCP client address may hold before any of them authenticated "
        f"(default {DEFAULT_MAX_CLIENT_CONNECTIONS})",
    ),
    (
        "--max-session-streams",
        int,
        "N",
        "live streams (events, followed logs, streamed commands) one dashboard session may "
        f"hold open (default {DEFAULT_MAX_SESSION_STREAMS})",
    ),
    (
        "--max-tenant-streams",
        int,
        "N",
        f"live streams one tenant may hold open (default {DEFAULT_MAX_TENANT_STREAMS})",
    ),
    (
        "--output-memory-mb",
        int,
        "MB",
        "memory for commands' output held at once (the bytes held), all tenants together; "
        "past it a command's cap is lowered mid-stream, and one that cannot get even 64 "
        "KiB per stream is refused 429 (default: an eighth of the RAM or of the daemon's "
        "cgroup memory limit)",
    ),
    (
        "--tenant-output-memory-mb",
        int,
        "MB",
        "the same, per tenant (default: half of --output-memory-mb)",
    ),
    (
        "--write-stall-timeout",
        float,
        "SECONDS",
        "close a connection whose client has read none of its reply for this long "
        f"while the reply waits (default {DEFAULT_WRITE_STALL_S:g})",
    ),
    (
        "--write-min-rate",
        float,
        "BYTES",
        "... or, on average over --write-stall-timeout, fewer than this many bytes a "
        f"second of it (default {DEFAULT_WRITE_MIN_RATE}; 0: any byte read is enough)",
    ),
    (
        "--idle-exit",
        float,
        "SECONDS",
        "exit after this long with no requests and no live sandboxes",
    ),
    (
        "--max-lifetime",
        float,
        "SECONDS",
        "the furthest ahead set_timeout (PATCH /v1/sandboxes/ID) may put a sandbox's end "
        "(default: 30 days)",
    ),
    (
        "--log-retention",
        float,
        "SECONDS",
        "how long a deleted sandbox's command and lifecycle log is kept (default 86400)",
    ),
    (
        "--restore-grace",
        float,
        "SECONDS",
        "live restore: after SIGTERM or a crash, how long the sandboxes keep running for "
        "the next daemon on this state dir to adopt them (default 300; 0: they end with "
        "the daemon; SIGINT always stops them)",
    ),
    (
        "--retention",
        float,
        "SECONDS",
        "how long an ended sandbox stays listed (and its kept files on disk) before it is "
        "removed (default 86400)",
    ),
    (
        "--default-lease",
        float,
        "SECONDS",
        "the lease the SDK's sessions over TCP take by default: their sandboxes end this "
        "long after the client stops renewing it (its process died); default: none",
    ),
    (
        "--shutdown-grace",
        float,
        "SECONDS",
        "on SIGTERM, how long in-flight requests may run before sandboxes are stopped "
        f"(default {DEFAULT_SHUTDOWN_GRACE_S:g})",
    ),
)


def build_parser(prog: str = "python -m corral.server") -> argparse.ArgumentParser:
    """The daemon's command line (reused by ``corral serve``)."""
    p = argparse.ArgumentParser(prog=prog, description="Run the corral sandbox daemon.")
    p.add_argument(
        "--socket",
        type=Path,
        help="Unix socket to listen on, mode 0600, no token needed "
        "(env CORRAL_SOCKET, default /run/corral/corral.sock)",
    )
    p.add_argument(
        "--state-dir",
        type=Path,
        help="registry and sandbox mounts (env CORRAL_STATE_DIR, default /var/lib/corral)",
    )
    p.add_argument(
        "--cache-dir",
        type=Path,
        help="images and the agent binary (env CORRAL_CACHE_DIR, default /var/cache/corral)",
    )
    p.add_argument(
        "--seed-cache", action="store_true", default=None,
        help="link the host's prepared images (the default cache's) into --cache-dir where "
        "it lacks them: a cache of its own, with nothing to build (a local cluster's node)",
    )
    p.add_argument(
        "--tcp", metavar="HOST:PORT", help="also listen on TCP, where a bearer token is required"
    )
    p.add_argument("--token", help="the bearer token for TCP clients (env CORRAL_TOKEN)")
    p.add_argument(
        "--grpc",
        metavar="HOST:PORT",
        help="also serve the CoreWeave Sandbox (cwsandbox) gRPC API there, for unmodified "
        "cwsandbox scripts (needs --token; pip install 'corral[compat]')",
    )
    for flag, kind, metavar, text in _TUNING:
        p.add_argument(flag, type=kind, metavar=metavar, help=text)
    p.add_argument(
        "--allow-host-network", action="store_true", default=None,
        help="let TCP clients create sandboxes with network='host' (the host's network); "
        "the Unix socket always may",
    )
    p.add_argument(
        "--on-revoke", choices=("stop", "keep"), default=None,
        help="what a revoked tenant's running sandboxes become: stop (default: what the "
        "revoked token started ends; records and files stay for the admin) or keep",
    )
    p.add_argument("--log-level", default="info", help="debug, info, warning or error")
    p.add_argument(
        "--log-format", choices=("text", "json"), default="text",
        help="json: every log record as a JSON line, and one line per request (tenant, "
        "route, status, duration_ms)",
    )
    p.add_argument(
        "--no-metrics", dest="metrics", action="store_false", default=None,
        help="do not serve GET /metrics (Prometheus) nor count for it",
    )
    p.add_argument(
        "--node", metavar="NODE_ID",
        help="the Ray node this daemon serves (set by `corral cluster up`): sandbox ids "
        "then name the node",
    )
    return p


def settings_from_args(args: argparse.Namespace) -> ServerSettings:
    """Settings from parsed options, falling back to the environment and defaults."""
    options = dict(vars(args))  # every option's dest is a ServerSettings field
    options["tcp"] = parse_tcp(args.tcp) if args.tcp else None
    options["grpc"] = parse_tcp(args.grpc) if getattr(args, "grpc", None) else None
    return ServerSettings.from_env(**options)


def main(argv: Sequence[str] | None = None) -> int:
    """Parse ``argv``, run the daemon until it is told to stop, return the exit status."""
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        serve(settings_from_args(args))
    except CorralError as exc:
        print(f"corral daemon: {exc.message}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        return 130
    return 0


if __name__ == "__main__":
    sys.exit(main())
