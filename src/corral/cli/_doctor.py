"""``corral doctor``: is this machine ready to run corral, and is its daemon well?

The host's checks are :mod:`corral.runtime.doctor`'s; the daemon's (health, version)
is asked here, without starting a daemon when none answers. The state and cache
directories checked are the running daemon's (``GET /v1/info`` tells its admin), unless
``--state-dir`` / ``--cache-dir`` name others, or no daemon answers (then the
defaults). Exit status 1 when a check FAILs (a WARN does not).
"""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import Any

import corral
from corral.cli._output import Context
from corral.client._config import Endpoint
from corral.client._embed import answers


def add_parser(sub: Any, conn: list[argparse.ArgumentParser]) -> None:
    p = sub.add_parser(
        "doctor", parents=conn, help="check this machine and the daemon; say how to fix what fails",
        description="Kernel features (user namespaces, overlayfs, cgroups, seccomp), "
        "bubblewrap, the agent, images, free disk and memory, and the daemon's health and "
        "version. Exits 1 if a check fails.",
    )
    p.add_argument("--state-dir", type=Path, help="the daemon's state dir (env CORRAL_STATE_DIR)")
    p.add_argument("--cache-dir", type=Path, help="the daemon's cache dir (env CORRAL_CACHE_DIR)")
    p.add_argument("--json", action="store_true", help="print the checks as a JSON list")
    p.set_defaults(handler=doctor)


def _daemon(ctx: Context) -> tuple[Any, dict[str, Any]]:
    """The daemon's check, and its ``/v1/info`` (empty if none answers)."""
    from corral.runtime.doctor import FAIL, OK, WARN, Check

    endpoint = Endpoint.resolve(ctx.url)
    if endpoint.cluster:
        return _cluster(endpoint.url, endpoint.cluster), {}
    if endpoint.uds is not None and not answers(endpoint.uds):  # never start one here
        return Check("daemon", WARN, f"no daemon answers on {endpoint.uds}",
                     "corral serve (or the systemd unit); the SDK starts one on first use"), {}
    try:
        health = ctx.client.health()
        info = ctx.client.info()
    except corral.CorralError as exc:
        return Check("daemon", FAIL, f"{endpoint.url}: {exc.message}",
                     "look at the daemon's log; restart it (corral daemon restart)"), {}
    status = OK if health.get("status") == "ok" else FAIL
    version = info.get("version")
    detail = f"{endpoint.url}: {health.get('status')}, version {version}"
    if info.get("state_dir"):
        detail += f", state {info['state_dir']}"
    if status == OK and version != corral.__version__:
        return Check("daemon", WARN, f"{detail} (this CLI is {corral.__version__})",
                     "restart the daemon after upgrading corral: corral daemon restart "
                     "(its sandboxes keep running)"), info
    return Check("daemon", status, detail), info


def _cluster(url: str, address: str) -> Any:
    """A Ray cluster (``CORRAL_URL=ray://``): does its GCS authenticate its clients?"""
    from corral.runtime.doctor import FAIL, OK, WARN, Check

    try:
        from corral.cluster import bringup

        warning = bringup.open_warning(address)
        bringup.status(address)  # this client may read it (Ray's token, if it needs one)
    except corral.CorralError as exc:
        return Check("cluster", FAIL, f"{url}: {exc.message}")
    if warning:
        return Check("cluster", WARN, warning.removeprefix("warning: "),
                     "RAY_AUTH_MODE=token on every node (see docs/cluster.md); "
                     "run doctor on each node for its host checks")
    return Check("cluster", OK, f"{url}: Ray's token authentication is on "
                 "(run doctor on each node for its host checks)")


def doctor(args: argparse.Namespace, ctx: Context) -> int:
    from corral.runtime.doctor import FAIL, run_checks

    daemon, info = _daemon(ctx)  # first: the running daemon's directories are checked
    state_dir = args.state_dir or info.get("state_dir")
    cache_dir = args.cache_dir or info.get("cache_dir")
    checks = [*run_checks(state_dir, cache_dir), daemon]
    out = ctx.output
    if args.json:
        out.json([c.to_dict() for c in checks])
    else:
        width = max(len(c.name) for c in checks)
        for c in checks:
            out.line(f"{c.status:<4}  {c.name:<{width}}  {c.detail}")
            if c.fix and c.status != "OK":
                out.line(f"{'':<4}  {'':<{width}}  fix: {c.fix}")
        failed = [c.name for c in checks if c.status == FAIL]
        out.line("")
        out.line(f"{len(failed)} check(s) failed: {', '.join(failed)}" if failed
                 else "corral can run here")
    return 1 if any(c.status == FAIL for c in checks) else 0
