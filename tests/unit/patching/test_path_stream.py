"""Path patching over pairs held a part at a time (``[discovery] pairs_per_part``,
:class:`~mechdiff.patching.path.PairStream`): the scores of the held batch, and memory that does not grow with the
number of pairs."""

from __future__ import annotations

from pathlib import Path

import memray
import numpy as np
import pytest
from conftest import capitals_rows, write_rows

from mechdiff.common.components import Head
from mechdiff.patching.attribution import attribution_scores
from mechdiff.patching.path import PairBatches, PairStream, Receivers, path_patch, prepare
from mechdiff.tasks.base import get_task
from mechdiff.tasks.entity_tracking import path_patching_pairs
from mechdiff.tasks.jsonl import import_pairs

SENDERS = [Head(0, 0), Head(1, 0), Head(1, 2)]  # at the last position: step A moves the answer by up to 0.5%


@pytest.fixture
def mixed_pairs(smollm2_tokenizer, tmp_path):
    """Twelve pairs of four templates and lengths, three of each, interleaved."""
    task = get_task(
        import_pairs(write_rows(tmp_path / "capitals.jsonl", capitals_rows(12)), smollm2_tokenizer, tmp_path / "t")
    )
    return task.discovery_pairs(smollm2_tokenizer, 12)


def _scores(model, batch, receivers):
    """Each sender's exact score and its attribution estimate, in the order of SENDERS."""
    exact = path_patch(model, batch, SENDERS, "last", receivers, progress=False)
    estimate = attribution_scores(model, batch, "last", receivers, SENDERS)
    return [exact[h] for h in SENDERS], [estimate[h] for h in SENDERS]


@pytest.mark.parametrize("receivers", [None, Receivers((Head(2, 1),), "q", "last")])
def test_parts_of_a_whole_group_give_the_held_scores_bit_for_bit(tiny_llama, mixed_pairs, receivers):
    held, streamed = prepare(tiny_llama, mixed_pairs), prepare(tiny_llama, mixed_pairs, part_size=3)
    assert isinstance(held, PairBatches) and isinstance(streamed, PairStream) and len(streamed.chunks) == 4
    assert (streamed.p_clean == held.p_clean).all() and len(streamed) == len(held) == 12
    assert _scores(tiny_llama, streamed, receivers) == _scores(tiny_llama, held, receivers)


@pytest.mark.parametrize("receivers", [None, Receivers((Head(2, 1),), "q", "last")])
def test_groups_split_into_parts_give_the_held_scores(tiny_llama, mixed_pairs, receivers):
    """Each group of three in parts of two and one: the same ratio of means over every prompt, to a few float32
    ulps of the clean probability (a part's forward holds other rows, so float sums may differ in their last bits)."""
    held, streamed = prepare(tiny_llama, mixed_pairs), prepare(tiny_llama, mixed_pairs, part_size=2)
    assert len(streamed.chunks) == 8 and [n for n, _ in streamed.shapes] == [2, 1] * 4
    (exact, estimate), (want, want_estimate) = (
        _scores(tiny_llama, streamed, receivers),
        _scores(tiny_llama, held, receivers),
    )
    np.testing.assert_allclose(exact, want, rtol=1e-4, atol=1e-6)
    np.testing.assert_allclose(estimate, want_estimate, rtol=1e-4, atol=1e-6)
    if receivers is None:  # not vacuous: step A's senders move the answer far beyond the tolerance
        assert max(abs(x) for x in want) > 1e-3


def test_a_part_size_below_one_is_refused(tiny_llama, mixed_pairs):
    with pytest.raises(ValueError, match="part_size must be at least 1"):
        prepare(tiny_llama, mixed_pairs, part_size=0)


def _peak(stage, path: Path) -> int:
    """Bytes allocated at the high-water mark while ``stage()`` runs, counting only what it allocates."""
    with memray.Tracker(path, native_traces=False, trace_python_allocators=True):
        stage()
    return memray.FileReader(path).metadata.peak_memory


def test_streamed_path_patching_memory_does_not_grow_with_the_pairs(tiny_llama, smollm2_tokenizer, tmp_path):
    """Peak allocation above the start, at 8 pairs and at 80: within 10% in parts of 4, while holding every pair
    grows it by more (the control that makes the bound mean something)."""
    pairs = path_patching_pairs(smollm2_tokenizer, 80, n_boxes=3, seed=3)

    def step(n: int, part_size):
        return lambda: path_patch(
            tiny_llama, prepare(tiny_llama, pairs[:n], part_size=part_size), SENDERS, "last", progress=False
        )

    step(8, 4)()  # first-call allocations are not the stage's
    small, large = _peak(step(8, 4), tmp_path / "8.bin"), _peak(step(80, 4), tmp_path / "80.bin")
    held_small, held_large = _peak(step(8, None), tmp_path / "h8.bin"), _peak(step(80, None), tmp_path / "h80.bin")
    print(
        f"parts of 4: {small / 1e6:.2f} MB at 8 pairs, {large / 1e6:.2f} at 80; "
        f"held: {held_small / 1e6:.2f}, {held_large / 1e6:.2f}"
    )
    assert abs(large - small) <= 0.1 * small
    assert held_large > 1.3 * held_small
