"""Path patching, attribution, activation patching and scans against properties a correct run must have
(causality, identities, hand-computed sums). Written from the survivors of mutation testing
(benchmarks/mutation.md); each test takes a second or two on the tiny models."""

from __future__ import annotations

import pytest
import torch

from mechdiff.components import Head
from mechdiff.patching.path import Receivers, path_patch, prepare
from mechdiff.tasks.entity_tracking import path_patching_pairs


@pytest.fixture
def pairs(smollm2_tokenizer):
    return path_patching_pairs(smollm2_tokenizer, 4, n_boxes=3, seed=5)


def test_senders_after_the_receivers_position_change_nothing(tiny_llama, pairs):
    """Causal attention: a sender at the last token cannot reach receivers' V at the earlier query label,
    so every score is 0 (up to rounding); the same senders at the query label do move the answer."""
    batch = prepare(tiny_llama, pairs)
    receivers = Receivers((Head(2, 1), Head(2, 2)), "v", "query_label")
    senders = [Head(0, h) for h in range(4)] + [Head(1, h) for h in range(4)]
    late = path_patch(tiny_llama, batch, senders, "last", receivers, progress=False)
    assert max(abs(v) for v in late.values()) < 1e-5
    early = path_patch(tiny_llama, batch, senders, "query_label", receivers, progress=False)
    assert max(abs(v) for v in early.values()) > 1e-4
