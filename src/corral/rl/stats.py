"""Summary statistics for episode returns: mean, spread, and a confidence interval.

Evaluation reports how sure it is, not only a mean. Two intervals (``method``):

- ``"t"``: ``mean ± t(1 - (1 - confidence) / 2, n - 1) · std / √n``. The t quantile
  is computed here (the regularised incomplete beta function by its continued
  fraction, inverted by bisection), because scipy is not a dependency; it agrees with
  tables to about 1e-9. It is symmetric, so for returns piled up at a bound (CartPole's
  500) it reaches past the bound: with ``bounds`` it is clamped to them.
- ``"bootstrap"``: the bias-corrected and accelerated (BCa) bootstrap of the mean,
  ``resamples`` resamples drawn by numpy's generator seeded with ``seed`` (so the same
  returns give the same interval). Its ends are quantiles of resampled means, so it
  never leaves the range of the returns themselves: the interval for bounded returns.

>>> s = summarize([1.0, 2.0, 3.0, 4.0])
>>> round(s.mean, 3), round(s.halfwidth, 3)
(2.5, 2.054)
>>> round(t_quantile(0.975, 10), 3)
2.228
"""

from __future__ import annotations

import functools
import math
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from statistics import NormalDist

from corral.errors import InvalidArgument

DEFAULT_CONFIDENCE = 0.95
CI_METHODS = ("t", "bootstrap")
BOOTSTRAP_RESAMPLES = 10_000
BOOTSTRAP_SEED = 0
_BOOTSTRAP_CHUNK = 1_000_000  # resampled values drawn at once (bounded memory)

_CF_MAX_ITER = 300
_CF_EPS = 1e-15
_TINY = 1e-300
_BISECT_ITER = 200


def _betacf(a: float, b: float, x: float) -> float:
    """The continued fraction of the incomplete beta function (modified Lentz)."""
    qab, qap, qam = a + b, a + 1.0, a - 1.0
    c, d = 1.0, 1.0 - qab * x / qap
    d = 1.0 / (d if abs(d) > _TINY else _TINY)
    h = d
    for m in range(1, _CF_MAX_ITER + 1):
        m2 = 2 * m
        for num in (m * (b - m) * x / ((qam + m2) * (a + m2)),
                    -(a + m) * (qab + m) * x / ((a + m2) * (qap + m2))):
            d = 1.0 + num * d
            d = 1.0 / (d if abs(d) > _TINY else _TINY)
            c = 1.0 + num / c
            c = c if abs(c) > _TINY else _TINY
            h *= d * c
        if abs(d * c - 1.0) < _CF_EPS:
            break
    return h


def betainc(a: float, b: float, x: float) -> float:
    """The regularised incomplete beta function ``I_x(a, b)``, for ``0 <= x <= 1``."""
    if x <= 0.0:
        return 0.0
    if x >= 1.0:
        return 1.0
    log_front = (math.lgamma(a + b) - math.lgamma(a) - math.lgamma(b)
                 + a * math.log(x) + b * math.log1p(-x))
    # The continued fraction converges fast only below its mean; use symmetry above.
    if x < (a + 1.0) / (a + b + 2.0):
        return math.exp(log_front) * _betacf(a, b, x) / a
    return 1.0 - math.exp(log_front) * _betacf(b, a, 1.0 - x) / b


def t_cdf(t: float, df: float) -> float:
    """P(T <= t) for Student's t distribution with ``df`` degrees of freedom."""
    if df <= 0:
        raise InvalidArgument(f"degrees of freedom must be > 0, got {df}")
    tail = 0.5 * betainc(df / 2.0, 0.5, df / (df + t * t))
    return 1.0 - tail if t >= 0 else tail


def t_quantile(p: float, df: float) -> float:
    """The ``p`` quantile of Student's t with ``df`` degrees of freedom (inverse of
    :func:`t_cdf`), e.g. ``t_quantile(0.975, 29)`` ≈ 2.045."""
    if not 0.0 < p < 1.0:
        raise InvalidArgument(f"p must be strictly between 0 and 1, got {p}")
    if df <= 0:
        raise InvalidArgument(f"degrees of freedom must be > 0, got {df}")
    if p < 0.5:
        return -t_quantile(1.0 - p, df)
    return _t_quantile(float(p), float(df))


