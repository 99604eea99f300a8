"""Path patching over pairs held a part at a time (``[discovery] pairs_per_part``,
:class:`~mechdiff.patching.path_pairs.PairStream`): the scores of the held batch, and memory that does not grow with the
number of pairs."""

from __future__ import annotations

from pathlib import Path

import memray
import numpy as np
import pytest
from conftest import capitals_rows, write_rows

from mechdiff.common.components import Head
from mechdiff.patching.attribution import attribution_scores
from mechdiff.patching.path import Receivers, path_patch
from mechdiff.patching.path_pairs import PairBatches, PairStream, prepare
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


def test_a_parts_random_source_draws_are_its_columns_of_the_groups(tiny_llama, smollm2_tokenizer):
    """A sender's counterfactual read at a random label: a group split into parts draws, pair by pair, what the
    whole group draws, so path patching's scores do not depend on the part size."""
    import torch

    from mechdiff.patching.path import source_indices
    from mechdiff.patching.path_pairs import parts

    pairs = path_patching_pairs(smollm2_tokenizer, 5, n_boxes=3, seed=3)
    held, streamed = prepare(tiny_llama, pairs), prepare(tiny_llama, pairs, part_size=2)
    assert streamed.places == [(0, 0, 5), (0, 2, 5), (0, 4, 5)]
    whole = source_indices(tiny_llama, held, SENDERS, "labels", "7:0")
    split = [
        source_indices(tiny_llama, part, SENDERS, "labels", "7:0", streamed.places[i][1:])
        for i, part in enumerate(parts(streamed))
    ]
    assert torch.equal(torch.cat(split, dim=1), whole)

    def scores(batch):
        out = path_patch(tiny_llama, batch, SENDERS, "last", None, progress=False, source_position="labels", seed=7)
        return [out[h] for h in SENDERS]

    np.testing.assert_allclose(scores(streamed), scores(held), rtol=1e-4, atol=1e-6)


def test_one_part_is_alive_at_a_time(tiny_llama, mixed_pairs, monkeypatch):
    """Each part is freed before the next is prepared: in building the stream, in path patching and in the
    attribution screen (a part still referenced would double the memory the plan counts)."""
    import gc
    import weakref

    from mechdiff.patching import path_pairs as path  # the parts are prepared there

    made, alive = [], []
    original = path._prepare

    def counted(*args, **kwargs):
        gc.collect()
        alive.append(sum(ref() is not None for ref in made))
        part = original(*args, **kwargs)
        made.append(weakref.ref(part))
        return part

    monkeypatch.setattr(path, "_prepare", counted)
    # every object made before the test (torch, the model, ...) set aside from the 24 collections: each then scans
    # only what the test made (every part among it), in milliseconds instead of a second over the whole heap
    gc.collect()
    gc.freeze()
    try:
        streamed = prepare(tiny_llama, mixed_pairs, part_size=2)
        path_patch(tiny_llama, streamed, SENDERS, "last", progress=False)
        attribution_scores(tiny_llama, streamed, "last", None, SENDERS)
    finally:
        gc.unfreeze()
    assert len(alive) == 3 * 8 and alive == [0] * 24


def test_auto_senders_keep_a_parts_activations_free(tiny_llama, smollm2_tokenizer, monkeypatch):
    """Sized while no part is held, ``auto`` leaves room for the largest part's activations (which a held batch
    already occupies when it is sized): with room for exactly 37 copies, the stream takes 36 and the held batch 37;
    with the part's bytes more, the stream takes 37."""
    import torch

    from mechdiff.models import memory
    from mechdiff.models.footprint import held_pair_bytes
    from mechdiff.patching.path import auto_senders_per_pass

    pairs = path_patching_pairs(smollm2_tokenizer, 8, n_boxes=3, seed=3)
    streamed, held = prepare(tiny_llama, pairs, part_size=4), prepare(tiny_llama, pairs[:4])
    (n, tokens), s = streamed.shapes[0], tiny_llama.shape
    part = n * held_pair_bytes(s.n_layers, s.d_model, 2 * s.n_kv_heads * s.d_head, tokens, 4)
    room = 37 * n * memory.example_bytes(s, tokens) / 0.6 + 1
    monkeypatch.setattr(memory, "cuda_devices", lambda model: [torch.device("cuda:0")])
    for free, want in ((room, 36), (room + part, 37)):
        monkeypatch.setattr(torch.cuda, "mem_get_info", lambda device, free=free: (int(free), int(2 * free)))
        assert auto_senders_per_pass(tiny_llama, streamed) == want
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda device: (int(room), int(2 * room)))
    assert auto_senders_per_pass(tiny_llama, held) == 37
