"""Processes on a pseudo-terminal: what an interactive shell needs (``corral shell``).

``Engine.spawn(..., terminal=TerminalSize(rows, cols))`` asks the sandbox's agent to
run the command on a new pseudo-terminal (``agent/pty.c``): the command is a session
leader with the terminal as its controlling tty and as its stdin, stdout and stderr,
so ``tty`` names ``/dev/pts/N``, ``stty size`` reports the size, job control works and
Ctrl-C (byte ``0x03`` written to its input) interrupts the foreground job through the
terminal's line discipline. Its output is one stream (``stdout``; the channel treats
a STDERR frame for it as a violation). :meth:`Process.resize
<corral.runtime.processes.Process.resize>` changes the size (the kernel sends
``SIGWINCH``); closing its input types the terminal's end-of-file character (Ctrl-D):
a shell at its prompt exits, a program reading a line gets end-of-file.

The terminal lives in the sandbox's own ``/dev/pts`` (a devpts instance per sandbox):
sandbox code can reach it, as it can reach everything else of its sandbox, but nothing
outside the sandbox reads from it, and the seccomp filter refuses the ioctls that
inject input (``TIOCSTI``) or reach a console (``TIOCLINUX``).
"""

from __future__ import annotations

from typing import NamedTuple

from corral.api.process_models import MAX_TERMINAL_SIDE
from corral.errors import InvalidArgument
from corral.runtime.protocol import Field, Tag

MAX_SIDE = MAX_TERMINAL_SIDE
"""The most rows, and the most columns, a terminal may have (the wire's limit)."""
DEFAULT_ROWS = 24
DEFAULT_COLS = 80
DEFAULT_TERM = "xterm"
"""``TERM`` for a command on a terminal unless its env or its sandbox's spec sets one
(``xterm``: in the terminfo of almost every image)."""


class TerminalSize(NamedTuple):
    """A terminal's size in character cells."""

    rows: int = DEFAULT_ROWS
    cols: int = DEFAULT_COLS


def terminal_size(rows: object, cols: object) -> TerminalSize:
    """A checked :class:`TerminalSize`; :class:`InvalidArgument` unless both are
    whole numbers from 1 to :data:`MAX_SIDE`."""
    return TerminalSize(_side("rows", rows), _side("cols", cols))


def _side(name: str, value: object) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or not 1 <= value <= MAX_SIDE:
        raise InvalidArgument(
            f"a terminal's {name} must be a whole number from 1 to {MAX_SIDE}, got {value!r}",
            details={name: repr(value)},
        )
    return value


def terminal_fields(size: TerminalSize) -> list[Field]:
    """The EXEC fields that put a command on a terminal of ``size``."""
    size = terminal_size(*size)
    return [(Tag.ROWS, size.rows), (Tag.COLS, size.cols)]


def terminal_env(env: dict[str, str] | None, spec_env: dict[str, str]) -> dict[str, str]:
    """``env`` with ``TERM`` added unless it, or the sandbox's spec, has one."""
    env = dict(env or {})
    if "TERM" not in env and "TERM" not in spec_env:
        env["TERM"] = DEFAULT_TERM
    return env
