"""``corral snapshot create|ls|rm``: snapshots on the daemon."""

from __future__ import annotations

import argparse
import time

import corral
from corral.cli._output import Context, humanize_age, new_table


def create(args: argparse.Namespace, ctx: Context) -> int:
    """Snapshot a sandbox's files (``--live``: and processes); print the snapshot's id,
    or JSON."""
    sb = corral.Sandbox.connect(args.id, client=ctx.client)
    snap = sb.checkpoint(name=args.name) if args.live else sb.snapshot(name=args.name)
    if args.json:
        ctx.output.json(snap.info.model_dump(mode="json"))
    else:
        ctx.output.line(snap.id)
    return 0


def ls(args: argparse.Namespace, ctx: Context) -> int:
    """The daemon's snapshots as a table, ids (``-q``) or JSON."""
    snaps = corral.Snapshot.list(client=ctx.client)
    out = ctx.output
    if args.json:
        out.json([s.info.model_dump(mode="json") for s in snaps])
        return 0
    if args.quiet:
        for s in snaps:
            out.line(s.id)
        return 0
    if not snaps:
        out.line("no snapshots")
        return 0
    table = new_table()
    for name in ("ID", "NAME", "KIND", "IMAGE", "LAYERS", "SIZE MB", "AGE", "FROM"):
        table.add_column(name, no_wrap=True)
    now = time.time()
    for s in snaps:
        table.add_row(
            s.id, s.name or "-", s.info.kind, s.image, str(len(s.layers)), f"{s.size_bytes / 1e6:.1f}",
            humanize_age(now - s.created_at), s.info.source_sandbox or "-",
        )
    out.out.print(table)
    return 0


def rm(args: argparse.Namespace, ctx: Context) -> int:
    """Delete snapshots by id or name; sandboxes started from them keep running.
    An unknown one is an error (exit status 1), the others are still deleted."""
    failed = 0
    for ref in dict.fromkeys(args.refs):
        try:
            corral.Snapshot.get(ref, client=ctx.client).delete()
        except corral.SnapshotNotFound as exc:
            ctx.output.error(exc.message)
            failed = 1
            continue
        ctx.output.line(ref)
    return failed
