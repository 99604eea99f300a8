"""Equivalence margins as task-file settings (#49 item 6): ``[inference] margins`` over the defaults, read by the
report and ``mechdiff restate``, named in every "same"-type sentence and in the families table; never in a key."""

from __future__ import annotations

import argparse
import json

import numpy as np
import pytest

from mechdiff.common.inference import MARGINS, margins_of
from mechdiff.common.outcomes import outcome_record
from mechdiff.report.paired import difference_sentence, paired_family_rows, paired_rows

HEAD = '[task]\nname = "entity-tracking"\n\n[models]\nbase = "smollm2-135m"\n\n'


def _stages(n: int = 1000, discordant: int = 10) -> dict:
    """Two models' accuracy on ``n`` prompts, one an item: the same but for ``discordant`` prompts each way."""
    base = np.zeros(n)
    base[: n // 2] = 1
    ft = base.copy()
    ft[:discordant], ft[n // 2 : n // 2 + discordant] = 0, 1
    return {"accuracy": {"base": outcome_record(base), "ft": outcome_record(ft)}}


def test_a_task_file_margin_changes_the_equivalence_verdict(tmp_path):
    """A difference of 0 on 1000 prompts with 10 discordant each way: its 90% interval (about +-0.0074 by the
    normal approximation, sqrt(20) / 1000 x 1.645) lies inside the default +-0.05, so the sentence says "the same
    within +-0.05"; a task file's margin of 0.002 lies inside that interval, so the same rows are "not shown to
    differ nor the same within +-0.002". The file's other measures keep their defaults."""
    from mechdiff.studies.circuits.spec import load_spec

    half = 1.645 * np.sqrt(20) / 1000
    assert 0.002 < half < 0.05  # the case is built to fall between the two margins
    path = tmp_path / "t.toml"
    path.write_text(HEAD + "[inference]\nmargins = { accuracy = 0.002 }\n")
    margins = load_spec(path).inference.margins
    assert margins == {**MARGINS, "accuracy": 0.002}

    default = next(r for r in paired_rows(_stages(), "base", ["ft"]) if r["measure"] == "accuracy")
    assert default["margin"] == 0.05 and default["same_within_margin"] is True
    assert "the same within +-0.05" in difference_sentence(default)
    assert abs(default["equivalence_low"]) == pytest.approx(half, rel=0.35)  # the exact 90% interval, near Wald's
    narrow = next(r for r in paired_rows(_stages(), "base", ["ft"], None, margins) if r["measure"] == "accuracy")
    assert narrow["margin"] == 0.002 and narrow["same_within_margin"] is False
    assert "not shown to differ nor the same within +-0.002" in difference_sentence(narrow)
    same = [r for r in paired_family_rows([narrow]) if r["family"] == "sameness between the models"]
    assert [(r["claim"], r["margin"], r["shown"]) for r in same] == [
        ("ft - base: accuracy: the same within +-0.002", 0.002, False)
    ]
    assert same[0]["low"] < -0.002 and same[0]["high"] > 0.002  # the 90% interval leaves the margin


@pytest.mark.parametrize(
    ("table", "message"),
    [
        ("{ acuracy = 0.1 }", r"t.toml:8: unknown measure 'acuracy' in margins; the measures are accuracy, "
         r"probability, faithfulness, logit_difference \(in \[inference\]\)"),
        ("{ accuracy = 0 }", r"t.toml:8: margins: accuracy = 0; give a number above 0 \(the default is 0.05\)"),
        ('{ logit_difference = "big" }', r"t.toml:8: margins = .* in \[inference\] — give a table of numbers .*; "
         r"logit_difference is 'big'"),
    ],
)  # fmt: skip
def test_an_unknown_measure_or_a_bad_margin_is_refused_with_its_line(tmp_path, table, message):
    from mechdiff.studies.circuits.spec import load_spec
    from mechdiff.studies.spec import SpecError

    path = tmp_path / "t.toml"
    path.write_text(HEAD + f"[inference]\nmargins = {table}\n")
    with pytest.raises(SpecError, match=message):
        load_spec(path)


def test_underscores_name_measures_and_every_default_is_stated_once():
    assert margins_of({"logit_difference": 1, "logit difference": 2.0})["logit difference"] == 2.0
    assert margins_of() == MARGINS == {"accuracy": 0.05, "probability": 0.05, "faithfulness": 0.05,
                                       "logit difference": 0.5}  # fmt: skip


def test_restate_refuses_a_bad_task_file_before_reading_or_writing(tmp_path):
    """`mechdiff restate RUN --task-file FILE` checks the file first: an unknown measure stops it with the file's
    line, and the run directory is left as it was."""
    from mechdiff.commands.restate import main
    from mechdiff.studies.spec import SpecError

    run = tmp_path / "run"
    run.mkdir()
    (run / "run.json").write_text(json.dumps({"kind": "circuits"}))
    bad = tmp_path / "t.toml"
    bad.write_text(HEAD + "[inference]\nmargins = { sameness = 0.1 }\n")
    with pytest.raises(SpecError, match="unknown measure 'sameness'"):
        main(argparse.Namespace(run_dir=str(run), root=".", task_file=str(bad)))
    assert [p.name for p in run.iterdir()] == ["run.json"]


def test_restate_reads_the_margins_run_json_records_else_the_defaults():
    from mechdiff.report.families import margins_sentence, margins_used

    recorded = {"spec": {"inference": {"margins": {**MARGINS, "accuracy": 0.01}}}}
    assert margins_used(recorded) == ({**MARGINS, "accuracy": 0.01}, "the [inference] margins run.json records")
    assert margins_used({"spec": {}}) == (MARGINS, "the default margins")
    given = margins_used(recorded, {"probability": 0.1})
    assert given == ({**MARGINS, "probability": 0.1}, "the task file's [inference] margins")
    assert "accuracy +-0.05, probability +-0.1" in margins_sentence(*given)
