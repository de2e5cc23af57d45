"""``corral image build|pull|ls|rm|prune|import``: images on the daemon.

``build`` shows each step and its output on stderr as the daemon runs it, and prints
the image's name (or, with ``--json``, the image) on stdout.
"""

from __future__ import annotations

import argparse
import os
import time
from typing import Any

import corral
from corral.cli._output import Context, escape, humanize_age, new_table


def add_commands(sub: Any, conn: list[argparse.ArgumentParser]) -> None:
    """Register ``corral image VERB``."""
    p = sub.add_parser("image", help="images: build from a spec, pull from a registry, "
                       "import, list, remove (build, pull, ls, rm, prune, import)")
    verbs = p.add_subparsers(dest="image_command", required=True, metavar="VERB")
    p = verbs.add_parser("build", parents=conn, help="build an image from a YAML spec or "
                         "a Dockerfile (steps are cached); print its name")
    p.add_argument("spec", metavar="SPEC|DIR", help="the spec file (base:, steps:, name:), "
                   "or a Dockerfile's build context directory")
    p.add_argument("-f", "--file", metavar="DOCKERFILE",
                   help="the Dockerfile (default: DIR/Dockerfile when SPEC is a directory)")
    p.add_argument("--build-arg", action="append", default=[], metavar="K=V",
                   help="a Dockerfile ARG value (repeatable)")
    p.add_argument("--target", metavar="STAGE", help="the Dockerfile stage to build")
    p.add_argument("--name", metavar="N", help="the image's name (default: the spec's name)")
    p.add_argument("--context", metavar="DIR",
                   help="where relative copy sources start (default: the spec's directory)")
    p.add_argument("-q", "--quiet", action="store_true", help="do not show the build's log")
    p.add_argument("--json", action="store_true", help="print the image as JSON")
    p.set_defaults(handler=build)
    p = verbs.add_parser("pull", parents=conn, help="pull an image from an OCI/Docker "
                         "registry (HOST[:PORT]/REPO[:TAG][@sha256:...]); print its name")
    p.add_argument("ref", metavar="REF")
    p.add_argument("--name", metavar="N", help="the local name (default: from REF)")
    p.add_argument("--insecure", action="store_true",
                   help="plain HTTP (loopback registries or CORRAL_INSECURE_REGISTRIES only)")
    p.add_argument("-q", "--quiet", action="store_true", help="no progress")
    p.add_argument("--json", action="store_true", help="print the image as JSON")
    p.set_defaults(handler=pull)
    p = verbs.add_parser("prune", parents=conn,
                         help="delete layers no image, build cache or sandbox holds")
    p.add_argument("--json", action="store_true", help="print what went as JSON")
    p.set_defaults(handler=prune)
    p = verbs.add_parser("ls", parents=conn, help="list images")
    p.add_argument("-q", "--quiet", action="store_true", help="print names only")
    p.add_argument("--json", action="store_true", help="print a JSON list of images")
    p.set_defaults(handler=ls)
    p = verbs.add_parser("rm", parents=conn, help="delete images (refused while in use)")
    p.add_argument("names", nargs="+", metavar="NAME")
    p.set_defaults(handler=rm)
    p = verbs.add_parser("import", parents=conn, help="import a docker save tarball or an "
                         "OCI image layout (directory or tar)")
    p.add_argument("archive", metavar="ARCHIVE")
    p.add_argument("--name", metavar="N", required=True, help="the image's name")
    p.add_argument("--json", action="store_true", help="print the image as JSON")
    p.set_defaults(handler=import_archive)


def build(args: argparse.Namespace, ctx: Context) -> int:
    """Build a spec on the daemon, its log on stderr; the image's name on stdout."""
    err = ctx.output.err

    def show(event: corral.BuildEvent) -> None:
        if args.quiet:
            return
        if event.type == "step":
            cached = " [dim](cached)[/dim]" if event.cached else ""
            err.print(f"[bold]step {event.step}/{event.total}[/bold] "
                      f"{escape(event.instruction or '')}{cached}")
        elif event.type == "log":
            err.print("  " + escape(event.line or ""), soft_wrap=True)

    if args.file or os.path.isdir(args.spec):
        build_args = {}
        for item in args.build_arg:
            k, sep, v = item.partition("=")
            if not sep:
                ctx.output.error(f"--build-arg {item!r}: write KEY=VALUE")
                return 2
            build_args[k] = v
        image = corral.Image.from_dockerfile(
            args.spec, dockerfile=args.file, name=args.name, build_args=build_args,
            target=args.target, on_event=show, client=ctx.client)
    else:
        image = corral.Image.build(args.spec, name=args.name, context=args.context,
                                   on_event=show, client=ctx.client)
    stats = image.build_stats
    if stats is not None and not args.quiet:
        err.print(f"image {image.name!r}: {stats.built} step(s) run, {stats.cached} cached, "
                  f"{stats.seconds:.1f} s")
    if args.json:
        ctx.output.json(image.info.model_dump(mode="json"))
    else:
        ctx.output.line(image.name)
    return 0


