"""`mechdiff.api.results`: a committed study's files read back as DataFrames, estimates, circuits and figures; each
value checked against the file it comes from, read here with json and csv."""

from __future__ import annotations

import csv
import json
import math
from pathlib import Path

import pytest

import mechdiff as md

ROOT = Path(__file__).resolve().parents[3]
IOI = ROOT / "results" / "ioi-smollm2"


def _json(name: str) -> list[dict]:
    return json.loads((IOI / "tables" / f"{name}.json").read_text())


def test_accuracy_is_the_committed_table_with_its_interval_columns():
    frame = md.Results.load(IOI).accuracy()
    rows = _json("accuracy")
    assert list(frame["model"]) == [r["model"] for r in rows] == ["smollm2-135m", "smollm2-et"]
    for (_, got), want in zip(frame.iterrows(), rows):
        for column in ("accuracy", "accuracy_low", "accuracy_high", "logit_diff", "logit_diff_high"):
            assert got[column] == want[column]
        assert got["accuracy_low"] <= got["accuracy"] <= got["accuracy_high"]
    with (IOI / "tables" / "accuracy.csv").open(newline="") as f:  # the CSV the run wrote beside it agrees
        assert [float(r["accuracy"]) for r in csv.DictReader(f)] == list(frame["accuracy"])


def test_faithfulness_and_families_are_their_tables_row_for_row():
    results = md.Results.load(IOI)
    faith, rows = results.faithfulness(), _json("circuit_x_model")
    assert len(faith) == len(rows) == 4
    assert [(r["circuit"], r["model"], r["faithfulness"]) for r in rows] == list(
        zip(faith["circuit"], faith["model"], faith["faithfulness"])
    )
    fams = results.families()
    assert list(fams["claim"]) == [r["claim"] for r in _json("families")]
    assert "families" in results.tables() and "accuracy" in results.tables()


def test_estimates_carry_each_claims_interval_p_and_items():
    rows = _json("families")
    estimates = md.Results.load(IOI).estimates()
    assert len(estimates) == len(rows)
    for e, r in zip(estimates, rows):
        assert (e.value, e.low, e.high, e.items, e.rows, e.claim) == (
            r["estimate"],
            r["low"],
            r["high"],
            r["items"],
            r["rows"],
            r["claim"],
        )
        assert e.p == r["p"] and e.p_holm == r["p_holm"]
        assert e.excludes_zero == (not r["low"] <= 0 <= r["high"])
        assert e.interval().n_items == r["items"]
    family = rows[0]["family"]
    assert len(md.Results.load(IOI).estimates(family)) == sum(r["family"] == family for r in rows)


def test_estimate_from_the_inference_layers_interval():
    from mechdiff.common.inference import proportion

    interval = proportion([1, 0, 1, 1, 0, 1, 1, 1])
    e = md.Estimate.from_interval(interval, "accuracy")
    assert (e.value, e.low, e.high, e.rows) == (0.75, interval.low, interval.high, 8)
    assert str(e) == str(interval)


def test_circuit_is_the_run_s_circuit_file():
    circuit = md.Results.load(IOI).circuit("smollm2-et")
    data = json.loads((IOI / "circuits" / "smollm2-et.json").read_text())
    assert isinstance(circuit, md.Circuit)
    assert {g: [h.name for h in hs] for g, hs in circuit.groups.items()} == data["groups"]
    assert circuit.positions == data["positions"]


def test_figure_draws_one_point_and_bar_per_row():
    family = "differences between the models"
    fig = md.Results.load(IOI).figure("families", where={"family": family})
    rows = [r for r in _json("families") if r["family"] == family]
    ax = fig.axes[0]
    xs = list(ax.lines[0].get_xdata())
    assert len(xs) == len(rows) and all(math.isclose(x, r["estimate"]) for x, r in zip(xs, rows))
    fig = md.Results.load(IOI).figure("accuracy")  # the first column with an interval, by the first text column
    assert list(fig.axes[0].lines[0].get_xdata()) == [r["accuracy"] for r in _json("accuracy")]


def test_what_is_not_there_is_refused_naming_what_is(tmp_path):
    with pytest.raises(FileNotFoundError, match="holds no study's results"):
        md.Results.load(tmp_path)
    results = md.Results.load(IOI)
    with pytest.raises(KeyError, match="its tables: accuracy, "):
        results.table("accuracies")
    with pytest.raises(KeyError, match="smollm2-135m.json"):
        results.circuit("smollm2-135")
    with pytest.raises(ValueError, match="no column with an interval"):
        md.interval_figure(results.table("heads"))
