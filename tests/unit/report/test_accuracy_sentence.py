"""The trajectory README's accuracy finding: the steps whose paired difference from the first checkpoint is off 0,
and the step from which every later checkpoint stays on one side."""

from __future__ import annotations

from mechdiff.studies.trajectory.report_function import accuracy_sentence


def row(step: int, acc: float, diff: tuple | None = None) -> dict:
    low_high = {"accuracy_low": acc - 0.05, "accuracy_high": acc + 0.05}
    if diff is None:
        return {
            "step": step,
            "accuracy": acc,
            **low_high,
            "minus_first": None,
            "minus_first_low": None,
            "minus_first_high": None,
        }
    return {
        "step": step,
        "accuracy": acc,
        **low_high,
        "minus_first": diff[0],
        "minus_first_low": diff[1],
        "minus_first_high": diff[2],
    }


def test_erosion_is_dated_from_the_step_every_later_checkpoint_stays_below():
    rows = [
        row(0, 0.9),
        row(1, 0.9, (0.0, -0.02, 0.02)),
        row(2, 0.85, (-0.05, -0.08, -0.01)),  # below, but step 3 comes back: not yet "stays below"
        row(3, 0.88, (-0.02, -0.05, 0.01)),
        row(5, 0.8, (-0.1, -0.14, -0.06)),
        row(10, 0.8, (-0.1, -0.14, -0.06)),
    ]
    text = accuracy_sentence(rows)
    assert "lies below it at steps 2, 5, 10 (paired" in text and "stays below step 0's from step 5 on" in text
    assert "(the last: -0.100 [-0.140, -0.060])" in text


def test_a_rise_and_no_difference():
    rows = [row(0, 0.1), row(1, 0.3, (0.2, 0.1, 0.3)), row(2, 0.5, (0.4, 0.3, 0.5))]
    assert "stays above step 0's from step 1 on" in accuracy_sentence(rows)
    flat = [row(0, 0.1), row(1, 0.1, (0.0, -0.02, 0.02))]
    assert accuracy_sentence(flat).endswith("every paired 95% interval contains 0).")
    back = [row(0, 0.1), row(1, 0.3, (0.2, 0.1, 0.3)), row(2, 0.1, (0.0, -0.05, 0.05))]
    assert accuracy_sentence(back).endswith(
        "above it at step 1 (paired 95% interval of the difference off 0); the last checkpoint's difference contains 0."
    )
    both = [row(0, 0.9), row(1, 0.95, (0.05, 0.01, 0.09)), row(2, 0.8, (-0.1, -0.15, -0.05))]
    assert "Accuracy lies above it at step 1 and below it at step 2 (paired" in accuracy_sentence(both)
