"""Position scans over a circuit's heads (mechdiff.circuits.positions)."""

from __future__ import annotations

import numpy as np
import pytest

from mechdiff.circuits.scoring import per_prompt


def test_position_scan_ends_at_the_full_model_and_classes_equal_named_positions(llama_scorer):
    from mechdiff.circuits.positions import every_head_at, position_scan
    from mechdiff.tasks.entity_tracking.positions import CLASSES

    shape = llama_scorer.model.shape
    # a class holding one named position is that position
    by_class = per_prompt(
        llama_scorer.keep(every_head_at(shape.n_layers, shape.n_heads, ["last", "query_label"])), "prob"
    )
    from mechdiff.common.components import all_heads

    named = [(h, p) for p in ("last", "query_label") for h in all_heads(shape.n_layers, shape.n_heads)]
    assert np.array_equal(by_class, per_prompt(llama_scorer.keep(named), "prob"))
    res = position_scan(llama_scorer, CLASSES, metric="prob")
    last = res["steps"][-1]
    assert sorted(last["classes"]) == sorted(CLASSES)
    assert last["faithfulness_prob"]["value"] == pytest.approx(1.0)  # every class kept: the model itself
    values = [s["candidates"][s["added"]] for s in res["steps"]]
    assert all(s["candidates"][s["added"]] == max(s["candidates"].values()) for s in res["steps"])
    assert len(values) == len(CLASSES)
    short = position_scan(llama_scorer, CLASSES, metric="prob", max_steps=2)
    assert [s["added"] for s in short["steps"]] == [s["added"] for s in res["steps"][:2]]
