"""Intervals fit for their quantity, and the paper's scoring rules (exact binomial CIs, paired
differences, layer-matched random circuits, pruning relative to F(C), DCM's tie-break and lambda scale)."""

from __future__ import annotations

import numpy as np
import pytest
from scipy import stats as sps

from mechdiff.common.inference import proportion
from mechdiff.common.stats import paired_difference, pooled_proportion


def clopper_pearson(k: int, n: int, confidence: float = 0.95) -> tuple[float, float]:
    """The textbook Beta-quantile form, independent of scipy's binomtest."""
    a = (1 - confidence) / 2
    low = 0.0 if k == 0 else sps.beta.ppf(a, k, n - k + 1)
    high = 1.0 if k == n else sps.beta.ppf(1 - a, k + 1, n - k)
    return low, high


@pytest.mark.parametrize("k,n", [(0, 40), (3, 40), (20, 40), (40, 40), (1, 1)])
def test_proportion_is_clopper_pearson(k, n):
    est = proportion([1.0] * k + [0.0] * (n - k))
    low, high = clopper_pearson(k, n)
    assert est.value == k / n and est.n_rows == est.n_items == n
    # float64 on both sides (scipy's beta quantiles), not a float32 result
    assert est.low == pytest.approx(low, abs=1e-9) and est.high == pytest.approx(high, abs=1e-9)


def test_zero_successes_do_not_collapse():
    est = proportion(np.zeros(40))
    assert est.low == 0.0 and 0.08 < est.high < 0.1  # 0/40: the upper bound is about 0.088


def test_proportion_refuses_non_binary_and_empty():
    with pytest.raises(ValueError, match="0/1 outcome"):
        proportion([0.5, 1.0])
    with pytest.raises(ValueError, match="at least one"):
        proportion([])


def test_paired_difference_uses_the_pairing():
    rng = np.random.default_rng(0)
    base = rng.normal(size=200)
    a, b = base + 0.1, base  # a constant shift: unpaired CIs overlap, the paired one is a point
    d = paired_difference(a, b)
    assert d.value == pytest.approx(0.1) and d.low == pytest.approx(0.1) and d.high == pytest.approx(0.1)
    noisy = paired_difference(base + 0.1 + rng.normal(scale=0.05, size=200), base)
    assert 0.08 < noisy.low < 0.1 < noisy.high < 0.12
    with pytest.raises(ValueError, match="same prompts"):
        paired_difference([1, 2], [1, 2, 3])


def test_pooled_proportion_counts_the_spread_between_draws():
    """Draws that either all work or all fail: averaged per prompt first, every prompt scores the same
    and a bootstrap over prompts would give a point; resampling the draws shows the uncertainty."""
    draws = np.array([[1.0] * 50] * 6 + [[0.0] * 50] * 14)  # 6 of 20 random circuits work
    est = pooled_proportion(draws)
    assert est.value == pytest.approx(0.3) and est.n_rows == 50
    assert est.low < 0.15 and est.high > 0.45
    same = pooled_proportion(np.tile(np.r_[np.ones(15), np.zeros(35)], (20, 1)))
    assert same.value == pytest.approx(0.3) and (same.high - same.low) < (est.high - est.low)


def test_pooled_proportion_of_all_zeros_keeps_an_exact_upper_bound():
    zeros = pooled_proportion([[0.0] * 200] * 5)
    assert (zeros.value, zeros.low, zeros.n_rows) == (0.0, 0.0, 200)
    assert zeros.high == pytest.approx(proportion([0.0] * 200).high) and 0.017 < zeros.high < 0.019
    ones = pooled_proportion([[1.0] * 40] * 3)
    assert ones.high == 1.0 and ones.low == pytest.approx(proportion([1.0] * 40).low) and ones.low < 0.92
