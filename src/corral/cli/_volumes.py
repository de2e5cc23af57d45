"""``corral volume create NAME --from DIR|TARBALL``, ``corral volume ls``, ``corral
volume rm NAME``: volumes, mounted into sandboxes with ``--volume PATH=NAME[:MODE]``."""

from __future__ import annotations

import argparse
from typing import Any

import corral
from corral.cli._output import Context


def add_commands(sub: Any, conn: list[argparse.ArgumentParser]) -> None:
    p = sub.add_parser("volume", parents=conn, help="volumes: trees mounted into sandboxes",
                       description=__doc__)
    vsub = p.add_subparsers(dest="volume_command", required=True)
    c = vsub.add_parser("create", parents=conn, help="make a volume from a directory or tar")
    c.add_argument("name", metavar="NAME")
    c.add_argument("--from", dest="source", required=True, metavar="DIR|TARBALL")
    c.add_argument("--max-mb", type=int, default=None, metavar="N",
                   help="a size limit its rw writers share (MiB)")
    c.set_defaults(handler=create)
    ls_ = vsub.add_parser("ls", parents=conn, help="list your volumes")
    ls_.set_defaults(handler=ls)
    rm_ = vsub.add_parser("rm", parents=conn, help="remove volumes no running sandbox mounts")
    rm_.add_argument("names", nargs="+", metavar="NAME")
    rm_.set_defaults(handler=rm)


def create(args: argparse.Namespace, ctx: Context) -> int:
    vol = corral.Volume.create(args.name, args.source, max_mb=args.max_mb, client=ctx.client)
    ctx.output.line(f"{vol.name}: {vol.info.files} files, {vol.info.size_bytes} bytes")
    return 0


def ls(args: argparse.Namespace, ctx: Context) -> int:
    for vol in corral.Volume.list(client=ctx.client):
        ctx.output.line(f"{vol.name}\t{vol.info.files}\t{vol.info.size_bytes}")
    return 0


def rm(args: argparse.Namespace, ctx: Context) -> int:
    for name in args.names:
        corral.Volume.get(name, client=ctx.client).delete()
        ctx.output.line(name)
    return 0
