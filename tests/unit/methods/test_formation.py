"""Formation on the change scale, on synthetic trajectories whose answers are known: each component timed on its
own change from step 0 over its own final change (a ratio never times it), censoring, zero counts, declines, and
every order a test in a Holm family. Ratio measures stay as levels: shown only where the checkpoint's own gain is
above the first's."""

from __future__ import annotations

import numpy as np
import pytest
from scipy import stats as sps

from mechdiff.common import inference as inf
from mechdiff.methods.formation import (
    ORDER_FAMILY,
    Change,
    above_first,
    change_curves,
    change_family,
    curves,
    faithfulness,
    first_of,
    order_family,
    order_test,
    resample,
    share,
    step_text,
)

STEPS = (0, 1, 2, 4, 8, 16)


def nested(shares: list[float], n: int = 400, seed: int = 0) -> np.ndarray:
    """ "step prompt" 0/1 outcomes: a prompt right at one step is right at every later one, ``shares[s]`` of them."""
    rank = np.random.default_rng(seed).permutation(n)
    return np.array([(rank < round(p * n)).astype(float) for p in shares])


# --- ratio levels (shown, never timed) -----------------------------------------------------------------------------


def test_a_ratio_is_shown_only_where_the_checkpoints_own_gain_is_above_the_first():
    """Faithfulness is 1 at step 1, but the whole model there is no better than at step 0: the step is not shown."""
    full = nested([0.1, 0.1, 0.6, 0.7, 0.8, 0.9])
    kept = full.copy()
    kept[3:, np.flatnonzero(full[0])[:20]] = 0  # 20 prompts right at every step lost with the circuit alone from 4 on
    got = curves({"c": faithfulness(kept, full, "p")}, STEPS)["c"]
    assert got.per_step()[0] is None and got.per_step()[1] is None
    assert got.point[2] == 1.0 and got.point[-1] == pytest.approx((0.9 * 400 - 20) / (0.9 * 400), abs=1e-12)
    assert list(above_first(full)) == [False, False, True, True, True, True]


def test_a_patched_components_share_of_the_checkpoints_gain():
    """CMAP-like: the patched gain over the first's own outcomes as a share of the checkpoint's own gain, hidden
    where that gain's interval holds 0 (step 1)."""
    first = np.zeros((6, 400))
    own = nested([0.0, 0.0, 0.4, 0.6, 0.8, 0.8])
    patched = nested([0.0, 0.0, 0.1, 0.15, 0.6, 0.8])
    got = curves({"g": share(patched, own, first, "p")}, STEPS)["g"]
    assert [iv is None for iv in got.per_step()] == [True, True, False, False, False, False]
    assert got.point[2:] == pytest.approx([0.25, 0.25, 0.75, 1.0], abs=1e-12)


def test_curves_refuse_a_prompt_set_of_two_sizes_and_rows_not_one_per_step():
    with pytest.raises(ValueError, match="prompt set 'p' has 10 prompts"):
        change_curves({"a": Change(np.zeros((6, 10)), "p"), "b": Change(np.zeros((6, 12)), "p")}, STEPS)
    with pytest.raises(ValueError, match="one row per step"):
        change_curves({"a": Change(np.zeros((5, 10)), "p")}, STEPS)
    with pytest.raises(ValueError, match="one figure a step"):
        Change(np.zeros((6, 10)), "p", np.zeros(5))


# --- the change scale ----------------------------------------------------------------------------------------------


def test_a_component_that_tracks_the_model_is_not_ordered_before_it():
    """A circuit kept alone that answers exactly what the whole model answers, on its own prompts: its faithfulness
    (the ratio the old code timed) is 1 at every step shown, so it 'formed' at the first step shown, before the
    model's 50% at step 4. On the change scale it reaches 50% where the model does, and no test orders the two."""
    model = nested([0.1, 0.15, 0.3, 0.6, 0.85, 0.9], seed=1)
    kept = nested([0.1, 0.15, 0.3, 0.6, 0.85, 0.9], n=300, seed=2)  # the circuit's prompts: the model's own course
    ratio = curves({"c": faithfulness(kept, kept, "matrix")}, STEPS)["c"]
    shown = [iv["value"] for iv in ratio.per_step() if iv]
    assert shown and all(v == 1.0 for v in shown)  # the ratio 'reaches 50%' at its first shown step
    got = change_curves({"model": Change(model, "eval"), "circuit": Change(kept, "matrix")}, STEPS, draws=2000)
    assert got["model"].timing(0.5)["first"][0] == got["circuit"].timing(0.5)["first"][0] == 4
    fam, keys = order_family(got, ["model", "circuit"])
    assert keys == [("model", "circuit", 0.5), ("model", "circuit", 0.9)]
    assert not any(t.rejects for t in fam.adjusted())


def test_a_component_that_forms_early_on_the_change_scale_is_ordered_before_the_model():
    """A component with 80% of its final change by step 1 against a model with 10% there and 50% only at step 8:
    ordered at 50% in every draw, so its paired p is the smallest the draws allow, 2 / (D + 1), and it survives
    Holm's adjustment in a family of two."""
    model = nested([0.0, 0.08, 0.2, 0.3, 0.6, 0.8], seed=3)
    early = nested([0.1, 0.82, 0.88, 0.9, 0.92, 1.0], n=300, seed=4)
    got = change_curves({"model": Change(model, "eval"), "early": Change(early, "cmap")}, STEPS, draws=4000)
    t = order_test(("early", "model"), got["early"], got["model"], 0.5)
    assert t.interval.value == 1 - 8 and t.interval.high < 0
    assert t.p == pytest.approx(2 / 4001)
    fam, _ = order_family(got, ["early", "model"])
    adj = fam.adjusted()
    assert [x.family for x in adj] == [ORDER_FAMILY] * 2
    assert adj[0].p_adjusted == pytest.approx(inf.holm([x.p for x in fam.tests])[0])
    assert adj[0].rejects and first_of(adj[0], ("early", "model")) == "early"


