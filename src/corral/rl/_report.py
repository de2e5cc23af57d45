"""How evaluation results are shown: rich tables, and a PNG of the return distribution.

matplotlib is optional (the ``rl`` extra): it is imported only to draw, and drawn on
a ``Figure`` of its own (no ``pyplot``), so a user's interactive backend is untouched.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from pathlib import Path
from typing import Protocol

from rich.table import Table

from corral.errors import InvalidArgument
from corral.rl.stats import Summary


# What is shown of an evaluation, as protocols: ``_eval_result`` imports this module
# to draw its results, so this one does not import it back.
class _SeedRow(Protocol):
    @property
    def seed(self) -> int: ...
    @property
    def n(self) -> int: ...
    @property
    def mean(self) -> float: ...
    @property
    def minimum(self) -> float: ...
    @property
    def maximum(self) -> float: ...
    @property
    def failures(self) -> int: ...


class _Episode(Protocol):
    @property
    def episode_return(self) -> float | None: ...
    @property
    def ok(self) -> bool: ...


class EvalResult(Protocol):
    """The parts of :class:`corral.rl.EvalResult` a report shows."""

    @property
    def policy(self) -> str: ...
    @property
    def env(self) -> object: ...
    @property
    def summary(self) -> Summary: ...
    @property
    def episodes(self) -> Sequence[_Episode]: ...
    @property
    def ci_method(self) -> str: ...
    @property
    def errors(self) -> int: ...
    @property
    def timeouts(self) -> int: ...
    @property
    def errors_scored(self) -> str: ...
    @property
    def infra_failures(self) -> int: ...
    @property
    def cache_hits(self) -> int: ...
    @property
    def sandboxes_created(self) -> int: ...
    @property
    def episodes_per_second(self) -> float: ...
    def per_seed(self) -> Sequence[_SeedRow]: ...


def _num(x: float, digits: int = 4) -> str:
    if x is None or (isinstance(x, float) and math.isnan(x)):
        return "-"
    if math.isinf(x):
        return "∞"
    return f"{x:.{digits}g}"


def summary_table(results: Sequence[EvalResult], *, title: str = "Policy evaluation") -> Table:
    """One row per result: n, mean, std, stderr, the CI (its method in the header, or
    in each cell if they differ), failures kept apart (and, once the policy failed
    somewhere, how its failures count in the mean), speed."""
    conf = results[0].summary.confidence if results else 0.95
    methods = {r.ci_method for r in results}
    one_method = next(iter(methods)) if len(methods) == 1 else None
    scored = any(r.errors or r.timeouts for r in results)
    table = Table(title=title)
    ci_header = f"{conf:.0%} CI ({one_method})" if one_method else f"{conf:.0%} CI"
    for name, justify in (("policy", "left"), ("env", "left"), ("n", "right"),
                          ("mean", "right"), ("std", "right"), ("stderr", "right"),
                          (ci_header, "right"), ("errors", "right"), ("timeouts", "right"),
                          *([("errors scored", "left")] if scored else []),
                          ("infra", "right"), ("cached", "right"),
                          ("sandboxes", "right"), ("episodes/s", "right")):
        table.add_column(name, justify=justify)  # type: ignore[arg-type]
    for r in results:
        s = r.summary
        ci = f"[{_num(s.ci_low)}, {_num(s.ci_high)}]" if s.n >= 2 else "-"
        if one_method is None:
            ci = f"{ci} {s.method}"
        table.add_row(
            r.policy, str(r.env), str(s.n), _num(s.mean), _num(s.std), _num(s.stderr), ci,
            str(r.errors), str(r.timeouts), *([r.errors_scored] if scored else []),
            str(r.infra_failures), str(r.cache_hits),
            str(r.sandboxes_created), f"{r.episodes_per_second:.1f}",
        )
    return table


def per_seed_table(result: EvalResult) -> Table:
    table = Table(title=f"{result.policy} on {result.env}: per seed")
    for name in ("seed", "episodes", "mean", "min", "max", "failures"):
        table.add_column(name, justify="left" if name == "seed" else "right")
    for row in result.per_seed():
        table.add_row(str(row.seed), str(row.n), _num(row.mean), _num(row.minimum),
                      _num(row.maximum), str(row.failures))
    return table


def plot_returns(results: Sequence[EvalResult], path: str | Path) -> Path:
    """A histogram of each result's returns with its mean and CI band, as a PNG."""
    try:
        from matplotlib.backends.backend_agg import FigureCanvasAgg
        from matplotlib.figure import Figure
    except ImportError as exc:
        raise InvalidArgument(
            "drawing the return distribution needs matplotlib: pip install 'corral[rl]'") from exc
    path = Path(path)
    fig = Figure(figsize=(7.5, 4.2), dpi=110)
    FigureCanvasAgg(fig)
    ax = fig.add_subplot()
    values = [[e.episode_return for e in r.episodes if e.ok] for r in results]
    flat = [v for vs in values for v in vs]
    lo, hi = (min(flat), max(flat)) if flat else (0.0, 1.0)
    if hi <= lo:  # every return equal: one bar, centred
        lo, hi = lo - 0.5, hi + 0.5
    # Fixed-width bins over the whole range: a few distinct returns (CartPole's cap at
    # 500 and one early failure) must show as narrow spikes, not as one wide bar.
    bins = 30 if len(set(flat)) > 1 else 1
    for i, (r, vs) in enumerate(zip(results, values, strict=True)):
        color = f"C{i}"
        label = f"{r.policy}: {_num(r.summary.mean)} ± {_num(r.summary.halfwidth, 3)}"
        if vs:
            ax.hist(vs, bins=bins, range=(lo, hi), alpha=0.45,
                    color=color, label=label)
        if r.summary.n >= 2:
            ax.axvspan(r.summary.ci_low, r.summary.ci_high, color=color, alpha=0.15)
            ax.axvline(r.summary.mean, color=color, linewidth=1.5)
    env = str(results[0].env) if results else ""
    ax.set_title(f"Return distribution on {env} ({results[0].summary.confidence:.0%} CI shaded)"
                 if results else "Return distribution")
    ax.set_xlabel("episode return")
    ax.set_ylabel("episodes")
    if results:
        ax.legend(loc="best", fontsize="small")
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, format="png")
    return path
