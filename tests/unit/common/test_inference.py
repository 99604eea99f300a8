"""The inference layer against simulation and against each rule's definition (docs/inference.md). Each test
names the old row-level rule it replaces where that rule fails the same check."""

from __future__ import annotations

import itertools

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from scipy import stats as sps

from mechdiff.common import inference as inf
from mechdiff.common import stats as rowwise


def clustered(rng: np.random.Generator, n_items: int, rows: int, p: float = 0.6) -> tuple[np.ndarray, np.ndarray]:
    """0/1 outcomes whose rows repeat an item: each item's own rate drawn around ``p`` (strong clustering)."""
    rates = rng.beta(p * 1.5, (1 - p) * 1.5, size=n_items)
    return (rng.random((n_items, rows)) < rates[:, None]).astype(float).ravel(), np.repeat(np.arange(n_items), rows)


def test_rows_repeated_within_items_need_item_level_intervals():
    """Row-level exact intervals treat 8 rows of one item as 8 items and lose coverage; the item-level
    interval keeps it (within simulation error of 95% over 300 simulations)."""
    rng = np.random.default_rng(0)
    hit_rows = hit_items = 0
    sims = 300
    for s in range(sims):
        x, items = clustered(rng, 25, 8)
        row = inf.proportion(x)  # no items: each row its own
        item = inf.proportion(x, items, seed=s)
        hit_rows += row.low <= 0.6 <= row.high
        hit_items += item.low <= 0.6 <= item.high
    assert hit_rows / sims < 0.8
    assert hit_items / sims > 0.92


def test_zero_count_over_repeated_rows_is_the_items_exact_interval():
    est = inf.proportion(np.zeros(24), np.repeat(np.arange(12), 2))
    assert est.value == 0 and est.low == 0 and est.n_items == 12
    assert est.high == pytest.approx(1 - 0.025 ** (1 / 12))  # 0 of 12: 0.265, not 0 of 24's 0.142


def test_one_row_an_item_is_clopper_pearson():
    x = np.r_[np.ones(7), np.zeros(33)]
    est = inf.proportion(x)
    assert (est.low, est.high) == pytest.approx((sps.beta.ppf(0.025, 7, 34), sps.beta.ppf(0.975, 8, 33)))


def test_few_discordant_pairs_get_the_exact_test_and_an_interval_that_agrees():
    """0 against 4 discordant prompts (the capitals study's after_country/rome): the row bootstrap's
    percentile interval excludes 0, the exact McNemar p is 0.125 and the interval keeps 0."""
    a, b = np.zeros(200), np.zeros(200)
    b[:4] = 1
    old = rowwise.paired_difference(a, b)
    assert old.high < 0  # the old rule claimed a difference
    test = inf.paired(a, b)
    assert test.p == pytest.approx(0.125) and test.discordant == (0, 4)
    assert test.interval.low < 0 <= test.interval.high


@settings(max_examples=60, deadline=None)
@given(st.integers(0, 25), st.integers(0, 25), st.integers(0, 60))
def test_the_paired_interval_never_excludes_0_where_the_exact_test_does_not_reject(n10, n01, same):
    a = np.r_[np.ones(n10), np.zeros(n01), np.ones(same)]
    b = np.r_[np.zeros(n10), np.ones(n01), np.ones(same)]
    if a.size == 0:
        return
    test = inf.paired(a, b)
    assert test.p == pytest.approx(1.0 if n10 + n01 == 0 else sps.binomtest(n10, n10 + n01).pvalue)
    if test.interval.excludes(0):
        assert test.p <= 0.05


def test_sign_flip_over_single_rows_is_mcnemar_exactly():
    """Flipping the signs of +-1 differences one item a row is the exact McNemar test."""
    diff = np.r_[np.ones(9), -np.ones(2), np.zeros(40)]
    assert inf.sign_flip(diff).p == pytest.approx(sps.binomtest(9, 11).pvalue)


def test_sign_flip_exact_against_enumeration_by_hand():
    diff = np.array([0.3, -0.1, 0.5, 0.2, 0.0, 0.4])
    stats = [abs(np.dot(s, diff)) for s in itertools.product((1, -1), repeat=diff.size)]
    expect = np.mean(np.array(stats) >= abs(diff.sum()) - 1e-12)
    assert inf.sign_flip(diff).p == pytest.approx(expect)


@settings(max_examples=40, deadline=None)
@given(st.lists(st.floats(-3, 3, allow_nan=False), min_size=3, max_size=40), st.integers(1, 4))
def test_clustered_interval_never_excludes_0_where_its_test_does_not_reject(diffs, rows):
    d = np.repeat(np.asarray(diffs), rows)
    test = inf.paired(d, np.zeros_like(d), np.repeat(np.arange(len(diffs)), rows))
    assert test.interval.low <= test.interval.value + 1e-9 <= test.interval.high + 2e-9
    if test.interval.excludes(0):
        assert test.p <= 0.05


def test_clustered_paired_difference_covers_where_the_row_bootstrap_does_not():
    """Model differences that repeat within items: the row-level paired bootstrap undercovers, the
    clustered sign-flip interval does not (true difference 0.1)."""
    rng = np.random.default_rng(1)
    hit_rows = hit_items = 0
    sims = 120
    for s in range(sims):
        item_effect = rng.normal(0.1, 0.6, size=20)
        d = (item_effect[:, None] + rng.normal(0, 0.2, size=(20, 6))).ravel()
        items = np.repeat(np.arange(20), 6)
        row = rowwise.paired_difference(d, np.zeros_like(d), n_resamples=500, seed=s)
        test = inf.paired(d, np.zeros_like(d), items, seed=s)
        hit_rows += row.low <= 0.1 <= row.high
        hit_items += test.interval.low <= 0.1 <= test.interval.high
    assert hit_rows / sims < 0.75
    assert hit_items / sims > 0.9


