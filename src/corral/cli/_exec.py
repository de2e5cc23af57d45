"""``corral exec``: run a command in a sandbox, its output streamed as it is written.

A stream longer than ``--max-output`` keeps its head and its tail (``--output-tail``);
where bytes were left out between them, a marker line goes to stderr, in order with
the output (``MARKER``), and a summary follows the command's end."""

from __future__ import annotations

import argparse
import io
import os
import sys
from pathlib import Path
from typing import TextIO

import corral
from corral.cli._output import Context, Output
from corral.schema import DEFAULT_MAX_OUTPUT, default_output_tail

EXIT_TIMEOUT = 124  # what coreutils' `timeout` returns
EXIT_SIGNAL_BASE = 128  # a shell reports "killed by signal N" as 128 + N
EXIT_OOM = EXIT_SIGNAL_BASE + 9  # the kernel's OOM killer sends SIGKILL
MARKER = "corral: [... {dropped} of {stream} left out here{after} ...]"
_UNITS = {"": 1, "K": 1 << 10, "M": 1 << 20, "G": 1 << 30}


def byte_count(text: str) -> int:
    """A number of bytes >= 0, optionally with a K, M or G (binary) suffix: ``64K``."""
    number, unit = text.strip(), ""
    if number[-1:].upper() in _UNITS:
        number, unit = number[:-1], number[-1].upper()
    try:
        value = int(number) * _UNITS[unit]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected bytes (e.g. 65536 or 64K), got {text!r}") from None
    if value < 0:
        raise argparse.ArgumentTypeError(f"expected bytes >= 0, got {text!r}")
    return value


def size(n: int) -> str:
    """``n`` bytes for a reader: exact below 1 KiB, else in KiB/MiB/GiB."""
    if n == 1:
        return "1 byte"
    for unit, scale in (("GiB", 1 << 30), ("MiB", 1 << 20), ("KiB", 1 << 10)):
        if n >= scale:
            return f"{n / scale:.1f} {unit} ({n} bytes)"
    return f"{n} bytes"


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


def _cut(result: corral.CommandResult, name: str) -> str:
    dropped = size(getattr(result, f"{name}_dropped"))
    head, tail = result.head_and_tail(name)  # type: ignore[arg-type]
    if not tail:
        return f"{name} was cut after its first {size(len(head))}: {dropped} left out"
    return (f"{name} was cut: its first {size(len(head))} and its last {size(len(tail))} "
            f"were kept, {dropped} in between left out")


def _same_file(a: TextIO, b: TextIO) -> bool:
    try:
        sa, sb = os.fstat(a.fileno()), os.fstat(b.fileno())
    except (OSError, ValueError, AttributeError, io.UnsupportedOperation):
        return False
    return (sa.st_dev, sa.st_ino) == (sb.st_dev, sb.st_ino)


# Characters that give a word a meaning in sh (and whitespace): a single word without
# any is a program to run as it is, not a script.
_SHELL_SYNTAX = frozenset(" \t\n;&|<>()$`\\\"'*?[]#~={}!")


def command_of(words: list[str]) -> str | list[str]:
    """``corral exec ID -- CMD...`` as the SDK's command: several words are an argv; one
    word is run as it is (``/bin/hello``, ``ls``) unless it holds shell syntax, then
    it is a script for ``sh -c`` (``"echo $HOME; ls"``).

    >>> command_of(["/bin/hello"]), command_of(["echo $HOME"]), command_of(["ls", "-l"])
    (['/bin/hello'], 'echo $HOME', ['ls', '-l'])
    """
    if len(words) > 1:
        return words
    word = words[0]
    return [word] if word and not (set(word) & _SHELL_SYNTAX) else word


def exec_command(args: argparse.Namespace, ctx: Context) -> int:
    """Stream the command's stdout/stderr to ours; exit with its status (124 on a
    timeout, 137 on an out-of-memory kill, 128+N when signal N killed it)."""
    cmd = command_of(args.cmd)
    stdin = read_stdin(args.stdin_file)
    sandbox = corral.Sandbox.connect(args.id, client=ctx.client)
    shared = _same_file(sys.stdout, sys.stderr)  # one terminal: the marker needs its own line
    last = b"\n"  # the last byte written, to either stream
    tail = args.output_tail
    if tail is None:
        tail = default_output_tail(DEFAULT_MAX_OUTPUT if args.max_output is None else args.max_output)
    with sandbox.exec_stream(
        cmd, timeout=args.timeout, env=args.env or None, cwd=args.cwd, stdin=stdin,
        max_output=args.max_output, output_tail=args.output_tail, user=args.user,
    ) as run:
        for chunk in run:
            if chunk.dropped:
                after = f"; its last {size(tail)} follow" if tail else ""
                line = MARKER.format(dropped=size(chunk.dropped), stream=chunk.stream, after=after)
                _write(sys.stderr, (b"\n" if shared and last != b"\n" else b"") + line.encode() + b"\n")
                last = b"\n"
            elif chunk.data:
                _write(sys.stdout if chunk.stream == "stdout" else sys.stderr, chunk.data)
                last = chunk.data[-1:]
    result = run.result
    out = ctx.output
    for name in ("stdout", "stderr"):
        if getattr(result, f"{name}_truncated"):
            out.error(f"{sandbox.id}: {_cut(result, name)}")
    if result.output_limited_to:
        out.error(f"{sandbox.id}: the daemon's output memory was short: each stream was "
                  f"capped at {size(result.output_limited_to)}, not --max-output")
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
