"""``corral pool ls|create|rm``: warm pools on the daemon."""

from __future__ import annotations

import argparse

import corral
from corral.cli._output import Context
from corral.cli._sandboxes import pool_table, spec_options


def ls(args: argparse.Namespace, ctx: Context) -> int:
    """The daemon's pools as a table, names (``-q``) or JSON."""
    pools = ctx.client.call("list_pools").json()["pools"]
    out = ctx.output
    if args.json:
        out.json(pools)
    elif args.quiet:
        for p in pools:
            out.line(p["name"])
    elif pools:
        out.out.print(pool_table(pools))
    else:
        out.line("no pools")
    return 0


def create(args: argparse.Namespace, ctx: Context) -> int:
    """Create a pool that stays after this command exits; print its name, or JSON."""
    pool = corral.Pool(
        min_ready=args.min_ready, max_size=args.max_size, name=args.name, client=ctx.client,
        **spec_options(args),
    )
    if not pool.owned:
        ctx.output.error(
            f"a pool named {pool.name!r} already exists: remove it first (corral pool rm "
            f"{pool.name}) or choose another name"
        )
        return 1
    if args.json:
        ctx.output.json(pool.stats().model_dump(mode="json"))
    else:
        ctx.output.line(pool.name)
    return 0


def rm(args: argparse.Namespace, ctx: Context) -> int:
    """Delete pools (and their ready sandboxes); print the names."""
    for name in dict.fromkeys(args.names):
        ctx.client.call("delete_pool", {"name": name})
        ctx.output.line(name)
    return 0
