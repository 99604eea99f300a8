"""Statistics: bootstrap confidence intervals over prompts (scipy)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Sequence

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


def bootstrap(values: Sequence[float] | np.ndarray, statistic: Callable = np.mean, confidence: float = 0.95,
              n_resamples: int = 1000, seed: int = 0) -> Estimate:
    """Percentile bootstrap CI of ``statistic`` over the examples in ``values``."""
    arr = np.asarray(values, dtype=float)
    value = float(statistic(arr))
    if arr.size < 2 or np.all(arr == arr[0]):
        return Estimate(value, value, value, int(arr.size))
    res = stats.bootstrap((arr,), statistic, confidence_level=confidence, n_resamples=n_resamples,
                          method="percentile", random_state=np.random.default_rng(seed))
    return Estimate(value, float(res.confidence_interval.low), float(res.confidence_interval.high), int(arr.size))


def bootstrap_ratio(num: Sequence[float], den: Sequence[float], confidence: float = 0.95,
                    n_resamples: int = 1000, seed: int = 0) -> Estimate:
    """CI of mean(num) / mean(den), resampling prompts jointly (e.g. faithfulness F(C)/F(M))."""
    a, b = np.asarray(num, dtype=float), np.asarray(den, dtype=float)
    value = float(a.mean() / b.mean()) if b.mean() else float("nan")
    rng = np.random.default_rng(seed)
    idx = rng.integers(0, a.size, size=(n_resamples, a.size))
    with np.errstate(divide="ignore", invalid="ignore"):
        ratios = a[idx].mean(1) / b[idx].mean(1)
    ratios = ratios[np.isfinite(ratios)]
    alpha = (1 - confidence) / 2
    low, high = (np.quantile(ratios, [alpha, 1 - alpha]) if ratios.size else (value, value))
    return Estimate(value, float(low), float(high), int(a.size))
