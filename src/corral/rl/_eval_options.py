"""The options of an evaluation, as one checked object (see :func:`corral.rl.evaluate`)."""

from __future__ import annotations

import itertools
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, fields, replace
from pathlib import Path
from typing import Any

from corral.errors import InvalidArgument
from corral.rl._cache import EpisodeCache
from corral.rl._progress import EpisodeProgress
from corral.rl.episodes import DEFAULT_CONCURRENCY, DEFAULT_RETRIES
from corral.rl.stats import CI_METHODS, DEFAULT_CONFIDENCE, summarize

DEFAULT_SEEDS = range(100)
DEFAULT_EPISODE_TIMEOUT_S = 60.0
DEFAULT_ADAPTIVE_BUDGET = 1000


@dataclass(frozen=True)
class EvalOptions:
    """Every option of :func:`~corral.rl.evaluate` but the policy and the env."""

    seeds: Iterable[int] | str | None = None
    episodes_per_seed: int = 1
    env_kwargs: Mapping[str, Any] | None = None
    image: str | None = None
    max_steps: int | None = None
    concurrency: int = DEFAULT_CONCURRENCY
    timeout: float = DEFAULT_EPISODE_TIMEOUT_S
    retries: int = DEFAULT_RETRIES
    episodes_per_sandbox: int = 1
    prestart: bool | None = None  # None: for gymnasium envs (corral.rl._eval_live)
    sandbox: Mapping[str, Any] | None = None
    adaptive: bool = False
    target_halfwidth: float | None = None
    budget_episodes: int | None = None
    budget_seconds: float | None = None
    batch_size: int | None = None
    confidence: float = DEFAULT_CONFIDENCE
    on_error: str | float = "raise"
    error_return: float | None = None
    ci_method: str | None = None
    bounds: tuple[float, float] | None = None
    cache: bool | str | Path | EpisodeCache | None = True
    png: str | Path | None = None
    progress: bool | EpisodeProgress = False
    label: str | None = None
    client: Any = None
    report: bool = True  # progress to the daemon's dashboard (PUT /v1/evals/{id})
    wandb: bool = True  # the result's statistics to an open W&B run (corral.rl._wandb)

    @classmethod
    def of(cls, options: Mapping[str, Any]) -> EvalOptions:
        """From keyword arguments; an unknown one is an :class:`InvalidArgument`."""
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(options) - known)
        if unknown:
            raise InvalidArgument(
                f"unknown evaluation option(s): {', '.join(unknown)}; "
                f"the options are: {', '.join(sorted(known))}"
            )
        return cls(**options)

    def checked(self, return_bounds: tuple[float, float] | None) -> EvalOptions:
        """Validated, with the defaults that depend on others filled in (the CI method
        from the bounds, the seeds and budgets of an adaptive run)."""
        for name, integer in (
            ("episodes_per_seed", True), ("concurrency", True), ("timeout", False),
            ("episodes_per_sandbox", True), ("target_halfwidth", False),
            ("budget_episodes", True), ("budget_seconds", False), ("batch_size", True),
        ):
            _check_positive(name, getattr(self, name), integer=integer)
        bounds = self.bounds if self.bounds is not None else return_bounds
        ci_method = self.ci_method
        if ci_method is None:  # the t interval is symmetric: it leaves a bounded range
            ci_method = "bootstrap" if bounds is not None else "t"
        if ci_method not in CI_METHODS:
            raise InvalidArgument(
                f"ci_method must be one of {', '.join(CI_METHODS)}, got {ci_method!r}"
            )
        summarize([], self.confidence, bounds=bounds)  # validates confidence and bounds
        if self.adaptive and self.target_halfwidth is None:
            raise InvalidArgument(
                "adaptive evaluation needs target_halfwidth (the CI half-width to reach)"
            )
        seeds = self.seeds
        if isinstance(seeds, str):
            seeds = parse_seeds(seeds)
        if seeds is None:
            seeds = itertools.count() if self.adaptive else DEFAULT_SEEDS
        budget_episodes = self.budget_episodes
        if (
            self.adaptive and budget_episodes is None and self.budget_seconds is None
            and not hasattr(seeds, "__len__")
        ):
            budget_episodes = DEFAULT_ADAPTIVE_BUDGET
        batch_size = self.batch_size
        if self.adaptive:
            batch_size = batch_size or 2 * self.concurrency * self.episodes_per_sandbox
        return replace(
            self, bounds=bounds, ci_method=ci_method, seeds=seeds,
            budget_episodes=budget_episodes, batch_size=batch_size,
        )


def parse_seeds(text: str) -> list[int]:
    """``"0-99"``, ``"1,5,9"`` or ``"0-9,100-109"`` as a list of seeds.

    >>> parse_seeds("0-3,10")
    [0, 1, 2, 3, 10]
    """
    seeds: list[int] = []
    for part in text.replace(" ", "").split(","):
        lo, sep, hi = part.partition("-")
        try:
            first, last = int(lo), int(hi) if sep else int(lo)
        except ValueError:
            raise InvalidArgument(
                f"seeds {text!r}: write ranges and numbers like 0-99 or 1,5,9") from None
        if first < 0 or last < first:
            raise InvalidArgument(f"seeds {text!r}: {part!r} is not an ascending range of seeds >= 0")
        seeds.extend(range(first, last + 1))
    return seeds


def _check_positive(name: str, value: Any, *, integer: bool = False) -> None:
    kind = int if integer else (int, float)
    if value is not None and (isinstance(value, bool) or not isinstance(value, kind) or value <= 0):
        raise InvalidArgument(
            f"{name} must be a positive {'integer' if integer else 'number'}, got {value!r}"
        )
