"""Formation steps with intervals on synthetic curves whose crossings are known: the step reaching 50% and 90% of
the final value, its bootstrap interval over prompts drawn jointly across steps, ratios shown only where the
checkpoint's own gain is above 0, and the paired order of two components."""

from __future__ import annotations

import numpy as np
import pytest

from mechdiff.methods.formation import (
    above_first,
    curves,
    faithfulness,
    gain,
    order,
    resample,
    share,
)

STEPS = (0, 1, 2, 4, 8, 16)


def nested(shares: list[float], n: int = 400, seed: int = 0) -> np.ndarray:
    """ "step prompt" 0/1 outcomes: a prompt right at one step is right at every later one, ``shares[s]`` of them."""
    rank = np.random.default_rng(seed).permutation(n)
    return np.array([(rank < round(p * n)).astype(float) for p in shares])


def test_formation_steps_of_curves_with_known_crossings():
    """Gains 0, .1, .3, .6, .88, .9: 50% of the final (.45) is first reached at step 4, 90% (.81) at step 8, with
    margins far beyond the prompt noise, so every draw agrees."""
    got = curves({"m": gain(nested([0, 0.1, 0.3, 0.6, 0.88, 0.9]), "p")}, STEPS)["m"]
    assert got.point == pytest.approx([0, 0.1, 0.3, 0.6, 0.88, 0.9], abs=1e-12)
    half, most = got.formation(0.5), got.formation(0.9)
    assert (half["step"], half["low"], half["high"], half["formed"]) == (4, 4, 4, True)
    assert (most["step"], most["low"], most["high"], most["unreached"]) == (8, 8, 8, 0.0)


def test_formation_interval_is_the_bootstrap_of_the_first_crossing_recomputed_draw_by_draw():
    """Step 2 sits near half the final value: its crossing moves between steps 2 and 4 across draws. The interval
    is the percentile range of the first crossing computed directly in every draw on the same resampled prompts."""
    rng = np.random.default_rng(1)
    n, shares = 120, [0.0, 0.05, 0.44, 0.7, 0.85, 0.9]  # drawn: step 2 at 0.53, the final at 0.90
    outcomes = np.array([(rng.random(n) < p).astype(float) for p in shares])
    got = curves({"m": gain(outcomes, "p")}, STEPS, draws=500, seed=3)["m"]
    idx = resample({"p": n}, 500, 3)["p"]
    crossings = []
    for rows in idx:
        means = [float(np.mean(outcomes[s][rows] - outcomes[0][rows])) for s in range(len(STEPS))]
        crossings.append(next(st for st, m in zip(STEPS, means) if m >= 0.5 * means[-1]))
    low, high = np.quantile(crossings, [0.025, 0.975], method="inverted_cdf")
    f = got.formation(0.5)
    assert (f["low"], f["high"]) == (int(low), int(high)) == (2, 4)
    direct = [np.mean(outcomes[s] - outcomes[0]) for s in range(len(STEPS))]
    assert f["step"] == next(st for st, m in zip(STEPS, direct) if m >= 0.5 * direct[-1])


def test_the_same_prompts_are_drawn_at_every_step():
    """At step 2 each prompt's value is 0.55 of its final one: on the same prompts at every step the ratio is 0.55
    in every draw, so 50% is reached at step 2 with no spread, however heavy-tailed the prompts are."""
    final = np.random.default_rng(2).exponential(1.0, 12) ** 3
    rows = np.array([0 * final, 0.1 * final, 0.55 * final, 0.7 * final, 0.9 * final, final])
    f = curves({"m": gain(rows, "p")}, STEPS)["m"].formation(0.5)
    assert (f["step"], f["low"], f["high"]) == (2, 2, 2)


def test_a_ratio_is_shown_only_where_the_checkpoints_own_gain_is_above_the_first():
    """Faithfulness is 1 at step 1, but the whole model there is no better than at step 0: the step is not shown
    and the circuit forms at step 2, where the model's gain is clear."""
    full = nested([0.1, 0.1, 0.6, 0.7, 0.8, 0.9])
    kept = full.copy()
    kept[3:, np.flatnonzero(full[0])[:20]] = 0  # 20 prompts right at every step lost with the circuit alone from 4 on
    got = curves({"c": faithfulness(kept, full, "p")}, STEPS)["c"]
    assert got.per_step()[0] is None and got.per_step()[1] is None
    assert got.point[2] == 1.0 and got.point[-1] == pytest.approx((0.9 * 400 - 20) / (0.9 * 400), abs=1e-12)
    f = got.formation(0.5)
    assert (f["step"], f["low"], f["high"]) == (2, 2, 2)
    assert list(above_first(full)) == [False, False, True, True, True, True]


