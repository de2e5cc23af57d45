"""``corral token create|ls|update|revoke``: tenant tokens, made and revoked by the admin.

Run them where the daemon's Unix socket is (or with the daemon's own ``--token``), or
with ``CORRAL_URL=ray://ADDR`` as a cluster's admin (then they act on every node): a
tenant token is refused. ``create`` prints the new token once (``--json``:
``{"name", "token"}``); only its hash is kept. ``ls`` never shows a token. ``update``
changes the quotas given (``none`` drops one); what the tenant holds stays.
"""

from __future__ import annotations

import argparse
import time
from typing import Any

from corral.cli._output import Context, humanize_age, new_table


def add_parser(sub: Any, conn: list[argparse.ArgumentParser]) -> None:
    p = sub.add_parser("token",
                       help="tenant tokens with quotas (create, ls, update, revoke; admin)")
    verbs = p.add_subparsers(dest="token_command", required=True, metavar="VERB")
    p = verbs.add_parser("create", parents=conn, help="make a tenant token; print it once")
    p.add_argument("name", metavar="NAME", help="the tenant: lower-case letters, digits, - _")
    _quota_options(p, int, float)
    p.add_argument("--allow-images", action="store_true",
                   help="may build, import and delete images (shared by every tenant)")
    p.add_argument("--allow-host-network", action="store_true",
                   help="may ask for network='host' (needs the daemon's --allow-host-network)")
    p.add_argument("--json", action="store_true", help='print {"name", "token"}')
    p.set_defaults(handler=create)
    p = verbs.add_parser("ls", parents=conn, help="list tenants: quotas, use (never tokens)")
    p.add_argument("--json", action="store_true", help="print a JSON list")
    p.set_defaults(handler=ls)
    p = verbs.add_parser("update", parents=conn, help="change a tenant's quotas ('none': drop)")
    p.add_argument("name", metavar="NAME")
    _quota_options(p, _or_none(int), _or_none(float))
    p.add_argument("--host-network", choices=("allow", "deny"), default=None,
                   help="grant or take back network='host' and private ranges (deny: its "
                        "sandboxes using them stop)")
    p.add_argument("--json", action="store_true", help="print the tenant as JSON")
    p.set_defaults(handler=update)
    p = verbs.add_parser("revoke", parents=conn, help="revoke tenant tokens (refused at once)")
    p.add_argument("names", nargs="+", metavar="NAME")
    p.set_defaults(handler=revoke)


_UNSET = object()
_QUOTAS = ("max_sandboxes", "max_memory_mb", "max_cpus", "max_lifetime", "max_snapshot_mb",
           "max_builds", "max_gpus")


def _quota_options(p: argparse.ArgumentParser, whole: Any, real: Any) -> None:
    for flag, kind, meta, text in (
        ("--max-sandboxes", whole, "N", "sandboxes alive at once (its builds count)"),
        ("--max-memory-mb", whole, "M", "their memory_mb, summed"),
        ("--max-cpus", real, "C", "their cpus, summed"),
        ("--max-lifetime", real, "S",
         "longest lifetime of its sandboxes, seconds (create and set_timeout)"),
        ("--max-snapshot-mb", whole, "M", "its snapshots' layers on disk, MB (shared once)"),
        ("--max-builds", whole, "N", "image builds at once (default 1)"),
        ("--max-gpus", whole, "N", "GPUs its sandboxes hold at once (default 0: none)"),
    ):
        p.add_argument(flag, type=kind, metavar=meta, help=text, default=_UNSET)


def _or_none(kind: type) -> Any:
    def parse(text: str) -> Any:
        return None if text.lower() == "none" else kind(text)
    parse.__name__ = kind.__name__
    return parse


def _given(args: argparse.Namespace) -> dict[str, Any]:
    return {k: getattr(args, k) for k in _QUOTAS if getattr(args, k) is not _UNSET}


