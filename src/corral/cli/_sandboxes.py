"""Commands on whole sandboxes: create, ls, pause, resume, hibernate, stop, rm, and the
daemon's info."""

from __future__ import annotations

import argparse
import sys
import time
from functools import partial
from typing import TYPE_CHECKING, Any

import corral
from corral.cli._output import PROGRESS_MIN, Context, UsageError, humanize_age, new_grid, new_table
from corral.client._models import SPEC_FIELDS

if TYPE_CHECKING:
    from rich.table import Table

USAGE_MAX_ROWS = 200
"""``ls`` asks for each live sandbox's usage (one request each) only up to this many rows."""

LIVE = (corral.SandboxState.RUNNING, corral.SandboxState.PAUSED)


_FLAG_OF = {"tags": "tag"}  # a spec field whose flag is named otherwise (--tag, repeated)


def spec_options(args: argparse.Namespace) -> dict[str, Any]:
    """The sandbox spec options of ``create`` and ``pool create``, as SDK keywords
    (the fields of :class:`corral.client._models.SpecFields` that have a flag and
    were given)."""
    given = {f: getattr(args, _FLAG_OF.get(f, f), None) for f in SPEC_FIELDS}
    allow, deny = getattr(args, "allow", None), getattr(args, "deny", None)
    join, alias = getattr(args, "join", None), getattr(args, "alias", None)
    if allow or deny or join or alias:
        if given.get("network") is not None:
            raise UsageError("--allow/--deny/--join make an egress policy: leave out --network")
        if alias and not join:
            raise UsageError("--alias names the sandbox on a private network: give --join too")
        given["network"] = {"allow": allow or [], "deny": deny or [],
                            **({"join": join, "alias": alias} if join else {})}
    return {k: v for k, v in given.items() if v is not None and v != [] and v != {}}


def create(args: argparse.Namespace, ctx: Context) -> int:
    """Create ``-n`` sandboxes (concurrently); print their ids, or JSON.

    All or nothing: if any create fails, the sandboxes already made are deleted (and
    the message says so), nothing is printed on stdout and the exit status is 1.
    """
    if args.count < 1:
        raise UsageError(f"-n must be at least 1, got {args.count}")
    make = partial(corral.Sandbox.create, **spec_options(args), client=ctx.client)
    out = ctx.output
    results = out.fan_out([make] * args.count, label="creating", progress=args.count > 1)
    made = [r for r in results if isinstance(r, corral.Sandbox)]
    if len(made) < len(results):
        return _undo_creates(ctx, results, made)
    if args.json:
        out.json([sb.info.model_dump(mode="json") for sb in made])
    else:
        for sb in made:
            out.line(sb.id)
    return 0


def _undo_creates(ctx: Context, results: list[Any], made: list[corral.Sandbox]) -> int:
    """Some creates failed: report why, delete the sandboxes made, say which remain."""
    out = ctx.output
    out.report_failures(results, "creates")
    if not made:
        return 1
    undone = out.fan_out([sb.delete for sb in made], label="deleting", progress=False)
    left = [sb.id for sb, r in zip(made, undone, strict=True) if isinstance(r, Exception)]
    out.error(
        f"deleted the {len(made) - len(left)} sandboxes that were made "
        f"(all or nothing): {' '.join(sb.id for sb in made)}"
    )
    if left:
        out.error(f"could not delete, delete them yourself: {' '.join(left)}")
    return 1


def ls(args: argparse.Namespace, ctx: Context) -> int:
    """List sandboxes as a table (with usage for live ones), ids (``-q``) or JSON."""
    out = ctx.output
    sandboxes = corral.Sandbox.list(tags=args.tag, state=args.state, client=ctx.client)
    if args.quiet:
        for sb in sandboxes:
            out.line(sb.id)
        return 0
    live = [sb for sb in sandboxes if sb.state in LIVE]
    if len(sandboxes) > USAGE_MAX_ROWS:
        out.err.print(
            f"[dim]usage not shown for more than {USAGE_MAX_ROWS} sandboxes: "
            "narrow the list with --tag or --state[/dim]"
        )
    else:
        # A sandbox deleted meanwhile just shows no usage: its error is dropped.
        out.fan_out([sb.refresh for sb in live], label="usage", progress=False)
    if args.json:
        out.json([{**sb.info.model_dump(mode="json"), "usage": sb.usage} for sb in sandboxes])
        return 0
    table = new_table()
    table.add_column("ID", no_wrap=True)
    table.add_column("STATE", no_wrap=True)
    table.add_column("IMAGE")
    table.add_column("AGE", justify="right", no_wrap=True)
    table.add_column("TAGS", overflow="fold")
    table.add_column("CPU S", justify="right", no_wrap=True)
    table.add_column("MEM MB", justify="right", no_wrap=True)
    table.add_column("REASON", overflow="fold")
    on_nodes = any(sb.info.node for sb in sandboxes)  # a Ray cluster (CORRAL_URL=ray://)
    if on_nodes:
        table.add_column("NODE", no_wrap=True)
    now = time.time()
    for sb in sandboxes:
        usage = sb.usage or {}
        cpu, mem = usage.get("cpu_seconds"), usage.get("memory_mb")
        table.add_row(
            sb.id, sb.state.value, sb.info.image, humanize_age(now - sb.info.created_at),
            ",".join(sb.tags), "-" if cpu is None else f"{cpu:.2f}",
            "-" if mem is None else f"{mem:.1f}", sb.info.reason or "",
            *([sb.info.node or "-"] if on_nodes else []),
        )
    out.out.print(table)
    return 0