def test_a_patched_components_share_of_the_checkpoints_gain():
    """CMAP-like: the first checkpoint's own outcomes at every step; the patched gain over them as a share of the
    checkpoint's own gain, hidden where that gain's interval holds 0 (step 1)."""
    first = np.zeros((6, 400))
    own = nested([0.0, 0.0, 0.4, 0.6, 0.8, 0.8])
    patched = nested([0.0, 0.0, 0.1, 0.15, 0.6, 0.8])
    got = curves({"g": share(patched, own, first, "p")}, STEPS)["g"]
    assert [iv is None for iv in got.per_step()] == [True, True, False, False, False, False]
    assert got.point[2:] == pytest.approx([0.25, 0.25, 0.75, 1.0], abs=1e-12)
    assert got.formation(0.5)["step"] == 8 and got.formation(0.9)["step"] == 16


def test_a_component_whose_final_value_holds_zero_has_not_formed():
    rng = np.random.default_rng(4)
    noise = np.array([(rng.random(60) < 0.3).astype(float) for _ in STEPS])  # no gain over step 0 beyond noise
    got = curves({"m": gain(noise, "p"), "f": gain(nested([0, 0.5, 0.6, 0.7, 0.8, 0.9], 60), "p")}, STEPS)
    f = got["m"].formation(0.5)
    assert not f["formed"] and f["step"] is None and got["m"].per_step()[-1]["low"] <= 0
    assert order(got["m"], got["f"], 0.5)["before"] is None


def test_formation_order_is_a_paired_test_on_the_same_draws():
    a = gain(nested([0, 0.6, 0.7, 0.8, 0.85, 0.9], seed=5), "p")  # 50% at step 1
    b = gain(nested([0, 0.05, 0.1, 0.2, 0.7, 0.9], seed=6), "p")  # 50% at step 8
    got = curves({"a": a, "b": b, "a again": a}, STEPS)
    o = order(got["a"], got["b"], 0.5)
    assert (o["difference"], o["low"], o["high"], o["before"], o["a_first"]) == (-7.0, -7.0, -7.0, "a", 1.0)
    assert order(got["b"], got["a"], 0.5)["before"] == "b"
    # one component against itself on the same draws: the difference is 0 in every draw, so nothing is ordered
    same = order(got["a"], got["a again"], 0.5)
    assert (same["low"], same["high"], same["before"], same["a_first"], same["b_first"]) == (0.0, 0.0, None, 0, 0)


def test_two_components_on_one_prompt_set_share_its_draws():
    """Two components whose crossings move together prompt by prompt: paired on the same draws their difference
    never changes sign, although each one's own interval spans two steps."""
    rng = np.random.default_rng(7)
    n = 80
    base = np.array([(rng.random(n) < p).astype(float) for p in (0.0, 0.05, 0.46, 0.6, 0.85, 0.9)])
    later = base[[0, 0, 1, 2, 3, 5]]  # b one checkpoint later than a, the same final value
    got = curves({"a": gain(base, "p"), "b": gain(later, "p")}, STEPS, draws=400)
    fa, fb = got["a"].formation(0.5), got["b"].formation(0.5)
    assert fa["low"] < fa["high"] and fb["low"] < fb["high"]  # each alone is uncertain
    o = order(got["a"], got["b"], 0.5)
    assert o["high"] < 0 and o["before"] == "a" and o["a_first"] == 1.0


def test_curves_refuse_a_prompt_set_of_two_sizes_and_rows_not_one_per_step():
    with pytest.raises(ValueError, match="prompt set 'p' has 10 prompts"):
        curves({"a": gain(np.zeros((6, 10)), "p"), "b": gain(np.zeros((6, 12)), "p")}, STEPS)
    with pytest.raises(ValueError, match="one row per step"):
        curves({"a": gain(np.zeros((5, 10)), "p")}, STEPS)