# Remembered, and found by Newton's method kept inside a bracket (bisection where a step
# would leave it): a live evaluation asks for (confidence, n - 1) after every finished
# sandbox, and plain bisection cost ~40 incomplete beta functions (2-4 ms) each time.
@functools.lru_cache(maxsize=4096)
def _t_quantile(p: float, df: float) -> float:
    if p == 0.5:
        return 0.0
    lo, hi = 0.0, 1.0
    while t_cdf(hi, df) < p:  # bracket: heavy tails at df=1 need a wide one
        lo, hi = hi, hi * 2.0
        if hi > 1e300:
            return math.inf
    log_norm = math.lgamma((df + 1.0) / 2.0) - math.lgamma(df / 2.0) - 0.5 * math.log(df * math.pi)
    # t's tails are heavier than the normal's: its quantile is at least the normal one
    x = min(max(NormalDist().inv_cdf(p), lo), hi)
    for _ in range(_BISECT_ITER):
        f = t_cdf(x, df) - p
        if f < 0:
            lo = x
        else:
            hi = x
        density = math.exp(log_norm - (df + 1.0) / 2.0 * math.log1p(x * x / df))
        step = f / density if density > 0 else math.inf
        nxt = x - step
        if not lo < nxt < hi:
            nxt = 0.5 * (lo + hi)
        if abs(nxt - x) <= 1e-12 * max(1.0, abs(x)) or hi - lo <= 1e-12 * max(1.0, hi):
            return nxt
        x = nxt
    return 0.5 * (lo + hi)


@dataclass(frozen=True)
class Summary:
    """Mean and spread of ``n`` values, with a two-sided confidence interval.

    ``std`` is the sample standard deviation (n - 1 in the denominator), ``stderr``
    ``std / √n``; ``halfwidth`` is half the interval's width (``inf`` below 2 values:
    one value says nothing about the spread, unless ``bounds`` cap it). ``method`` is
    the interval's kind (``"t"`` or ``"bootstrap"``), ``bounds`` the range the values
    were known to lie in (the interval never leaves it), or ``None``.
    """

    n: int
    mean: float
    std: float
    stderr: float
    ci_low: float
    ci_high: float
    confidence: float
    minimum: float
    maximum: float
    method: str = "t"
    bounds: tuple[float, float] | None = None

    @property
    def halfwidth(self) -> float:
        return (self.ci_high - self.ci_low) / 2.0

    def to_dict(self) -> dict[str, float | int]:
        return {
            "n": self.n, "mean": self.mean, "std": self.std, "stderr": self.stderr,
            "ci_low": self.ci_low, "ci_high": self.ci_high, "halfwidth": self.halfwidth,
            "confidence": self.confidence, "min": self.minimum, "max": self.maximum,
            "ci_method": self.method, "bounds": list(self.bounds) if self.bounds else None,
        }

    def __str__(self) -> str:
        if self.n == 0:
            return "no values"
        return (f"{self.mean:.4g} ± {self.halfwidth:.3g} ({self.confidence:.0%} CI, "
                f"n={self.n})")


def _check_bounds(bounds: tuple[float, float] | None) -> tuple[float, float] | None:
    if bounds is None:
        return None
    try:
        lo, hi = (float(b) for b in bounds)
    except (TypeError, ValueError):
        raise InvalidArgument(f"bounds must be (lowest, highest), got {bounds!r}") from None
    if not (math.isfinite(lo) and math.isfinite(hi) and lo < hi):
        raise InvalidArgument(f"bounds must be two finite numbers, lowest first, got {bounds!r}")
    return (lo, hi)


