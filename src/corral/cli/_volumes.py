"""``corral volume create NAME --from DIR|TARBALL``, ``corral volume ls``, ``corral
volume rm NAME``, ``corral volume snapshot NAME NEW``, ``corral volume upload NAME FILE PATH`` (resumable, a progress bar on a
terminal for 8 MiB or more): volumes, mounted into sandboxes with ``--volume
PATH=NAME[:MODE]``."""

from __future__ import annotations

import argparse
from pathlib import Path
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
    sn = vsub.add_parser("snapshot", parents=conn, help="a new volume of one's files as they are")
    sn.add_argument("name", metavar="NAME")
    sn.add_argument("new", metavar="NEW")
    sn.set_defaults(handler=snapshot)
    up = vsub.add_parser("upload", parents=conn, help="put a file into a volume (resumable)")
    up.add_argument("name", metavar="NAME")
    up.add_argument("local", metavar="FILE")
    up.add_argument("path", metavar="PATH", help="where in the volume, e.g. models/ckpt.bin")
    up.set_defaults(handler=upload)


def create(args: argparse.Namespace, ctx: Context) -> int:
    vol = corral.Volume.create(args.name, args.source, max_mb=args.max_mb, client=ctx.client)
    ctx.output.line(f"{vol.name}: {vol.info.files} files, {vol.info.size_bytes} bytes")
    return 0


def ls(args: argparse.Namespace, ctx: Context) -> int:
    for vol in corral.Volume.list(client=ctx.client):
        home = f"\tcopy of {vol.info.home}" if vol.info.home else ""
        ctx.output.line(f"{vol.name}\t{vol.info.files}\t{vol.info.size_bytes}{home}")
    return 0


def rm(args: argparse.Namespace, ctx: Context) -> int:
    for name in args.names:
        corral.Volume.get(name, client=ctx.client).delete()
        ctx.output.line(name)
    return 0


def upload(args: argparse.Namespace, ctx: Context) -> int:
    vol = corral.Volume.get(args.name, client=ctx.client)
    size = Path(args.local).stat().st_size  # a missing file raises FileNotFoundError
    with ctx.output.transfer(f"{Path(args.local).name} -> {vol.name}", size) as progress:
        vol.upload(args.local, args.path, progress=progress)
    ctx.output.line(f"{vol.name}:{args.path}")
    return 0


def snapshot(args: argparse.Namespace, ctx: Context) -> int:
    vol = corral.Volume.get(args.name, client=ctx.client).snapshot(args.new)
    ctx.output.line(f"{vol.name}: {vol.info.files} files, {vol.info.size_bytes} bytes")
    return 0
