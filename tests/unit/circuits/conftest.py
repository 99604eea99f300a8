"""Fixtures the circuits tests share: entity-tracking records of N_BOXES boxes and a scorer over a tiny llama."""

from __future__ import annotations

import pytest

from mechdiff.circuits.scoring import Scorer
from mechdiff.tasks.entity_tracking import generate, reference_records

N_BOXES = 3


@pytest.fixture
def records(smollm2_tokenizer):
    return generate(smollm2_tokenizer, 6, n_boxes=N_BOXES, seed=0)


@pytest.fixture
def llama_scorer(tiny_llama, smollm2_tokenizer) -> Scorer:
    records = generate(smollm2_tokenizer, 6, n_boxes=N_BOXES, seed=0)
    return Scorer.build(tiny_llama, records, reference_records(smollm2_tokenizer, 6, N_BOXES, 1), 6, False)