def bootstrap_interval(
    xs: list[float], confidence: float, *, resamples: int = BOOTSTRAP_RESAMPLES,
    seed: int = BOOTSTRAP_SEED,
) -> tuple[float, float]:
    """The BCa bootstrap interval of the mean of ``xs`` (at least 2 values): seeded,
    so reproducible (whatever the order of ``xs``); within ``[min(xs), max(xs)]`` by
    construction."""
    try:
        import numpy as np
    except ImportError as exc:
        raise InvalidArgument("the bootstrap interval needs numpy (pip install 'corral[rl]'); "
                              "or use method='t'") from exc
    x = np.sort(np.asarray(xs, dtype=np.float64))  # the same values in any order: the same draws
    n = len(x)
    rng = np.random.default_rng(seed)
    chunk = max(1, _BOOTSTRAP_CHUNK // n)
    boot = np.concatenate([
        x[rng.integers(0, n, size=(min(chunk, resamples - done), n))].mean(axis=1)
        for done in range(0, resamples, chunk)])
    mean = float(x.mean())
    alpha = (1.0 - confidence) / 2.0
    levels = [alpha, 1.0 - alpha]
    # Bias correction: where the mean falls among the resampled means (ties count half).
    below = (np.count_nonzero(boot < mean) + 0.5 * np.count_nonzero(boot == mean)) / resamples
    if 0.0 < below < 1.0:
        normal = NormalDist()
        z0 = normal.inv_cdf(below)
        # Acceleration, from the jackknife (leave-one-out) means.
        jack = (x.sum() - x) / (n - 1)
        d = jack.mean() - jack
        ss = float((d * d).sum())
        a = float((d ** 3).sum()) / (6.0 * ss ** 1.5) if ss > 0 else 0.0
        adjusted = []
        for level in levels:
            z = z0 + normal.inv_cdf(level)
            adjusted.append(normal.cdf(z0 + z / (1.0 - a * z)))
        levels = adjusted
    lo, hi = np.quantile(boot, levels)
    return float(lo), float(hi)


def summarize(
    values: Iterable[float], confidence: float = DEFAULT_CONFIDENCE, *, method: str = "t",
    bounds: tuple[float, float] | None = None, resamples: int = BOOTSTRAP_RESAMPLES,
    seed: int = BOOTSTRAP_SEED,
) -> Summary:
    """:class:`Summary` of ``values`` with an interval at ``confidence``: Student-t
    (``method="t"``) or BCa bootstrap (``"bootstrap"``, ``resamples`` draws seeded with
    ``seed``). With ``bounds=(lo, hi)``, the range the values can take, the interval
    is clamped to it (widened to include any value outside it)."""
    if not 0.0 < confidence < 1.0:
        raise InvalidArgument(f"confidence must be strictly between 0 and 1, got {confidence}")
    if method not in CI_METHODS:
        raise InvalidArgument(f"ci_method must be one of {', '.join(CI_METHODS)}, got {method!r}")
    if isinstance(resamples, bool) or not isinstance(resamples, int) or resamples < 100:
        raise InvalidArgument(f"resamples must be an integer >= 100, got {resamples!r}")
    bounds = _check_bounds(bounds)
    xs = [float(v) for v in values]
    n = len(xs)
    if n == 0:
        nan = math.nan
        return Summary(0, nan, nan, nan, nan, nan, confidence, nan, nan, method, bounds)
    mean = math.fsum(xs) / n
    lo_x, hi_x = min(xs), max(xs)
    if n == 1:
        std, stderr, low, high = 0.0, math.inf, -math.inf, math.inf
    else:
        std = math.sqrt(math.fsum((x - mean) ** 2 for x in xs) / (n - 1))
        stderr = std / math.sqrt(n)
        if method == "bootstrap":
            low, high = bootstrap_interval(xs, confidence, resamples=resamples, seed=seed)
        else:
            half = t_quantile(1.0 - (1.0 - confidence) / 2.0, n - 1) * stderr
            low, high = mean - half, mean + half
    if bounds is not None:
        low, high = max(low, min(bounds[0], lo_x)), min(high, max(bounds[1], hi_x))
    return Summary(n, mean, std, stderr, low, high, confidence, lo_x, hi_x, method, bounds)


def paired_difference(
    a: Mapping[object, float], b: Mapping[object, float], confidence: float = DEFAULT_CONFIDENCE
) -> Summary:
    """:class:`Summary` of ``a[k] - b[k]`` over the keys both have (e.g. ``(seed,
    episode)``): with common seeds, the paired interval is much tighter than the two
    separate ones, because the seed's own difficulty cancels out."""
    keys = [k for k in a if k in b]
    return summarize((a[k] - b[k] for k in keys), confidence)
