"""Percentile bootstraps over rows (scipy), the figures of the stages written before the inference layer.

Every figure is an `Interval` (each row its own item); a proportion's exact
interval is `mechdiff.common.inference.proportion`, the one rule for it.
"""

from __future__ import annotations

from typing import Callable, Sequence

import numpy as np
from scipy import stats

from .inference import Interval, proportion

PERCENTILE = "percentile bootstrap over rows"


def _over_rows(value: float, low: float, high: float, n: int, method: str) -> Interval:
    """An interval over ``n`` rows, each row its own item."""
    return Interval(value, low, high, n, n, method)


def bootstrap(
    values: Sequence[float] | np.ndarray,
    statistic: Callable = np.mean,
    confidence: float = 0.95,
    n_resamples: int = 1000,
    seed: int = 0,
) -> Interval:
    """Percentile bootstrap CI of ``statistic`` over the examples in ``values``."""
    arr = np.asarray(values, dtype=float)
    value = float(statistic(arr))
    if arr.size < 2 or np.all(arr == arr[0]):
        return _over_rows(value, value, value, int(arr.size), PERCENTILE)
    res = stats.bootstrap(
        (arr,),
        statistic,
        confidence_level=confidence,
        n_resamples=n_resamples,
        method="percentile",
        random_state=np.random.default_rng(seed),
    )
    low, high = float(res.confidence_interval.low), float(res.confidence_interval.high)
    return _over_rows(value, low, high, int(arr.size), PERCENTILE)


def bootstrap_ratio(
    num: Sequence[float], den: Sequence[float], confidence: float = 0.95, n_resamples: int = 1000, seed: int = 0
) -> Interval:
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
    return _over_rows(value, float(low), float(high), int(a.size), f"{PERCENTILE} (ratio of means)")


def pooled_mean(
    draws: Sequence[Sequence[float]], confidence: float = 0.95, n_resamples: int = 1000, seed: int = 0
) -> Interval:
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
    return _over_rows(float(arr.mean()), float(low), float(high), int(n_p), "percentile bootstrap over draws and rows")


def pooled_proportion(draws: Sequence[Sequence[float]], confidence: float = 0.95) -> Interval:
    """Mean outcome over several random draws on the same prompts, with a CI that resamples prompts
    and draws (`pooled_mean`), so the spread between draws is not ignored. When every
    outcome is the same 0 or 1 the bootstrap would collapse to a point: the exact interval of one draw's
    prompts is returned instead (0 of 200 prompts: upper bound 0.018)."""
    arr = np.asarray(draws, dtype=float)  # "draw prompt"
    if arr.ndim != 2 or arr.size == 0:
        raise ValueError("pooled_proportion() takes a draws x prompts array")
    if np.all(arr == arr.flat[0]) and arr.flat[0] in (0.0, 1.0):
        return proportion(arr[0], confidence=confidence)
    return pooled_mean(arr, confidence)


def paired_difference(
    a: Sequence[float], b: Sequence[float], confidence: float = 0.95, n_resamples: int = 1000, seed: int = 0
) -> Interval:
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
) -> Interval:
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
    return _over_rows(value, float(low), float(high), int(na.size), f"paired {PERCENTILE} (ratio difference)")


def mean_estimate(values: Sequence[float] | np.ndarray) -> Interval:
    """The mean with the interval fit for it: exact binomial for 0/1 outcomes, bootstrap otherwise
    (e.g. per-prompt means over random draws)."""
    arr = np.asarray(values, dtype=float)
    return proportion(arr) if np.all((arr == 0) | (arr == 1)) else bootstrap(arr)
