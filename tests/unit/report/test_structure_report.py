"""The structure verdicts and the sentence the report writes from them: a change where the interval over prompts
lies above 0, sameness only within the stated margin, "not shown" otherwise; a record made before the margin
claims no sameness."""

from __future__ import annotations

from mechdiff.report.trajectory_page import structure_band
from mechdiff.studies.trajectory.report_parts import verdict
from mechdiff.studies.trajectory.report_structure import structure_sentence


def test_verdicts_and_the_sentence_say_changed_same_or_not_shown():
    changed, same, neither = (
        {"changed": True, "same": False},
        {"changed": False, "same": True},
        {"changed": False, "same": False},
    )
    assert [verdict(d, 0.05) for d in (changed, same, neither)] == ["changed", "same within 0.05", "not shown"]
    rows = [
        {"from_step": a, "to_step": b, "change": verdict(d, 0.05)}
        for (a, b), d in zip([(0, 1), (1, 2), (2, 3), (3, 4)], (changed, same, neither, neither))
    ]
    text = structure_sentence(rows, 0.05)
    assert text.startswith("Of 4 consecutive checkpoints: changed beyond the within-checkpoint null at 0-1;")
    assert "the same within 0.05 (Jaccard; 90% interval over prompts inside the margin) at 1-2;" in text
    assert text.endswith("neither a change nor sameness shown at 2-3, 3-4.")
    # a record made before the intervals resampled prompts: no margin, so "no change" is never said
    old = [{"from_step": 0, "to_step": 1, "change": verdict({"changed": False}, None)}]
    assert old[0]["change"] == "-"
    assert structure_sentence(old, None) == (
        "Of 1 consecutive checkpoints: no change shown (no equivalence margin in this record, so no sameness is "
        "claimed)."
    )
    assert structure_sentence([], 0.05) == "No consecutive checkpoints to compare."
    # a change shown whose 90% interval also lies inside the margin: said as both, with its size
    small = {"changed": True, "same": True}
    assert verdict(small, 0.05) == "changed, within 0.05" and verdict(small, None) == "changed"
    rows = [
        {"from_step": 0, "to_step": 1, "change": verdict(small, 0.05), "null_minus_cross": 0.011,
         "null_minus_cross_high": 0.017},
        {"from_step": 1, "to_step": 2, "change": verdict(changed, 0.05), "null_minus_cross": 0.02,
         "null_minus_cross_high": 0.03},
    ]  # fmt: skip
    text = structure_sentence(rows, 0.05)
    assert "changed beyond the within-checkpoint null at 0-1, 1-2 (by 0.011 to 0.020 Jaccard, each 95% interval" in text
    rows[1]["null_minus_cross_high"] = 0.06  # one change may exceed the margin: no such clause
    assert "Jaccard, each" not in structure_sentence(rows, 0.05)


def test_the_page_names_a_structure_band_by_what_it_resamples():
    assert structure_band("structure_null", [{"null_overlap": 0.4, "null_split_spread": "0.3 to 0.5"}]) == (
        " (95% CI over prompts)"
    )
    assert "a spread, not an interval" in structure_band("structure_null", [{"null_overlap": 0.4}])
    assert structure_band("accuracy", [{"accuracy": 0.5}]) == ""