def test_censoring_is_written_out():
    """Reached at the first checkpoint after 0: 'at or before step 1'; never reached: 'after step 16'. A component
    whose final change barely clears the noise has draws whose final change is not a rise: those never reach."""
    assert step_text(1.0, STEPS) == "at or before step 1"
    assert step_text(np.inf, STEPS) == "after step 16"
    assert step_text(4.0, STEPS) == 4
    at_one = nested([0.0, 0.7, 0.75, 0.8, 0.85, 0.9], seed=5)
    rng = np.random.default_rng(6)
    faint = np.array([(rng.random(40) < p).astype(float) for p in (0.2, 0.2, 0.25, 0.2, 0.3, 0.3)])
    got = change_curves({"one": Change(at_one, "a"), "faint": Change(faint, "b")}, STEPS, draws=2000)
    point, draws = got["one"].timing(0.5)["first"]
    assert step_text(point, STEPS) == "at or before step 1" and set(draws) == {1.0}
    never = ~np.isfinite(got["faint"].timing(0.5)["first"][1])
    change = got["faint"].change()[1][-1]
    assert never.mean() == pytest.approx(np.mean(change <= 0))  # exactly the draws with no rise by the last step
    assert 0 < never.mean() < 1


def test_a_step_whose_counts_are_zero_gets_an_exact_interval_and_draws_that_vary():
    """CMAP-like: 0 of 64 at step 1. Every resample of it is 0, so the bootstrap alone gives it no width; its level
    interval is Clopper-Pearson [0, 1 - 0.025 ** (1 / 64)] and its draws are Jeffreys posterior draws,
    Beta(1/2, 64 + 1/2), whose mean is 0.5 / 65."""
    x = nested([0.05, 0.0, 0.1, 0.3, 0.5, 0.6], n=64, seed=7)
    c = Change(x, "cmap")
    iv = c.level_interval(1)
    assert (iv.value, iv.low) == (0.0, 0.0) and iv.high == pytest.approx(1 - 0.025 ** (1 / 64))
    got = change_curves({"c": c}, STEPS, draws=20000)["c"]
    at_one = got.draws[1]
    assert at_one.std() > 0 and at_one.mean() == pytest.approx(0.5 / 65, rel=0.05)
    assert sps.kstest(at_one, sps.beta(0.5, 64.5).cdf).pvalue > 0.01
    assert np.all(got.draws[2] == x[2][resample({"cmap": 64}, 20000, 0)["cmap"]].mean(1))  # other steps: resampled


def test_a_decline_is_timed_on_its_loss_first_and_from_when_it_stays():
    """Accuracy 0.9 falling to 0.6 with a dip and a partial recovery: losses 0, 0.02, 0.2, 0.05, 0.25, 0.3. 50% of the
    final loss (0.15) is first reached at step 2, but the loss stays there only from step 8; 90% (0.27) only at 16."""
    rng = np.random.default_rng(8)
    n = 2000
    x = np.array([(rng.random(n) < p).astype(float) for p in (0.9, 0.88, 0.7, 0.85, 0.65, 0.6)])
    got = change_curves({"m": Change(x, "eval")}, STEPS, draws=1000)["m"]
    loss = x.mean(1)[0] - x.mean(1)
    direct_first = next(s for s, v in zip(STEPS, loss) if v >= 0.5 * loss[-1])
    direct_stays = next(s for i, s in enumerate(STEPS) if all(v >= 0.5 * loss[-1] for v in loss[i:]))
    assert got.direction == -1 and (direct_first, direct_stays) == (2, 8)
    t = got.timing(0.5)
    assert (t["first"][0], t["stays"][0]) == (2, 8)
    assert got.timing(0.9)["first"][0] == 16
    test = change_family({"m": got}).adjusted()[0]
    assert test.rejects and test.interval.value == pytest.approx(-loss[-1])


def test_the_change_test_subtracts_a_floors_change():
    """A DCM-like rate above a floor known as a count: patched 10/48 -> 30/48 while the floor rises 5/48 -> 25/48,
    so the change above the floor is 0 and is not shown; with the floor fixed it is +20/48 and shown."""
    patched = np.zeros((6, 48))
    for s, k in enumerate((10, 12, 15, 20, 25, 30)):
        patched[s, :k] = 1
    moving = Change(patched, "sem", np.array([5, 7, 10, 15, 20, 25]) / 48)
    fixed = Change(patched, "sem", np.full(6, 5 / 48))
    got = change_curves({"moving": moving, "fixed": fixed}, STEPS, draws=500)
    t_moving, t_fixed = got["moving"].final, got["fixed"].final
    assert t_moving.interval.value == pytest.approx(0.0, abs=1e-12) and not t_moving.rejects
    assert t_fixed.interval.value == pytest.approx(20 / 48) and t_fixed.p == pytest.approx(2 * 0.5**20)
