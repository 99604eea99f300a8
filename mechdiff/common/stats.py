"""Statistics: bootstrap confidence intervals over prompts (scipy)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, Mapping, Sequence

import numpy as np
from scipy import stats


@dataclass(frozen=True)
class Estimate:
    """A figure with its bootstrap confidence interval."""

    value: float
    low: float
    high: float
    n: int

    def __str__(self) -> str:
        return f"{self.value:.3f} [{self.low:.3f}, {self.high:.3f}]"

    def to_dict(self) -> dict:
        return {"value": self.value, "low": self.low, "high": self.high, "n": self.n}

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> "Estimate":
        """An estimate back from its :meth:`to_dict` (as stage records keep it)."""
        return cls(d["value"], d["low"], d["high"], d["n"])


def bootstrap(
    values: Sequence[float] | np.ndarray,
    statistic: Callable = np.mean,
    confidence: float = 0.95,
    n_resamples: int = 1000,
    seed: int = 0,
) -> Estimate:
    """Percentile bootstrap CI of ``statistic`` over the examples in ``values``."""
    arr = np.asarray(values, dtype=float)
    value = float(statistic(arr))
    if arr.size < 2 or np.all(arr == arr[0]):
        return Estimate(value, value, value, int(arr.size))
    res = stats.bootstrap(
        (arr,),
        statistic,
        confidence_level=confidence,
        n_resamples=n_resamples,
        method="percentile",
        random_state=np.random.default_rng(seed),
    )
    return Estimate(value, float(res.confidence_interval.low), float(res.confidence_interval.high), int(arr.size))


def bootstrap_ratio(
    num: Sequence[float], den: Sequence[float], confidence: float = 0.95, n_resamples: int = 1000, seed: int = 0
) -> Estimate:
    """CI of mean(num) / mean(den), resampling prompts jointly (e.g. faithfulness F(C)/F(M))."""
    a, b = np.asarray(num, dtype=float), np.asarray(den, dtype=float)
    value = float(a.mean() / b.mean()) if b.mean() else float("nan")
    rng = np.random.default_rng(seed)
    idx = rng.integers(0, a.size, size=(n_resamples, a.size))
    with np.errstate(divide="ignore", invalid="ignore"):
        ratios = a[idx].mean(1) / b[idx].mean(1)
    ratios = ratios[np.isfinite(ratios)]
    alpha = (1 - confidence) / 2
    low, high = np.quantile(ratios, [alpha, 1 - alpha]) if ratios.size else (value, value)
    return Estimate(value, float(low), float(high), int(a.size))


def proportion(successes: Sequence[float] | np.ndarray, confidence: float = 0.95) -> Estimate:
    """Exact (Clopper-Pearson) CI of a proportion from per-example 0/1 outcomes.

    Unlike a bootstrap it does not collapse to a point when every outcome is equal: 0 of 40 has
    an upper bound near 0.09."""
    arr = np.asarray(successes, dtype=float)
    if arr.size == 0:
        raise ValueError("a proportion needs at least one outcome")
    if not np.all((arr == 0) | (arr == 1)):
        raise ValueError("proportion() takes 0/1 outcomes; use bootstrap() for other values")
    k, n = int(arr.sum()), int(arr.size)
    ci = stats.binomtest(k, n).proportion_ci(confidence_level=confidence, method="exact")
    return Estimate(k / n, float(ci.low), float(ci.high), n)


def pooled_mean(
    draws: Sequence[Sequence[float]], confidence: float = 0.95, n_resamples: int = 1000, seed: int = 0
) -> Estimate:
    """Mean over several draws (seeds) scored on the same prompts, ``"draw prompt"``, with a two-stage
    percentile bootstrap CI: each resample draws the draws, then the prompts, with replacement, so the
    spread between draws is not ignored. A difference of two interventions on the same draws and prompts
    (``a - b``) gives the paired pooled comparison."""
    arr = np.asarray(draws, dtype=float)  # "draw prompt"
    if arr.ndim != 2 or arr.size == 0:
        raise ValueError("pooled_mean() takes a draws x prompts array")
    rng = np.random.default_rng(seed)
    n_d, n_p = arr.shape
    means = [arr[rng.integers(0, n_d, n_d)][:, rng.integers(0, n_p, n_p)].mean() for _ in range(n_resamples)]
    alpha = (1 - confidence) / 2
    low, high = np.quantile(means, [alpha, 1 - alpha])
    return Estimate(float(arr.mean()), float(low), float(high), int(n_p))


def pooled_proportion(draws: Sequence[Sequence[float]], confidence: float = 0.95) -> Estimate:
    """Mean outcome over several random draws on the same prompts, with a CI that resamples prompts
    and draws (:func:`pooled_mean`), so the spread between draws is not ignored. When every
    outcome is the same 0 or 1 the bootstrap would collapse to a point: the exact interval of one draw's
    prompts is returned instead (0 of 200 prompts: upper bound 0.018)."""
    arr = np.asarray(draws, dtype=float)  # "draw prompt"
    if arr.ndim != 2 or arr.size == 0:
        raise ValueError("pooled_proportion() takes a draws x prompts array")
    if np.all(arr == arr.flat[0]) and arr.flat[0] in (0.0, 1.0):
        return proportion(arr[0], confidence)
    return pooled_mean(arr, confidence)


def paired_difference(
    a: Sequence[float], b: Sequence[float], confidence: float = 0.95, n_resamples: int = 1000, seed: int = 0
) -> Estimate:
    """CI of mean(a - b) for two interventions scored on the same prompts (paired bootstrap)."""
    x, y = np.asarray(a, dtype=float), np.asarray(b, dtype=float)
    if x.shape != y.shape:
        raise ValueError(f"paired values need the same prompts; got {x.shape} and {y.shape}")
    return bootstrap(x - y, confidence=confidence, n_resamples=n_resamples, seed=seed)


def paired_ratio_difference(
    num_a: Sequence[float],
    den_a: Sequence[float],
    num_b: Sequence[float],
    den_b: Sequence[float],
    confidence: float = 0.95,
    n_resamples: int = 1000,
    seed: int = 0,
) -> Estimate:
    """CI of mean(num_a)/mean(den_a) - mean(num_b)/mean(den_b), two ratios on the same prompts (e.g. one circuit's
    faithfulness in two models), every resample drawing the same prompts for all four (paired bootstrap)."""
    arrs = [np.asarray(v, dtype=float) for v in (num_a, den_a, num_b, den_b)]
    if len({a.shape for a in arrs}) != 1:
        raise ValueError(f"paired ratios need the same prompts; got shapes {[a.shape for a in arrs]}")
    na, da, nb, db = arrs

    def diff(m_na, m_da, m_nb, m_db):
        with np.errstate(divide="ignore", invalid="ignore"):
            return np.asarray(m_na) / np.asarray(m_da) - np.asarray(m_nb) / np.asarray(m_db)

    value = float(diff(na.mean(), da.mean(), nb.mean(), db.mean()))
    idx = np.random.default_rng(seed).integers(0, na.size, size=(n_resamples, na.size))
    draws = diff(na[idx].mean(1), da[idx].mean(1), nb[idx].mean(1), db[idx].mean(1))
    draws = draws[np.isfinite(draws)]
    alpha = (1 - confidence) / 2
    low, high = np.quantile(draws, [alpha, 1 - alpha]) if draws.size else (value, value)
    return Estimate(value, float(low), float(high), int(na.size))


def mean_estimate(values: Sequence[float] | np.ndarray) -> Estimate:
    """The mean with the interval fit for it: exact binomial for 0/1 outcomes, bootstrap otherwise
    (e.g. per-prompt means over random draws)."""
    arr = np.asarray(values, dtype=float)
    return proportion(arr) if np.all((arr == 0) | (arr == 1)) else bootstrap(arr)