def create(args: argparse.Namespace, ctx: Context) -> int:
    body = {"name": args.name, "allow_images": args.allow_images, **_given(args)}
    if args.allow_host_network:  # sent only when given: an older daemon knows no such field
        body["allow_host_network"] = True
    made = ctx.client.call("create_token", json=body).json()
    reach = _cluster_url(ctx)
    if args.json:
        ctx.output.json({"name": made["name"], "token": made["token"],
                         **({"cluster_url": reach} if reach else {})})
    else:
        ctx.output.line(made["token"])
        if reach:  # stdout stays the token alone (TOKEN=$(corral token create ...))
            ctx.output.err.print(f"[dim]outside Ray: CORRAL_URL={reach}[/dim]", soft_wrap=True)
    return 0


def _cluster_url(ctx: Context) -> str | None:
    """On a cluster: how a tenant outside Ray reaches it (a node's address and key)."""
    from corral.cli._cluster import cluster_url
    from corral.errors import CorralError

    try:
        nodes = ctx.client.call("cluster_nodes").json().get("nodes") or []
    except CorralError:  # not a cluster's daemon
        return None
    return next((url for n in nodes if (url := cluster_url(n))), None)


def _limit(value: float | None) -> str:
    return "-" if value is None else f"{value:g}"


def ls(args: argparse.Namespace, ctx: Context) -> int:
    tokens = ctx.client.call("list_tokens").json()["tokens"]
    if args.json:
        ctx.output.json(tokens)
        return 0
    if not tokens:
        ctx.output.line("no tenant tokens")
        return 0
    table = new_table()
    for name in ("TENANT", "SANDBOXES", "MEMORY MB", "CPUS", "GPUS", "SNAPSHOT MB", "BUILDS",
                 "IMAGES", "CREATED"):
        table.add_column(name, no_wrap=True)
    now = time.time()
    for t in tokens:
        use = t.get("usage") or {}
        table.add_row(
            t["name"],
            f"{use.get('sandboxes', 0):g}/{_limit(t['max_sandboxes'])}",
            f"{use.get('memory_mb', 0):g}/{_limit(t['max_memory_mb'])}",
            f"{use.get('cpus', 0):g}/{_limit(t['max_cpus'])}",
            f"{use.get('gpus', 0):g}/{t.get('max_gpus') or 0}",
            f"{use.get('snapshot_mb', 0) + use.get('kept_mb', 0):g}"  # snapshots, kept files
            f"/{_limit(t.get('max_snapshot_mb'))}",
            f"{use.get('builds', 0):g}/{_limit(t.get('max_builds'))}",
            "yes" if t["allow_images"] else "no",
            humanize_age(now - t["created_at"]) + " ago",
        )
    ctx.output.out.print(table)
    return 0


def update(args: argparse.Namespace, ctx: Context) -> int:
    body = _given(args)
    if args.host_network is not None:
        body["allow_host_network"] = args.host_network == "allow"
    changed = ctx.client.call("update_token", {"name": args.name}, json=body).json()
    if args.json:
        ctx.output.json(changed)
    else:
        ctx.output.line(" ".join(f"{k}={_limit(changed.get(k))}" for k in _QUOTAS))
    return 0


def revoke(args: argparse.Namespace, ctx: Context) -> int:
    """Revoke each name; on a cluster, say which nodes did not confirm (exit 1): the
    daemon waited out their lease, so each refuses the token however it fares."""
    code = 0
    for name in dict.fromkeys(args.names):
        reply = ctx.client.call("revoke_token", {"name": name})
        ctx.output.line(name)
        done = reply.json() if reply.status_code == 200 else {}
        for node in done.get("unconfirmed") or ():
            code = 1
            ctx.output.error(
                f"node {node['node']} ({node['url']}) did not confirm the revoke of {name} "
                f"({node['error']}): it refuses the token anyway, as it could not read the "
                f"registry for {done.get('lease_s', 0):g} s or has read the revoke")
    return code
