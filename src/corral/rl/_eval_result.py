"""What an evaluation returns: the episodes, their statistics, and views of them."""

from __future__ import annotations

import math
from collections import Counter, defaultdict
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from corral.errors import CorralError
from corral.rl._policy import EnvSpec
from corral.rl.episodes import EpisodeStatus
from corral.rl.stats import Summary, paired_difference

Key = tuple[int, int]  # (seed, episode index k)
ON_ERROR = ("raise", "exclude", "zero")
"""How an episode the policy failed (an error or a timeout) is scored: ``"raise"``
(the default) refuses to give a mean, ``"exclude"`` leaves it out, ``"zero"`` scores it
0 (a number scores it as that return). Infrastructure failures are never scored."""


def error_scoring(on_error: str | float, error_return: float | None = None) -> tuple[str, float | None]:
    """``(mode, return errors score as)`` from ``on_error`` and the older
    ``error_return`` (a number: the same as ``on_error=number``)."""
    from corral.errors import InvalidArgument

    if error_return is not None:
        if on_error not in ("raise", error_return):
            raise InvalidArgument("give on_error or error_return, not both")
        on_error = error_return
    if isinstance(on_error, (int, float)) and not isinstance(on_error, bool):
        if not math.isfinite(on_error):
            raise InvalidArgument(f"on_error: a return must be a finite number, got {on_error!r}")
        return ("zero", 0.0) if on_error == 0 else ("score", float(on_error))
    if on_error not in ON_ERROR:
        raise InvalidArgument(f"on_error must be one of {', '.join(ON_ERROR)} or a number "
                              f"(the return to score a failed episode as), got {on_error!r}")
    return on_error, (0.0 if on_error == "zero" else None)


class EpisodeErrors(CorralError):
    """The policy failed (raised or timed out) in some episodes and ``on_error="raise"``
    (the default): no mean is given, since leaving those episodes out would inflate it.
    ``episodes`` are all the evaluated episodes; ``details`` holds the counts."""

    code, status = "policy_episodes_failed", 422

    def __init__(self, message: str, *, details: dict[str, Any] | None = None,
                 episodes: list[EvalEpisode] | None = None) -> None:
        super().__init__(message, details=details)
        self.episodes = list(episodes or [])


def eval_tag(policy_hash: str) -> str:
    return f"eval={policy_hash[:12]}"


def parse_records(stdout: str) -> dict[Key, dict[str, Any]]:
    """The runner's records in ``stdout`` (its record channel), by ``(seed, k)``.

    A line that is not a well-formed record is skipped, and a key that got two
    records keeps neither: an error record in its place. The policy's own prints never
    reach this channel (``_eval_runner.take_stdout``); two records for one episode
    mean something in the runner's process wrote to it on purpose."""
    import json

    records: dict[Key, dict[str, Any]] = {}
    twice: set[Key] = set()
    for line in stdout.splitlines():
        try:
            rec = json.loads(line)
            key = (int(rec["seed"]), int(rec["k"]))
            if "error" not in rec and not math.isfinite(float(rec["return"])):
                continue
        except (ValueError, KeyError, TypeError, OverflowError):
            continue
        if key in records:
            twice.add(key)
        records[key] = rec
    for seed, k in twice:
        records[(seed, k)] = {"seed": seed, "k": k, "where": "runner", "error":
                              "two records for one episode: something in the runner's "
                              "process wrote to its record channel; neither is scored"}
    return records


@dataclass(frozen=True)
class EvalEpisode:
    """One evaluated episode: ``status`` as in :class:`~corral.rl.EpisodeStatus`;
    ``episode_return`` is set only when it is ``ok``. ``cached``: from the cache, no
    sandbox ran."""

    seed: int
    k: int
    status: str
    episode_return: float | None = None
    steps: int | None = None
    digest: str | None = None
    terminated: bool | None = None
    truncated: bool | None = None
    error: str | None = None
    sandbox_id: str | None = None
    attempts: int = 0
    cached: bool = False

    @property
    def ok(self) -> bool:
        return self.status == EpisodeStatus.OK.value

    @property
    def key(self) -> Key:
        return (self.seed, self.k)

    def to_dict(self) -> dict[str, Any]:
        return {"seed": self.seed, "k": self.k, "status": self.status,
                "return": self.episode_return, "steps": self.steps, "digest": self.digest,
                "terminated": self.terminated, "truncated": self.truncated,
                "error": self.error, "sandbox_id": self.sandbox_id,
                "attempts": self.attempts, "cached": self.cached}

    @classmethod
    def from_record(cls, rec: Mapping[str, Any], **extra: Any) -> EvalEpisode:
        """From the in-sandbox runner's record (or a cached one)."""
        if "error" in rec and rec.get("timed_out") is True:  # the runner's own clock
            return cls(int(rec["seed"]), int(rec["k"]), EpisodeStatus.TIMEOUT.value,
                       steps=rec.get("steps"), digest=rec.get("digest"), error=str(rec["error"]),
                       **extra)
        if "error" in rec:
            return cls(int(rec["seed"]), int(rec["k"]), EpisodeStatus.ERROR.value,
                       steps=rec.get("steps"), digest=rec.get("digest"),
                       error=f"{rec['error']} (in {rec.get('where')})", **extra)
        return cls(int(rec["seed"]), int(rec["k"]), EpisodeStatus.OK.value,
                   float(rec["return"]), rec.get("steps"), rec.get("digest"),
                   rec.get("terminated"), rec.get("truncated"), **extra)