def _on_each(ctx: Context, ids: list[str], verb: str, act: Any, *, missing_ok: bool = False) -> int:
    """``act(sandbox)`` for every id, concurrently; print the ids that succeeded. With
    ``missing_ok`` (``rm``, idempotent like the API), an id that names no sandbox
    (deleted already, or never made) is only a note on stderr."""
    def one(sandbox_id: str) -> str | None:
        try:
            sandbox = corral.Sandbox.connect(sandbox_id, client=ctx.client)
        except corral.SandboxNotFound:
            if not missing_ok:
                raise
            return None
        act(sandbox)
        return sandbox_id

    out = ctx.output
    wanted = list(dict.fromkeys(ids))
    calls = [partial(one, i) for i in wanted]
    results = out.fan_out(calls, label=verb, progress=len(calls) >= PROGRESS_MIN)
    for sandbox_id, r in zip(wanted, results, strict=True):
        if isinstance(r, str):
            out.line(r)
        elif r is None:
            out.error(f"{sandbox_id}: no such sandbox (deleted already, or never made): "
                      "nothing to delete")
    return out.report_failures(results, verb)


def pause(args: argparse.Namespace, ctx: Context) -> int:
    return _on_each(ctx, args.ids, "pausing", corral.Sandbox.pause)


def resume(args: argparse.Namespace, ctx: Context) -> int:
    return _on_each(ctx, args.ids, "resuming", corral.Sandbox.resume)


def hibernate(args: argparse.Namespace, ctx: Context) -> int:
    return _on_each(ctx, args.ids, "hibernating", corral.Sandbox.hibernate)


def stop(args: argparse.Namespace, ctx: Context) -> int:
    return _on_each(ctx, args.ids, "stopping", partial(corral.Sandbox.stop, grace=args.grace))


def rm(args: argparse.Namespace, ctx: Context) -> int:
    """Delete the sandboxes named, or every one carrying all ``--tag`` (in ``--state``)."""
    selecting = bool(args.tag or args.state)
    if args.ids and selecting:
        raise UsageError("give sandbox ids or --tag/--state, not both")
    if args.ids:
        return _on_each(ctx, args.ids, "deleting", corral.Sandbox.delete, missing_ok=True)
    if not selecting:
        raise UsageError("name the sandboxes to delete: IDs, or --tag/--state to select them")
    out = ctx.output
    doomed = corral.Sandbox.list(tags=args.tag, state=args.state, client=ctx.client)
    if not doomed:
        out.line("deleted 0 sandboxes (none matched)")
        return 0
    if not args.yes and not _confirm(f"delete {len(doomed)} sandboxes?"):
        out.error(f"not deleted: {len(doomed)} sandboxes match; pass -y to delete them")
        return 1
    results = out.fan_out(
        [sb.delete for sb in doomed], label="deleting", progress=len(doomed) >= PROGRESS_MIN
    )
    failed = out.report_failures(results, "deletions")
    out.line(f"deleted {len(doomed) - sum(isinstance(r, Exception) for r in results)} sandboxes")
    return failed


def _confirm(question: str) -> bool:
    """Ask on the terminal; without one (a script), the answer is no."""
    if not sys.stdin.isatty():
        return False
    print(f"{question} [y/N] ", end="", file=sys.stderr, flush=True)
    return sys.stdin.readline().strip().lower() in ("y", "yes")


def info(args: argparse.Namespace, ctx: Context) -> int:
    """The daemon's version, capacity, committed memory, queue and counts by state."""
    data = ctx.client.info()
    out = ctx.output
    if args.json:
        out.json(data)
        return 0
    cap = data["capacity"]
    counts = " · ".join(f"{state} {n}" for state, n in data["counts"].items())
    grid = new_grid()
    grid.add_column(style="bold", no_wrap=True)
    grid.add_column()
    grid.add_row("daemon", f"{ctx.client.url} (version {data['version']}, cgroup v{data['cgroup_version']})")
    if data.get("nodes"):  # a Ray cluster (CORRAL_URL=ray://): the sums of its daemons
        grid.add_row("nodes", f"{len(data['nodes'])} daemons (corral cluster status lists them)")
    grid.add_row("sandboxes", counts)
    grid.add_row(
        "capacity", f"{cap['max_sandboxes']} alive, {cap['max_starting']} starting at once, "
        f"{cap['max_memory_mb']} MB of memory limits",
    )
    grid.add_row("committed", f"{data['committed_memory_mb']} MB of memory limits")
    grid.add_row("starting", str(data["starting"]))
    grid.add_row(
        "queued", f"{data['queued']} (at most {cap['queue_size']}, for up to "
        f"{cap['queue_timeout']:g} s each)",
    )
    out.out.print(grid)
    if data.get("pools"):
        out.out.print()
        out.out.print(pool_table(data["pools"]))
    return 0


def pool_table(pools: list[dict[str, Any]]) -> Table:
    """Warm pools as ``info`` and ``pool ls`` show them."""
    table = new_table()
    for name in ("POOL", "IMAGE", "MEM MB"):
        table.add_column(name, no_wrap=True)
    for name in ("READY", "STARTING", "ACQUIRED", "WAITING", "MIN", "MAX", "CREATED",
                 "FAILED", "WAIT P50 MS"):
        table.add_column(name, justify="right", no_wrap=True)
    for p in pools:
        wait = p.get("acquire_wait_ms_p50")
        table.add_row(
            p["name"], p["spec"]["image"], str(p["spec"]["memory_mb"]),
            *(str(p[k]) for k in ("ready", "starting", "acquired", "waiting", "min_ready",
                                  "max_size", "created", "failed")),
            "-" if wait is None else f"{wait:.2f}",
        )
    return table
