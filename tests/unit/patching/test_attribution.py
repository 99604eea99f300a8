"""Attribution patching: the first-order estimate of path patching (mechdiff.patching.attribution)."""

from __future__ import annotations

import pytest
import torch

from mechdiff.common.components import Head
from mechdiff.patching.path import Receivers, path_patch
from mechdiff.patching.path_pairs import prepare
from mechdiff.tasks.entity_tracking import path_patching_pairs


@pytest.fixture
def small_pairs(smollm2_tokenizer):
    return path_patching_pairs(smollm2_tokenizer, 4, n_boxes=3, seed=5)


def test_attribution_is_the_first_order_path_patching_score(tiny_llama, small_pairs):
    """For a source a small step from clean, the exact path-patching score is linear in the step, so the
    attribution estimate equals it (scale included); scores cover exactly the senders asked for, or by
    default every head below the deepest receiver."""
    from mechdiff.patching.attribution import attribution_scores
    from mechdiff.patching.path import eligible_senders

    batch = prepare(tiny_llama, small_pairs)
    g = torch.Generator().manual_seed(2)
    batch.source_z = {l: z + 1e-3 * torch.randn(z.shape, generator=g) for l, z in batch.clean_z.items()}
    senders = [Head(0, 1), Head(1, 2), Head(2, 0)]
    exact = path_patch(tiny_llama, batch, senders, "last", None, progress=False)
    estimate = attribution_scores(tiny_llama, batch, "last", None, senders)
    assert list(estimate) == senders
    largest = max(abs(v) for v in exact.values())
    for s in senders:  # the second-order term: under 5% of the score (or 1% of the largest score near zero)
        assert estimate[s] == pytest.approx(exact[s], rel=0.05, abs=0.01 * largest)
    assert largest > 1e-7
    receivers = Receivers((Head(2, 1),), "q", "last")
    assert list(attribution_scores(tiny_llama, batch, "last", receivers)) == eligible_senders(tiny_llama, receivers)