@dataclass(frozen=True)
class SeedStats:
    seed: int
    n: int
    mean: float
    minimum: float
    maximum: float
    failures: int


@dataclass
class EvalResult:
    """What :func:`evaluate` found. ``summary`` (mean, std, stderr, CI) covers the
    ``ok`` episodes plus errors and timeouts scored as ``error_return`` (``on_error``:
    ``"zero"`` or ``"score"``; ``"exclude"`` leaves them out, ``"raise"`` means there
    were none); infrastructure failures are never in it, only in ``infra_failures``.
    ``ci_method`` is the interval's kind (``"t"`` or ``"bootstrap"``);
    ``deterministic`` whether a re-run episode retraced its trajectory (``None``: not
    checked, as with ``cache=False``)."""

    policy: str
    policy_hash: str
    env: EnvSpec
    episodes: list[EvalEpisode]
    summary: Summary
    error_return: float | None
    stop_reason: str
    elapsed_s: float
    sandboxes_created: int
    cache_hits: int
    target_halfwidth: float | None = None
    on_error: str = "exclude"
    deterministic: bool | None = None
    counts: Counter[str] = field(default_factory=Counter)

    def __post_init__(self) -> None:
        self.counts = Counter(e.status for e in self.episodes)

    mean = property(lambda self: self.summary.mean)
    std = property(lambda self: self.summary.std)
    stderr = property(lambda self: self.summary.stderr)
    halfwidth = property(lambda self: self.summary.halfwidth)
    n = property(lambda self: self.summary.n, doc="Episodes in the statistics.")

    @property
    def ci_method(self) -> str:
        return self.summary.method

    @property
    def errors_scored(self) -> str:
        """How failed episodes count, in words: ``"excluded"``, ``"as 0"``, ..."""
        if self.error_return is not None:
            return f"as {self.error_return:g}"
        return "excluded" if self.on_error == "exclude" else "none failed"

    @property
    def tag(self) -> str:
        """The tag every sandbox of this policy's evaluations carries."""
        return eval_tag(self.policy_hash)

    @property
    def ci(self) -> tuple[float, float]:
        return (self.summary.ci_low, self.summary.ci_high)

    @property
    def errors(self) -> int:
        return self.counts[EpisodeStatus.ERROR.value]

    @property
    def timeouts(self) -> int:
        return self.counts[EpisodeStatus.TIMEOUT.value]

    @property
    def infra_failures(self) -> int:
        return self.counts[EpisodeStatus.INFRA_ERROR.value]

    @property
    def episodes_per_second(self) -> float:
        return len(self.episodes) / self.elapsed_s if self.elapsed_s > 0 else math.inf

    def returns(self) -> dict[Key, float]:
        """``{(seed, k): return}`` of the ``ok`` episodes."""
        return {e.key: e.episode_return for e in self.episodes if e.ok}  # type: ignore[misc]

    def per_seed(self) -> list[SeedStats]:
        by_seed: dict[int, list[EvalEpisode]] = defaultdict(list)
        for e in self.episodes:
            by_seed[e.seed].append(e)
        rows = []
        for seed, eps in by_seed.items():
            vals = [e.episode_return for e in eps if e.ok]
            nan = math.nan
            rows.append(SeedStats(seed, len(vals), sum(vals) / len(vals) if vals else nan,
                                  min(vals, default=nan), max(vals, default=nan),
                                  len(eps) - len(vals)))
        return rows

    def compare(self, other: EvalResult) -> Summary:
        """This policy's return minus ``other``'s, paired by (seed, episode)."""
        return paired_difference(self.returns(), other.returns(), self.summary.confidence)

    def table(self, *, title: str = "Policy evaluation") -> Any:
        """A rich table of the summary (print it with a rich console)."""
        from corral.rl._report import summary_table

        return summary_table([self], title=title)

    def per_seed_table(self) -> Any:
        from corral.rl._report import per_seed_table

        return per_seed_table(self)

    def save_png(self, path: str | Path) -> Path:
        """Draw the return distribution (needs matplotlib, in the ``rl`` extra)."""
        from corral.rl._report import plot_returns

        return plot_returns([self], path)

    def to_dict(self) -> dict[str, Any]:
        return {
            "policy": self.policy, "policy_hash": self.policy_hash, "env": self.env.to_dict(),
            "summary": self.summary.to_dict(), "error_return": self.error_return,
            "on_error": self.on_error, "ci_method": self.ci_method,
            "deterministic": self.deterministic,
            "counts": dict(self.counts), "errors": self.errors, "timeouts": self.timeouts,
            "infra_failures": self.infra_failures, "cache_hits": self.cache_hits,
            "sandboxes_created": self.sandboxes_created, "elapsed_s": self.elapsed_s,
            "stop_reason": self.stop_reason, "target_halfwidth": self.target_halfwidth,
            "per_seed": [vars(s) for s in self.per_seed()],
            "episodes": [e.to_dict() for e in self.episodes],
        }