def ls(args: argparse.Namespace, ctx: Context) -> int:
    """The daemon's images as a table, names (``-q``) or JSON."""
    images = corral.Image.list(client=ctx.client)
    out = ctx.output
    if args.json:
        out.json([i.info.model_dump(mode="json") for i in images])
        return 0
    if args.quiet:
        for i in images:
            out.line(i.name)
        return 0
    if not images:
        out.line("no images")
        return 0
    table = new_table()
    for col in ("NAME", "KIND", "BASE", "LAYERS", "SIZE MB", "SHARED MB", "UNIQUE MB", "AGE"):
        table.add_column(col, no_wrap=True)
    now = time.time()
    for i in images:
        unique = i.info.unique_bytes
        table.add_row(i.name, i.kind, i.base or "-", str(len(i.layers)),
                      f"{i.size_bytes / 1e6:.1f}",
                      "-" if unique is None else f"{(i.size_bytes - unique) / 1e6:.1f}",
                      "-" if unique is None else f"{unique / 1e6:.1f}",
                      humanize_age(now - i.created_at))
    out.out.print(table)
    return 0


def rm(args: argparse.Namespace, ctx: Context) -> int:
    """Delete images by name. An unknown one, or one in use, is an error (exit status
    1); the others are still deleted."""
    failed = 0
    for name in dict.fromkeys(args.names):
        try:
            corral.Image.get(name, client=ctx.client).delete()
        except (corral.ImageNotFound, corral.ImageInUse, corral.InvalidArgument) as exc:
            ctx.output.error(exc.message)
            failed = 1
            continue
        ctx.output.line(name)
    return failed


def import_archive(args: argparse.Namespace, ctx: Context) -> int:
    image = corral.Image.import_archive(args.archive, name=args.name, client=ctx.client)
    if args.json:
        ctx.output.json(image.info.model_dump(mode="json"))
    else:
        ctx.output.line(image.name)
    return 0



def pull(args: argparse.Namespace, ctx: Context) -> int:
    """Pull on the daemon, a progress bar per layer on stderr; the name on stdout."""
    from rich.progress import BarColumn, DownloadColumn, Progress, TextColumn

    progress = Progress(TextColumn("{task.description}"), BarColumn(), DownloadColumn(),
                        console=ctx.output.err, disable=args.quiet, transient=False)
    tasks: dict[int, Any] = {}

    def show(event: corral.PullEvent) -> None:
        if event.type == "log" and not args.quiet:
            progress.console.print(escape(event.line or ""), soft_wrap=True)
        if event.type != "layer" or event.layer is None:
            return
        if event.layer not in tasks:
            short = (event.digest or "")[7:19]
            label = f"layer {event.layer}/{event.total} {short}"
            tasks[event.layer] = progress.add_task(
                label + (" (stored)" if event.cached else ""), total=event.size)
        progress.update(tasks[event.layer], completed=event.bytes or 0)

    with progress:
        image = corral.Image.pull(args.ref, name=args.name, insecure=args.insecure,
                                  on_progress=show, client=ctx.client)
    if args.json:
        ctx.output.json(image.info.model_dump(mode="json"))
    else:
        ctx.output.line(image.name)
    return 0


def prune(args: argparse.Namespace, ctx: Context) -> int:
    result = corral.Image.prune(client=ctx.client)
    if args.json:
        ctx.output.json(result.model_dump(mode="json"))
    else:
        ctx.output.line(f"removed {len(result.layers)} layer(s), "
                        f"{result.freed_bytes / 1e6:.1f} MB freed")
    return 0
