"""``corral logs ID [-f]`` and ``corral timeout ID SECONDS``: a sandbox's log, which
outlives it, and its lifetime."""

from __future__ import annotations

import argparse
import json
import re
import time
from typing import Any

import corral
from corral.cli._output import Context
from corral.client._sync._logs import LogEntry, follow_logs, read_logs


def add_commands(sub: Any, conn: list[argparse.ArgumentParser], seconds: Any) -> None:
    p = sub.add_parser(
        "logs", parents=conn, help="a sandbox's commands and lifecycle, also after it ended",
        description="Each command (argv, when, how it ended, the tails of its output) and "
        "lifecycle event (ready, paused, stopped and why, timeout, oom, deleted). Kept "
        "until the sandbox is deleted, and for the daemon's --log-retention after.",
    )
    p.add_argument("id", metavar="ID")
    p.add_argument("-f", "--follow", action="store_true",
                   help="keep printing entries as they come, until the sandbox ends")
    p.add_argument("--json", action="store_true", help="one JSON object per line")
    p.set_defaults(handler=logs)

    p = sub.add_parser(
        "timeout", parents=conn, help="end a running sandbox SECONDS from now (sooner or later)",
        description="Within the daemon's --max-lifetime; the sandbox then stops with "
        "reason timeout. Prints its new end time.",
    )
    p.add_argument("id", metavar="ID")
    p.add_argument("seconds", type=seconds, metavar="SECONDS")
    p.set_defaults(handler=set_timeout)

    p = sub.add_parser(
        "expose", parents=conn, help="serve a port of a sandbox through the daemon; prints "
        "its URL",
        description="An HTTP or WebSocket server listening on PORT in the sandbox becomes "
        "reachable at the URL printed, which carries the port's own access token (anyone "
        "holding it reaches that port only, until the sandbox ends). See docs/network.md.",
    )
    p.add_argument("id", metavar="ID")
    p.add_argument("port", type=int, metavar="PORT")
    p.set_defaults(handler=expose)


def expose(args: argparse.Namespace, ctx: Context) -> int:
    ctx.output.line(corral.Sandbox.connect(args.id, client=ctx.client).expose(args.port))
    return 0


def _when(t: float) -> str:
    return time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(t)) + f".{int(t % 1 * 1000):03d}"


_CONTROL = re.compile(r"[\x00-\x08\x0b-\x1f\x7f-\x9f]")


def _inert(text: str) -> str:
    """``text`` with control characters shown as ``\\xNN``: a sandbox's output (and its
    argv) cannot send escape sequences to the reader's terminal."""
    return _CONTROL.sub(lambda m: f"\\x{ord(m.group()):02x}", text)


def format_entry(e: LogEntry) -> str:
    """One line (a command's output tails follow it, indented); what the sandbox chose
    (argv, output, reasons) is made inert for a terminal."""
    return _inert(_format(e))


def _format(e: LogEntry) -> str:
    if e["kind"] == "command":
        how = (f"exit {e['exit_code']}" if e["outcome"] == "exit" else e["outcome"])
        took = e["ended_at"] - e["started_at"]
        line = f"{_when(e['started_at'])}  $ {' '.join(e['argv'])}  -> {how} ({took:.3f} s)"
        for name in ("stdout", "stderr"):
            tail = e.get(f"{name}_tail") or ""
            if tail:
                body = tail.rstrip("\n").replace("\n", "\n      ")
                line += f"\n    {name}:\n      {body}"
        return line
    if e["kind"] == "end":
        return f"-- end of log (sandbox {e.get('state')})"
    reason = f": {e['reason']}" if e.get("reason") else ""
    return f"{_when(e['at'])}  [{e.get('event')}]{reason}"


def logs(args: argparse.Namespace, ctx: Context) -> int:
    ids = {"sandbox_id": args.id}
    out = ctx.output
    entries = follow_logs(ctx.client, ids) if args.follow else read_logs(ctx.client, ids)
    for entry in entries:
        if entry["kind"] == "end" and not args.follow:
            continue
        out.line(json.dumps(entry, ensure_ascii=False) if args.json else format_entry(entry))
    return 0


def set_timeout(args: argparse.Namespace, ctx: Context) -> int:
    info = corral.Sandbox.connect(args.id, client=ctx.client).set_timeout(args.seconds)
    assert info.started_at is not None
    ends = info.started_at + info.spec.timeout
    ctx.output.line(f"{info.id} now ends at {_when(ends)} (in {ends - time.time():.0f} s)")
    return 0
