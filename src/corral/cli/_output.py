"""What the CLI shares between commands: the consoles, JSON, and fanned-out calls.

Machine-readable output (ids, JSON, a command's output) goes to stdout as plain text;
tables go to stdout through rich; progress bars and messages go to stderr, so a pipe
never sees them. rich is imported when a command first prints through it (a table, a
bar): ``corral exec``, ``cp``, ``rm`` or ``--help`` never load it.
"""

from __future__ import annotations

import json
import sys
from collections import Counter
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from functools import cached_property
from typing import TYPE_CHECKING, Any, TypeVar

import corral

if TYPE_CHECKING:
    from rich.console import Console
    from rich.table import Table

T = TypeVar("T")

PROGRESS_MIN = 10
"""Calls fanned out at once from which ``rm`` and friends show a progress bar."""


PROGRESS_BYTES = 8 << 20
"""Files from this size on show a progress bar while ``cp`` moves them (on a terminal)."""

UNLIMITED_WIDTH = 10_000


class UsageError(Exception):
    """A command line that argparse accepted but that makes no sense (exit status 2)."""


def new_table(**options: Any) -> Table:
    """A table in the CLI's style: a rule under the head, no edges."""
    from rich import box
    from rich.table import Table

    return Table(box=box.SIMPLE_HEAD, show_edge=False, pad_edge=False, **options)


def new_grid() -> Table:
    """Rows of ``key  value``, as ``info`` and ``inspect`` show them."""
    from rich.table import Table

    return Table.grid(padding=(0, 2))


def escape(text: str) -> str:
    """``text`` with rich's markup escaped (it is printed as it is)."""
    from rich.markup import escape

    return escape(text)


class Output:
    """Where the CLI writes; the consoles (built on first use) look up
    ``sys.stdout``/``sys.stderr`` when they print, so a redirected stream (a test's
    capture) is honoured."""

    @cached_property
    def out(self) -> Console:
        from rich.console import Console

        # Into a pipe, a table keeps its natural width rather than folding at 80 columns.
        return Console(highlight=False, width=None if sys.stdout.isatty() else UNLIMITED_WIDTH)

    @cached_property
    def err(self) -> Console:
        from rich.console import Console

        return Console(stderr=True, highlight=False)

    def line(self, text: str = "") -> None:
        """One line of plain output: no markup, no wrapping."""
        print(text, file=sys.stdout, flush=True)

    def json(self, data: Any) -> None:
        print(json.dumps(data, indent=2), file=sys.stdout, flush=True)

    def error(self, message: str) -> None:
        print(f"corral: {message}", file=sys.stderr, flush=True)

    def fan_out(
        self, calls: Sequence[Callable[[], T]], *, label: str, progress: bool
    ) -> list[T | corral.CorralError]:
        """Run ``calls`` concurrently on the SDK's shared thread pool (which bounds how
        many run at once); each result, or the :class:`~corral.CorralError` it raised,
        in order. Other exceptions propagate; Ctrl-C cancels the calls not yet started.
        """
        from rich.progress import (
            BarColumn,
            MofNCompleteColumn,
            Progress,
            TextColumn,
            TimeElapsedColumn,
        )

        handles = [corral.submit(call) for call in calls]
        columns = (
            TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(),
            TimeElapsedColumn(),
        )
        show = progress and self.err.is_terminal
        with Progress(*columns, console=self.err, transient=True, disable=not show) as bar:
            task = bar.add_task(label, total=len(handles))
            try:
                for _ in corral.as_completed(handles):
                    bar.advance(task)
            except BaseException:
                for h in handles:
                    h.cancel()
                raise
        results: list[T | corral.CorralError] = []
        for h in handles:
            exc = h.exception()
            if exc is None:
                results.append(h.result())
            elif isinstance(exc, corral.CorralError):
                results.append(exc)
            else:
                raise exc
        return results

    @contextmanager
    def transfer(self, label: str, total: int) -> Iterator[Callable[[int, int], None] | None]:
        """A bar of bytes on stderr for moving ``total`` bytes: the ``progress(done,
        total)`` callback that feeds it, or None (stderr is no terminal, or the file is
        under :data:`PROGRESS_BYTES`: nothing is shown)."""
        if not self.err.is_terminal or total < PROGRESS_BYTES:
            yield None
            return
        from rich.progress import (
            BarColumn,
            DownloadColumn,
            Progress,
            TextColumn,
            TimeRemainingColumn,
            TransferSpeedColumn,
        )

        columns = (TextColumn("{task.description}"), BarColumn(), DownloadColumn(),
                   TransferSpeedColumn(), TimeRemainingColumn())
        with Progress(*columns, console=self.err, transient=True) as bar:
            task = bar.add_task(label, total=total)
            yield lambda done, _total: bar.update(task, completed=done)

    def report_failures(self, results: Sequence[object], what: str) -> int:
        """Print each distinct error of ``results`` once; the exit status (0 or 1)."""
        errors = [r for r in results if isinstance(r, corral.CorralError)]
        if not errors:
            return 0
        if len(results) > 1:
            self.error(f"{len(errors)} of {len(results)} {what} failed:")
        for message, n in Counter(e.message for e in errors).items():
            self.error(message + (f" (x{n})" if n > 1 else ""))
        return 1


class Context:
    """What a command runs with: the output, and a client built on first use (so
    ``serve`` and usage errors never connect)."""

    def __init__(self, url: str | None, token: str | None) -> None:
        self._url = url
        self._token = token
        self.output = Output()

    @property
    def url(self) -> str | None:
        """The daemon's URL given (``--url``), else ``None``: the environment's."""
        return self._url

    @cached_property
    def client(self) -> corral.Client:
        return corral.Client(self._url, token=self._token)

    def close(self) -> None:
        """Close the client's connections (a later use opens a new client)."""
        if "client" in self.__dict__:
            self.__dict__.pop("client").close()


def humanize_age(seconds: float) -> str:
    """A coarse age, as ``ls`` shows it.

    >>> [humanize_age(s) for s in (4, 150, 7300, 200000)]
    ['4s', '2m', '2h', '2d']
    """
    seconds = max(0, int(seconds))
    for unit, size in (("d", 86400), ("h", 3600), ("m", 60)):
        if seconds >= size:
            return f"{seconds // size}{unit}"
    return f"{seconds}s"
