"""A live progress line for episodes: done of total, counts by status, rate, and a
caller's own text (evaluation shows its running mean ± CI there). On stderr, so a
pipe on stdout never sees it; nothing is drawn when stderr is not a terminal unless
asked for."""

from __future__ import annotations

import time
from collections import Counter

from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

STATUS_ORDER = ("ok", "error", "timeout", "infra_error", "cached")


class EpisodeProgress:
    """``with EpisodeProgress(total, label=...) as p: p.advance("ok", extra="...")``.

    ``below=other`` draws this one as a further line of ``other``'s display (runs going
    on side by side); only ``other`` is entered."""

    def __init__(
        self, total: int | None, *, label: str = "episodes", console: Console | None = None,
        enabled: bool = True, below: EpisodeProgress | None = None,
    ) -> None:
        self.counts: Counter[str] = Counter()
        self._start = time.perf_counter()
        if below is not None:
            self.console, self._bar = below.console, below._bar
        else:
            self.console = console or Console(stderr=True, highlight=False)
            self._bar = Progress(
                TextColumn("{task.description}"), BarColumn(bar_width=24), MofNCompleteColumn(),
                TextColumn("{task.fields[counts]}"), TextColumn("{task.fields[rate]}"),
                TextColumn("{task.fields[extra]}"), TimeElapsedColumn(),
                console=self.console, disable=not enabled, transient=False,
            )
        self._task = self._bar.add_task(label, total=total, counts="", rate="", extra="")

    def set_total(self, total: int | None) -> None:
        self._bar.update(self._task, total=total)

    def advance(self, status: str, n: int = 1, *, extra: str | None = None) -> None:
        self.counts[status] += n
        done = sum(self.counts.values())
        rate = done / max(time.perf_counter() - self._start, 1e-9)
        counts = " ".join(f"{k} {self.counts[k]}" for k in STATUS_ORDER if self.counts[k])
        fields = {"counts": counts, "rate": f"{rate:.1f}/s"}
        if extra is not None:
            fields["extra"] = extra
        self._bar.update(self._task, advance=n, **fields)

    def __enter__(self) -> EpisodeProgress:
        self._bar.start()
        return self

    def __exit__(self, *exc_info: object) -> None:
        self._bar.stop()
