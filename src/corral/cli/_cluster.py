"""``corral cluster up|status|down``: a corral daemon on every node of a Ray cluster.

    corral cluster up --address HEAD:6379      # once; again changes nothing
    export CORRAL_URL=ray://HEAD:6379          # then the SDK, the CLI and corral.rl use it
    # or, for a tenant outside Ray: a line `up` printed, with the tenant's CORRAL_TOKEN
    export CORRAL_URL=cluster+http://NODE:PORT?key=KEY
    corral cluster status --address HEAD:6379
    corral cluster down --address HEAD:6379    # every daemon and its sandboxes

Needs the ``ray`` extra (``pip install 'corral[ray]'``) here and on every node.
"""

from __future__ import annotations

import argparse
import sys
from typing import Any

from corral.cli._output import Context, new_table


def add_commands(sub: Any) -> None:
    p = sub.add_parser("cluster", help="a corral daemon on every node of a Ray cluster "
                       "(up, status, down)")
    verbs = p.add_subparsers(dest="cluster_command", required=True, metavar="VERB")
    address = argparse.ArgumentParser(add_help=False)
    address.add_argument(
        "--address", default="auto", metavar="ADDR",
        help="the Ray cluster: HOST:PORT of its head (as `ray start --head` printed), or "
        "auto (default: RAY_ADDRESS, else the cluster started on this host)",
    )
    p = verbs.add_parser(
        "up", parents=[address], help="start a daemon on every node (and on nodes that join)",
        description="Starts one corral daemon per alive Ray node (a Ray actor pinned to the "
        "node, restarted by Ray if it dies), and on nodes that join later. Idempotent.",
    )
    p.add_argument("--state-dir", metavar="DIR", default=None,
                   help="each node's daemon keeps its state in DIR/<node> on that node "
                   "(default /var/lib/corral/cluster)")
    p.add_argument("--cache-dir", metavar="DIR", help="images and agent (default: each node "
                   "its own, DIR/<node>/cache of --state-dir, seeded with the host's prepared "
                   "images by hard links); {node} in it is replaced by the node's tag")
    p.add_argument("--resource", metavar="NAME", default=None,
                   help="the Ray resource of one sandbox slot, which sandboxes no node has "
                   "room for are asked from Ray's autoscaler as (default corral_sandbox)")
    p.add_argument("--json", action="store_true", help="print the nodes' entries as JSON")
    p.set_defaults(handler=up)
    p = verbs.add_parser("status", parents=[address], help="nodes, their daemons and load")
    p.add_argument("--json", action="store_true",
                   help='print {"nodes": [...], "gcs_authenticated": ...} as JSON')
    p.set_defaults(handler=status)
    p = verbs.add_parser("down", parents=[address],
                         help="stop every node's daemon and its sandboxes")
    p.set_defaults(handler=down)


def up(args: argparse.Namespace, ctx: Context) -> int:
    from corral.cluster import bringup

    entries = bringup.up(
        args.address, state_dir=args.state_dir or bringup.DEFAULT_STATE_DIR,
        cache_dir=args.cache_dir, **({"resource": args.resource} if args.resource else {}),
    )
    warning = bringup.open_warning(args.address)
    if warning:  # one line, on stderr (also with --json)
        print(warning, file=sys.stderr, flush=True)
    if args.json:
        ctx.output.json({"nodes": entries})
    else:
        for e in entries:
            ctx.output.line(f"{e['node_id']}  {e['url']}  {cluster_url(e) or ''}".rstrip())
        ctx.output.err.print(
            f"[dim]{len(entries)} daemons; use them with CORRAL_URL=ray://{args.address}, "
            "or, outside Ray with a tenant token, CORRAL_URL=cluster+http://...?key=... "
            "(a node's, above)[/dim]"
        )
    return 0


def cluster_url(entry: dict[str, Any]) -> str | None:
    """``cluster+http://HOST:PORT?key=KEY`` for a node's directory entry (None: no key):
    what a client outside Ray is configured with, the daemon's key pinned."""
    from corral.cluster.proof import url_key

    key, url = entry.get("key"), entry.get("url")
    return f"cluster+{url}?key={url_key(str(key))}" if key and url else None


def status(args: argparse.Namespace, ctx: Context) -> int:
    from corral.cluster import bringup

    report = bringup.status(args.address)
    if args.json:
        ctx.output.json(report)
        return 0
    table = new_table()
    for column in ("NODE", "ADDRESS", "ALIVE", "DAEMON", "SANDBOXES", "MAX"):
        table.add_column(column, no_wrap=True)
    for n in report["nodes"]:
        cap = n["capacity"] or {}
        table.add_row(
            n["node_id"], n["address"], "yes" if n["alive"] else "no",
            n["daemon"] or n.get("error") or "-",
            "-" if n["sandboxes"] is None else str(n["sandboxes"]),
            str(cap.get("max_sandboxes", "-")),
        )
    ctx.output.out.print(table)
    if not report["gcs_authenticated"]:
        print(bringup.open_warning(args.address) or "", file=sys.stderr, flush=True)
    demand = report["autoscaler"]
    if demand["waiting"] or demand["requested"]:
        ctx.output.err.print(
            f"[dim]{demand['waiting']} creates wait for room; Ray's autoscaler is asked for "
            f"{demand['requested']} {demand['resource']} slots[/dim]"
        )
    return 0


def down(args: argparse.Namespace, ctx: Context) -> int:
    from corral.cluster import bringup

    stopped = bringup.down(args.address)
    ctx.output.line(f"stopped {stopped} daemons")
    return 0
