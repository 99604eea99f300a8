"""DCM desiderata by name (mechdiff.tasks.desiderata): the aliases, and the task's pairs for the boxes, seed and
vocabulary given."""

from __future__ import annotations

import pytest

from mechdiff.tasks.base import get_task
from mechdiff.tasks.desiderata import desideratum_pairs
from unit.methods.test_dcm import _exactly

VOCABULARY = ["apple", "book", "car", "dog", "egg", "fan", "hat", "key", "lamp", "map", "pen", "cup", "box", "bag"]


def test_desideratum_pairs_pass_boxes_seed_and_vocabulary(smollm2_tokenizer):
    task = get_task("entity-tracking")
    got = desideratum_pairs("object_value", smollm2_tokenizer, 4, n_boxes=3, seed=2, vocabulary=VOCABULARY)
    assert got == task.desideratum("object", smollm2_tokenizer, 4, seed=2, n_boxes=3, vocabulary=VOCABULARY)
    assert got != desideratum_pairs("object", smollm2_tokenizer, 4, n_boxes=4, seed=2, vocabulary=VOCABULARY)
    assert got != desideratum_pairs("object", smollm2_tokenizer, 4, n_boxes=3, seed=2)
    assert got != desideratum_pairs("object", smollm2_tokenizer, 4, n_boxes=3, seed=3, vocabulary=VOCABULARY)
    assert desideratum_pairs("position", smollm2_tokenizer, 2, n_boxes=3) == task.desideratum(
        "positional", smollm2_tokenizer, 2, n_boxes=3
    )
    assert desideratum_pairs("label", smollm2_tokenizer, 2) == task.desideratum("label", smollm2_tokenizer, 2)
    with pytest.raises(
        ValueError,
        match=_exactly(
            "unknown desideratum 'colour'; task entity-tracking defines ['label', 'object', 'positional'] "
            "(or pass your own list of counterfactual pairs)"
        ),
    ):
        desideratum_pairs("colour", smollm2_tokenizer, 2)
