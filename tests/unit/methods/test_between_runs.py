"""Runs of one recipe compared (#51 item 4): "within a run minus between runs" split by split over prompts, its
interval over seeds (the leave-one-run-out jackknife), and runs compared at matched accuracy."""

from __future__ import annotations

from types import SimpleNamespace

import numpy as np
import pytest
from scipy import stats

from mechdiff.common.inference import jackknife
from mechdiff.methods.structure import structure
from mechdiff.studies.trajectory.stages.structure import StructureStage

CLASSES = ["a", "b"]
SHAPE = (2, 10, 15)  # 300 pairs
TOP = 30
PROMPTS = 32


def test_the_jackknife_of_a_mean_is_the_t_interval_of_the_units():
    """For a plain mean the leave-one-out jackknife's standard error is exactly s / sqrt(k): its interval and p are
    those of the one-sample t test (scipy), on k - 1 degrees of freedom; two units give none."""
    x = [0.12, 0.03, 0.08, -0.01, 0.06]
    got = jackknife(lambda u: np.mean(u), x)
    se = np.std(x, ddof=1) / np.sqrt(len(x))
    low, high = stats.t.interval(0.95, len(x) - 1, loc=np.mean(x), scale=se)
    assert got["se"] == pytest.approx(se) and (got["low"], got["high"]) == pytest.approx((low, high))
    assert got["p"] == pytest.approx(stats.ttest_1samp(x, 0).pvalue)
    assert jackknife(lambda u: np.mean(u), x[:2])["low"] is None
    assert jackknife(lambda u: 0.0, x)["p"] == 1.0  # no spread and nothing to test


def runs_of(shift: float, n_runs: int, seed: int = 0) -> dict[str, np.ndarray]:
    """``n_runs`` runs' checkpoints at one step, each on the same PROMPTS prompts: the runs share their pair means
    where ``shift`` is 0; each run moves a random third of its pairs' means by ``shift`` otherwise."""
    rng = np.random.default_rng(seed)
    mu = rng.standard_t(3, int(np.prod(SHAPE))) * 0.3
    out = {}
    for r in range(n_runs):
        own = mu.copy()
        moved = rng.random(mu.size) < 1 / 3
        own[moved] += shift * rng.standard_normal(moved.sum())
        out[f"run{r}@5"] = (own + rng.standard_normal((PROMPTS, mu.size))).reshape(PROMPTS, *SHAPE)
    return out


def between(attribution: dict[str, np.ndarray], matched=None) -> dict:
    names = list(attribution)
    this = {names[0]: attribution[names[0]]}
    res = structure(
        this,
        CLASSES,
        TOP,
        draws=20,
        seed=0,
        runs={names[0]: {o: attribution[o] for o in names[1:]}},
        resamples=100,
        resample_splits=2,
        matched=matched,
    )
    return res


def test_runs_of_one_population_do_not_differ_and_runs_that_moved_do():
    """Five runs drawn around the same pair means: within minus between is not shown above 0 over prompts nor
    over seeds. Five runs that each moved a third of their pairs: it is, both ways; and each run's own value is
    its null less its mean cross overlap with the others, recomputed here from the same splits."""
    alike = between(runs_of(0.0, 5))["between_runs"][0]
    assert not alike["changed"] and alike["over_runs"]["null_minus_between"]["low"] < 0
    moved = between(runs_of(3.0, 5))["between_runs"][0]
    assert moved["changed"] and moved["null_minus_between"]["low"] > 0
    seeds = moved["over_runs"]["null_minus_between"]
    assert seeds["low"] > 0 and seeds["units"] == 5 and seeds["p"] < 0.05
    assert moved["null_minus_between"]["value"] == pytest.approx(seeds["value"])  # one statistic, two intervals
    per_run = moved["over_runs"]["per_run"]
    assert set(per_run) == set(moved["runs"]) and np.mean(list(per_run.values())) == pytest.approx(seeds["value"])
    assert moved["overlap"]["value"] < alike["overlap"]["value"]


def test_matched_groups_are_compared_like_a_step_and_unknown_names_refused():
    """A matched group (one checkpoint of each run) gets the same row as a step's runs; a group naming a checkpoint
    the comparison lacks is refused before anything is computed."""
    att = runs_of(3.0, 3)
    names = list(att)
    res = between(att, matched={"accuracy 0.5": names})
    (row,) = res["matched_runs"]
    same = res["between_runs"][0]
    assert row["level"] == "accuracy 0.5" and row["runs"] == names
    assert row["null_minus_between"]["value"] == pytest.approx(same["null_minus_between"]["value"])
    with pytest.raises(ValueError, match="neither checkpoints nor other runs"):
        between(att, matched={"accuracy 0.8": [names[0], "nope@5"]})


def test_each_run_is_matched_at_its_first_step_read_at_or_above_the_level():
    """``StructureStage.matched``: per level, each run's first step read whose accuracy reaches it, this run first;
    a run that never does is left out, and a level fewer than two runs reach gives no group."""
    acc = {
        "et@2": 0.14, "et@15": 0.52, "et@100": 0.91,
        "b@2": 0.13, "b@15": 0.40, "b@100": 0.95,
        "c@2": 0.55, "c@15": 0.81, "c@100": 0.79,
    }  # fmt: skip
    study = SimpleNamespace(
        names=["et@0", "et@2", "et@15", "et@100"],
        steps=[0, 2, 15, 100],
        runs={"et@100": ["b@100", "c@100"], "et@2": ["b@2", "c@2"], "et@15": ["b@15", "c@15"]},
        st=SimpleNamespace(runs=SimpleNamespace(dirs=["b", "c"], levels=[0.5, 0.8, 0.93, 0.99])),
        accuracy=lambda c: SimpleNamespace(result={"accuracy": {"value": acc[c]}}),
    )
    stage = StructureStage.__new__(StructureStage)
    stage.s = study
    assert stage.matched() == {
        "accuracy 0.5": ["et@15", "b@100", "c@2"],
        "accuracy 0.8": ["et@100", "b@100", "c@15"],
    }  # 0.93: only run b reaches it; 0.99: none