def test_tango_interval_solves_its_score_equation():
    """At each bound the score statistic of Tango (1998) equals the normal quantile; at 0 it is McNemar's."""
    n10, n01, n = 12, 4, 60
    low, high = inf.tango_interval(n10, n01, n)

    def score(d0):
        a, b, c = 2 * n, -n10 - n01 + (2 * n - n10 + n01) * d0, -n01 * d0 * (1 - d0)
        q21 = (np.sqrt(b * b - 4 * a * c) - b) / (2 * a)
        return (n10 - n01 - n * d0) / np.sqrt(n * (2 * q21 + d0 * (1 - d0)))

    assert score(low) == pytest.approx(1.959964, abs=1e-6) and score(high) == pytest.approx(-1.959964, abs=1e-6)
    assert score(0.0) == pytest.approx((n10 - n01) / np.sqrt(n10 + n01))


def holm_by_definition(p):
    """Holm (1979) read literally: reject in order of p while p_(j) <= alpha / (m - j); adjusted p is the smallest
    alpha at which each is rejected."""
    m = len(p)
    grid = np.linspace(0, 1, 2001)
    adjusted = np.ones(m)
    for alpha in grid[::-1]:
        order = np.argsort(p)
        for j, i in enumerate(order):
            if p[i] <= alpha / (m - j):
                adjusted[i] = alpha
            else:
                break
    return adjusted


def test_holm_matches_its_definition_and_holds_the_family_wise_error():
    p = np.array([0.01, 0.04, 0.03, 0.2, 0.004])
    assert inf.holm(p) == pytest.approx(holm_by_definition(p), abs=1e-3)
    rng = np.random.default_rng(2)
    nulls = rng.random((4000, 12))  # 12 true null hypotheses a family
    fwer_raw = (nulls <= 0.05).any(1).mean()
    fwer_holm = (np.apply_along_axis(inf.holm, 1, nulls) <= 0.05).any(1).mean()
    assert fwer_raw > 0.4 and fwer_holm <= 0.05 + 3 * np.sqrt(0.05 * 0.95 / 4000)


def test_family_adjusts_its_own_tests_only():
    fam = inf.Family("differences between the models")
    for p in (0.01, 0.02, 0.5):
        fam.add(inf.Test("c", inf.Interval(0, 0, 0, 1, 1, "m"), p, "m"))
    rows = fam.rows()
    assert [r["p_holm"] for r in rows] == pytest.approx([0.03, 0.04, 0.5])
    assert [r["shown"] for r in rows] == [True, True, False] and rows[0]["family"] == fam.name


def test_equivalence_is_two_one_sided_t_tests():
    rng = np.random.default_rng(3)
    a, b = rng.normal(0.01, 0.1, 80), rng.normal(0, 0.1, 80)
    d, margin = a - b, 0.05
    eq = inf.equivalence(a, b, margin)
    lower = sps.ttest_1samp(d, -margin, alternative="greater").pvalue
    upper = sps.ttest_1samp(d, margin, alternative="less").pvalue
    assert eq.p == pytest.approx(max(lower, upper))
    assert eq.shown == (-margin < eq.low and eq.high < margin)  # the 90% interval inside the margin


def test_exact_equivalence_is_interval_inclusion_of_the_exact_interval():
    """Sparse 0/1 differences (0 vs 4 of 200): the t-based TOST passes a 0.04 margin (its 90% interval
    [-0.036, -0.004]), but the exact 90% interval reaches -0.044, so sameness within 0.04 is not shown; within
    0.05 it is, and its p is the alpha at which the 1 - 2 alpha exact interval first fits the margin."""
    a, b = np.zeros(200), np.zeros(200)
    b[:4] = 1
    assert not inf.equivalence(a, b, 0.04).shown
    eq = inf.equivalence(a, b, 0.05)
    ninety = inf.paired(a, b, confidence=0.9).interval
    assert eq.shown and (eq.low, eq.high) == (ninety.low, ninety.high) and -0.05 < eq.low and eq.high < 0.05
    at_p = inf.paired(a, b, confidence=1 - 2 * eq.p).interval
    assert at_p.low == pytest.approx(-0.05, abs=1e-4)


def test_equivalence_is_not_shown_by_a_small_sample():
    eq = inf.equivalence([1, 0, 1, 0, 1], [1, 1, 0, 0, 1], 0.05)
    assert not eq.shown


def test_control_rank_is_a_direct_count():
    rng = np.random.default_rng(4)
    draws = (rng.random((100, 60)) < np.linspace(0.2, 0.95, 100)[:, None]).astype(float)
    circuit = (rng.random(60) < 0.85).astype(float)
    r = inf.control_rank(circuit, draws)
    direct = sum(row.mean() >= circuit.mean() for row in draws)
    assert r.rank == direct and r.p == pytest.approx((1 + direct) / 101) and r.n_draws == 100
    assert r.quantiles[0] < r.draws.value < r.quantiles[2]


def test_detectable_difference_shrinks_with_items():
    assert inf.detectable_difference(400) == pytest.approx(inf.detectable_difference(100) / 2)
    assert 0.12 < inf.detectable_difference(100, "proportion") < 0.15
