"""The compact per-prompt format: what is written is what is read, at the digits it keeps."""

from __future__ import annotations

import numpy as np
import pytest

from mechdiff.common.outcomes import (
    bits,
    from_bits,
    outcome_record,
    read_outcomes,
    read_record,
    rounded,
    write_outcomes,
)


def test_records_round_trip_through_outcomes_json(tmp_path):
    rng = np.random.default_rng(0)
    correct, prob = rng.random(57) < 0.4, rng.random(57)
    write_outcomes(tmp_path, {"accuracy": {"m": outcome_record(correct, prob)}, "empty": {}})
    stages = read_outcomes(tmp_path)
    assert list(stages) == ["accuracy"]  # a stage with no records is left out
    c, p = read_record(stages["accuracy"]["m"])
    assert np.array_equal(c, correct.astype(float))
    assert np.allclose(p, prob, rtol=1e-5, atol=0) and not np.array_equal(p, prob)  # 6 significant digits
    assert bits([True, False, 1, 0]) == "1010" and np.array_equal(from_bits("0110"), [0.0, 1.0, 1.0, 0.0])
    assert rounded([1 / 3, 123456789.0]) == [0.333333, 123457000.0]


def test_bad_records_are_refused(tmp_path):
    with pytest.raises(ValueError, match="3 outcomes but 2 probabilities"):
        outcome_record([1, 0, 1], [0.1, 0.2])
    with pytest.raises(ValueError, match="string of 0 and 1"):
        from_bits("0120")
    (tmp_path / "outcomes.json").write_text('{"format": "other", "stages": {}}')
    with pytest.raises(ValueError, match="is not 'mechdiff-outcomes/1'"):
        read_outcomes(tmp_path)
