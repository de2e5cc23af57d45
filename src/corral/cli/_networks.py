"""``corral network create NAME --allow RULE ... [--deny RULE ...] [--max-mbps N] [--private]``,
``corral network ls``, ``corral network show NAME``, ``corral network rm NAME``: named
networks (egress policies), used with ``corral create --network NAME``."""

from __future__ import annotations

import argparse
from typing import Any

import corral
from corral.cli._output import Context


def add_commands(sub: Any, conn: list[argparse.ArgumentParser]) -> None:
    p = sub.add_parser("network", parents=conn, help="named networks: reusable egress policies",
                       description=__doc__)
    nsub = p.add_subparsers(dest="network_command", required=True)
    c = nsub.add_parser("create", parents=conn, help="store a named egress policy")
    c.add_argument("name", metavar="NAME")
    c.add_argument("--allow", action="append", default=[], metavar="RULE",
                   help="a name, *.domain, IP or CIDR, optionally :PORT, or a preset (pypi)")
    c.add_argument("--deny", action="append", default=[], metavar="RULE")
    c.add_argument("--max-mbps", type=int, default=None, metavar="N")
    c.add_argument("--private", action="store_true",
                   help="its sandboxes reach each other directly, by id or --alias")
    c.set_defaults(handler=create)
    ls_ = nsub.add_parser("ls", parents=conn, help="list your named networks")
    ls_.set_defaults(handler=ls)
    show = nsub.add_parser("show", parents=conn, help="one named network's policy (JSON)")
    show.add_argument("name", metavar="NAME")
    show.set_defaults(handler=show_)
    rm_ = nsub.add_parser("rm", parents=conn, help="remove named networks")
    rm_.add_argument("names", nargs="+", metavar="NAME")
    rm_.set_defaults(handler=rm)


def create(args: argparse.Namespace, ctx: Context) -> int:
    net = corral.Network.create(args.name, allow=args.allow, deny=args.deny,
                                max_mbps=args.max_mbps, private=args.private,
                                client=ctx.client)
    ctx.output.line(net.name)
    return 0


def ls(args: argparse.Namespace, ctx: Context) -> int:
    for net in corral.Network.list(client=ctx.client):
        policy = net.policy
        assert policy is not None
        kind = "\tprivate" if net.info is not None and net.info.private else ""
        ctx.output.line(f"{net.name}\tallow={','.join(policy.allow)}\tdeny={','.join(policy.deny)}"
                        + kind)
    return 0


def show_(args: argparse.Namespace, ctx: Context) -> int:
    net = corral.Network.get(args.name, client=ctx.client)
    assert net.info is not None
    ctx.output.json(net.info.model_dump(mode="json"))
    return 0


def rm(args: argparse.Namespace, ctx: Context) -> int:
    for name in args.names:
        corral.Network(name, client=ctx.client).delete()
        ctx.output.line(name)
    return 0
