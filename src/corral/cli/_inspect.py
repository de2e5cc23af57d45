"""``corral inspect ID``: one sandbox in full — spec, state, reason, usage, processes."""

from __future__ import annotations

import argparse
import time
from typing import TYPE_CHECKING, Any

import corral
from corral.cli._output import Context, escape, humanize_age, new_grid, new_table

if TYPE_CHECKING:
    from rich.table import Table


def add_parser(sub: Any, conn: list[argparse.ArgumentParser]) -> None:
    p = sub.add_parser(
        "inspect", parents=conn,
        help="one sandbox in full: spec, state and why it ended, usage, processes",
        description="The processes listed are those started with spawn (sb.spawn, "
        "POST .../processes): running ones and the last 64 that exited; none once the "
        "sandbox has ended (null in --json).",
    )
    p.add_argument("id", metavar="ID")
    p.add_argument("--json", action="store_true",
                   help="print the sandbox (with usage) and its processes as JSON")
    p.set_defaults(handler=inspect)


def inspect(args: argparse.Namespace, ctx: Context) -> int:
    sandbox = corral.Sandbox.connect(args.id, client=ctx.client)
    ids = {"sandbox_id": sandbox.id}
    try:
        processes: list[dict[str, Any]] | None = ctx.client.call(
            "list_processes", ids).json()["processes"]
    except (corral.InvalidState, corral.SandboxLost):  # it has ended: nothing runs
        processes = None
    out = ctx.output
    if args.json:
        out.json({**sandbox.info.model_dump(mode="json"), "usage": sandbox.usage,
                  "processes": processes})
        return 0
    out.out.print(_summary(sandbox))
    out.out.print()
    if processes:
        out.out.print(_process_table(processes))
    else:
        out.out.print("processes   " + ("none spawned" if processes == [] else "- (ended)"))
    return 0


def _summary(sandbox: corral.Sandbox) -> Table:
    info, now = sandbox.info, time.time()
    grid = new_grid()
    grid.add_column(style="bold", no_wrap=True)
    grid.add_column(overflow="fold")
    grid.add_row("id", info.id)
    grid.add_row("state", info.state.value)
    grid.add_row("reason", escape(info.reason or "-"))
    times = f"created {humanize_age(now - info.created_at)} ago"
    if info.started_at is not None:
        times += f", started {humanize_age(now - info.started_at)} ago"
    if info.ended_at is not None:
        times += f", ended {humanize_age(now - info.ended_at)} ago"
    grid.add_row("times", times)
    usage = sandbox.usage
    grid.add_row("usage", "-" if not usage else (
        f"{usage.get('cpu_seconds', 0):.2f} CPU s, {usage.get('memory_mb', 0):.1f} MB memory"
    ))
    spec = info.spec.model_dump(mode="json")
    for key in ("image", "snapshot", "cpus", "memory_mb", "pids", "disk_mb", "inodes", "storage",
                "open_files", "timeout", "idle_timeout", "network", "gpus", "workdir"):
        if spec.get(key) is not None:
            grid.add_row(key, escape(str(spec[key])))
    grid.add_row("tags", escape(", ".join(info.tags) or "-"))
    grid.add_row("env", escape(" ".join(f"{k}={v}" for k, v in spec["env"].items()) or "-"))
    return grid


def _process_table(processes: list[dict[str, Any]]) -> Table:
    table = new_table(title="processes", title_justify="left")
    for name in ("PROCESS", "PID", "STATE", "EXIT", "AGE", "COMMAND"):
        table.add_column(name, no_wrap=name != "COMMAND", overflow="fold")
    now = time.time()
    for p in processes:
        result = p.get("result") or {}
        code = result.get("returncode")
        table.add_row(
            p["id"], str(p["pid"]), p["state"], "-" if code is None else str(code),
            humanize_age(now - p["started_at"]), escape(" ".join(p["cmd"])),
        )
    return table
