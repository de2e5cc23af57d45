"""``corral exec``: run a command in a sandbox, its output streamed as it is written."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import TextIO

import corral
from corral.cli._output import Context, Output

EXIT_TIMEOUT = 124  # what coreutils' `timeout` returns
EXIT_SIGNAL_BASE = 128  # a shell reports "killed by signal N" as 128 + N
EXIT_OOM = EXIT_SIGNAL_BASE + 9  # the kernel's OOM killer sends SIGKILL


def read_stdin(source: str | None) -> bytes | None:
    """The bytes ``--stdin-file`` names (``-``: this process's standard input)."""
    if source is None:
        return None
    if source == "-":
        return sys.stdin.buffer.read()
    return Path(source).read_bytes()


def _write(stream: TextIO, data: bytes) -> None:
    buffer = getattr(stream, "buffer", None)
    if buffer is None:  # a text-only stream (rare): decode this chunk
        stream.write(data.decode(errors="replace"))
    else:
        buffer.write(data)
    stream.flush()


def exec_command(args: argparse.Namespace, ctx: Context) -> int:
    """Stream the command's stdout/stderr to ours; exit with its status (124 on a
    timeout, 137 on an out-of-memory kill, 128+N when signal N killed it)."""
    cmd: str | list[str] = args.cmd[0] if len(args.cmd) == 1 else args.cmd
    stdin = read_stdin(args.stdin_file)
    sandbox = corral.Sandbox.connect(args.id, client=ctx.client)
    with sandbox.exec_stream(
        cmd, timeout=args.timeout, env=args.env or None, cwd=args.cwd, stdin=stdin
    ) as run:
        for chunk in run:
            _write(sys.stdout if chunk.stream == "stdout" else sys.stderr, chunk.data)
    result = run.result
    out = ctx.output
    if result.truncated:
        out.error(f"{sandbox.id}: the output was cut: each stream keeps its first 1 MiB")
    return exit_status(result, sandbox, args.timeout, out)


def exit_status(
    result: corral.CommandResult, sandbox: corral.Sandbox, timeout: float | None, out: Output
) -> int:
    """The command's status as ours (124 on a timeout, 137 on an out-of-memory kill,
    128+N when signal N killed it), saying why on stderr when it was killed."""
    if result.timed_out:
        out.error(f"{sandbox.id}: the command timed out after {timeout:g} s and was killed")
        return EXIT_TIMEOUT
    if result.oom_killed:
        out.error(
            f"{sandbox.id}: the command ran out of memory and was killed "
            f"(the sandbox has {sandbox.info.spec.memory_mb} MB: create it with more --memory-mb)"
        )
        return EXIT_OOM
    if result.returncode < 0:
        return EXIT_SIGNAL_BASE - result.returncode
    return result.returncode
