"""--plan's detectable differences: each set's size beside the difference a test on it detects."""

from __future__ import annotations

import numpy as np
from scipy import stats as sps

from mechdiff.studies.base import detectable_text


def test_each_set_gets_the_normal_approximation_of_its_detectable_difference():
    text = detectable_text({"eval": 300, "prune": 16, "none": 0})
    z = sps.norm.ppf(0.975) + sps.norm.ppf(0.8)
    assert (
        f"eval         300 rows: paired {z * np.sqrt(0.2 / 300):.3f}, one proportion {z * 0.5 / np.sqrt(300):.3f}"
        in text
    )
    assert "prune" in text and "none" not in text  # a set of no rows is left out
