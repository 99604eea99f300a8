"""The HeadMap study's report (mechdiff.studies.headmap.tables): the per-method rows over seeds, the paired differences
and their verdict, and the notes on rates chosen at an end of the grid."""

from __future__ import annotations

import random

import pytest


def _records(acc_by_seed, n=200, seed=0):
    """Training records whose held-out outcomes have exactly the given per-seed accuracies."""
    out = []
    for i, acc in enumerate(acc_by_seed):
        k = round(acc * n)
        outcome = [1.0] * k + [0.0] * (n - k)
        random.Random(seed + i).shuffle(outcome)
        out.append(
            {
                "correct": {"entity-tracking": outcome},
                "trainable": 10,
                "losses": [2.0, 1.0],
                "train_seconds": 1.0,
                "heads": {},
                "config": {},
            }
        )
    return out


def test_seed_aggregation_reports_each_seed_their_spread_and_an_interval_for_the_mean():
    import numpy as np

    from mechdiff.studies.headmap.tables import method_rows

    names = {"located": "L", "random": "R"}
    results = {"located": _records([0.5, 0.6, 0.7]), "random": _records([0.6, 0.6, 0.6])}
    rows, est = method_rows(results, names, lora_ref=100, lora_large=8)
    loc, rnd = rows
    assert loc["per_seed"] == "0.500 / 0.600 / 0.700" and loc["seeds"] == 3
    assert loc["accuracy"] == pytest.approx(0.6) and loc["sd"] == pytest.approx(np.std([0.5, 0.6, 0.7], ddof=1))
    assert (loc["min"], loc["max"]) == (pytest.approx(0.5), pytest.approx(0.7))
    assert loc["ci_low"] < 0.6 < loc["ci_high"] and rnd["sd"] == pytest.approx(0.0)
    # same mean, but seeds that disagree widen the interval for the mean (the seeds are resampled too)
    assert loc["ci_high"] - loc["ci_low"] > rnd["ci_high"] - rnd["ci_low"]
    assert loc["ratio_to_lora_r8"] == pytest.approx(0.1) and set(est) == {"located", "random"}


def test_paired_rows_difference_per_seed_and_pooled_and_the_verdict():
    import numpy as np

    from mechdiff.studies.headmap.tables import paired_rows, verdict

    names = {"located": "L", "random": "R", "outside": "O"}
    better = _records([0.9, 0.8, 0.85])
    worse = _records([0.3, 0.35, 0.4])
    rows = paired_rows({"located": better, "random": worse, "outside": better}, names, (0, 1, 2))
    lr = [r for r in rows if r["comparison"] == "L - R"]
    assert [r["seed"] for r in lr][:3] == ["0", "1", "2"] and lr[3]["seed"].startswith("pooled (3 seeds")
    for r, a, b in zip(lr, better, worse):
        assert r["difference"] == pytest.approx(
            np.mean(a["correct"]["entity-tracking"]) - np.mean(b["correct"]["entity-tracking"])
        )
    assert lr[3]["difference"] == pytest.approx(np.mean([0.9, 0.8, 0.85]) - np.mean([0.3, 0.35, 0.4]))
    assert lr[3]["ci_low"] > 0 and "the first beats the second" in verdict(rows, "L - R")
    same = [r for r in rows if r["comparison"] == "L - O"][3]
    assert same["difference"] == same["ci_low"] == same["ci_high"] == 0.0  # identical outcomes: no difference
    assert "cannot tell the two apart" in verdict(rows, "L - O")
    flipped = paired_rows({"located": worse, "random": better}, names, (0, 1, 2))
    assert "the second beats the first" in verdict(flipped, "L - R")


def test_edge_notes_warn_only_for_rates_at_an_end_of_the_grid():
    from mechdiff.studies.headmap.tables import edge_notes

    notes = edge_notes((1e-3, 3e-3, 1e-2), {"LoRA": 1e-2, "HeadMap": 3e-3, "Other": 1e-3})
    text = " ".join(notes)
    assert "LoRA's chosen rate 0.01 is the largest" in text and "Other's chosen rate 0.001 is the smallest" in text
    assert "HeadMap" not in text and edge_notes((), {"LoRA": 1e-2}) == [] and edge_notes((1e-2,), {"L": 1e-2}) == []
