"""Activation patching primitives and metrics on tiny models of each family."""

from __future__ import annotations

import pytest
import torch

from mechdiff.common.components import Head, all_heads
from mechdiff.patching.activation import activation_patch, capture_sources, patches_from
from mechdiff.patching.core import run
from mechdiff.tasks.entity_tracking import pair_batch_tensors, path_patching_pairs


@pytest.fixture
def pair_batch(smollm2_tokenizer):
    return pair_batch_tensors(path_patching_pairs(smollm2_tokenizer, 6, n_boxes=3, seed=2))


def _logits(model, ids):
    with torch.no_grad():
        return run(model, ids).logits


def test_patching_nothing_is_the_clean_run(tiny_model, pair_batch):
    clean, source = pair_batch["base"]["input_ids"], pair_batch["source"]["input_ids"]
    patched = activation_patch(tiny_model, clean, source, [])
    assert torch.equal(patched, _logits(tiny_model, clean))


def test_patching_everything_reproduces_the_counterfactual(tiny_model, pair_batch):
    clean, source = pair_batch["base"]["input_ids"], pair_batch["source"]["input_ids"]
    shape = tiny_model.shape
    everything = ["EMB", *all_heads(shape.n_layers, shape.n_heads)]
    counterfactual = _logits(tiny_model, source)
    patched = activation_patch(tiny_model, clean, source, everything)
    torch.testing.assert_close(patched, counterfactual, atol=1e-5, rtol=1e-5)
    assert (_logits(tiny_model, clean) - counterfactual).abs().max() > 1e-3  # not vacuous


def test_patching_at_one_position_only_changes_that_head(tiny_llama, pair_batch):
    clean, source = pair_batch["base"]["input_ids"], pair_batch["source"]["input_ids"]
    pos = pair_batch["base"]["positions"]["last"]
    head = Head(1, 2)
    src = capture_sources(tiny_llama, source, [head])
    with torch.no_grad():
        out = run(tiny_llama, clean, patches_from(tiny_llama, [head], src, pos), capture=[("z", 1)])
    z = out.captured[("z", 1)]
    rows = torch.arange(len(pos))
    torch.testing.assert_close(z[rows, pos, 16:24], src[("z", 1)][rows, pos, 16:24])
    with torch.no_grad():
        clean_z = run(tiny_llama, clean, capture=[("z", 1)]).captured[("z", 1)]
    torch.testing.assert_close(z[rows, pos, :16], clean_z[rows, pos, :16])
    torch.testing.assert_close(z[:, :-1], clean_z[:, :-1])


def test_batched_equals_one_at_a_time(tiny_model, pair_batch):
    clean, source = pair_batch["base"]["input_ids"], pair_batch["source"]["input_ids"]
    pos = pair_batch["base"]["positions"]["query_label"]
    heads = [Head(0, 1), Head(0, 3), Head(2, 0)]  # non-contiguous heads in one layer
    batched = activation_patch(tiny_model, clean, source, heads, pos)
    single = torch.cat(
        [
            activation_patch(tiny_model, clean[i : i + 1], source[i : i + 1], heads, pos[i : i + 1])
            for i in range(len(clean))
        ]
    )
    torch.testing.assert_close(batched, single, atol=1e-5, rtol=1e-5)
    assert not torch.allclose(batched, _logits(tiny_model, clean))


def test_resume_skips_early_blocks_exactly(tiny_model, pair_batch):
    """Resuming at block 2 from the captured residual after block 1 gives the same patched logits,
    gradients still reach a mask, and a site before the resumed block is refused."""
    from mechdiff.patching.core import Patch, Resume

    ids = pair_batch["base"]["input_ids"]
    src = run(tiny_model, pair_batch["source"]["input_ids"], capture=[("z", 2)]).captured[("z", 2)]
    patch = [Patch("z", 2, src)]
    hidden = run(tiny_model, ids, capture=[("resid", 1)]).captured[("resid", 1)]
    full = run(tiny_model, ids, patch).logits
    resumed = run(tiny_model, ids, patch, resume=Resume(2, hidden)).logits
    torch.testing.assert_close(resumed, full, rtol=1e-5, atol=1e-6)
    assert not torch.allclose(full, run(tiny_model, ids).logits)  # the patch matters
    mask = torch.full((1,), 0.5, requires_grad=True)
    out = run(tiny_model, ids, [Patch("z", 2, src, mask=mask)], grad=True, resume=Resume(2, hidden))
    out.logits.sum().backward()
    assert mask.grad is not None and mask.grad.abs().item() > 0
    with pytest.raises(ValueError, match="before the resumed layer"):
        run(tiny_model, ids, [Patch("z", 1, src)], resume=Resume(2, hidden))


def test_suffix_activation_patch_equals_full(tiny_model, pair_batch):
    """With the clean run's key/value prefix, patching at one position per example computes only the
    positions from it on and gives the full run's logits."""
    clean, source = pair_batch["base"]["input_ids"], pair_batch["source"]["input_ids"]
    pos = pair_batch["base"]["positions"]["query_label"]
    heads = [Head(1, 1), Head(1, 3), Head(2, 0), "EMB"]
    prefix = run(tiny_model, clean, keep_kv=True).kv
    full = activation_patch(tiny_model, clean, source, heads, pos)
    suffix = activation_patch(tiny_model, clean, source, heads, pos, prefix=prefix)
    assert (suffix - full).abs().max() <= 1e-4
    assert (full - _logits(tiny_model, clean)).abs().max() > 1e-3


@pytest.fixture
def small_pairs(smollm2_tokenizer):
    return path_patching_pairs(smollm2_tokenizer, 4, n_boxes=3, seed=5)


def test_activation_patch_of_heads_apart_in_one_layer_is_their_column_patches(tiny_llama, small_pairs):
    """Two heads of one layer that are not neighbours (one patch with the other columns restored by a mask)
    and the embedding: what separate column patches of each give."""
    from mechdiff.patching.activation import activation_patch, capture_sources
    from mechdiff.patching.core import EMB_LAYER, Patch, head_patch, run
    from mechdiff.tasks.entity_tracking import pair_batch_tensors

    t = pair_batch_tensors(small_pairs)
    clean, source = t["base"]["input_ids"], t["source"]["input_ids"]
    heads = [Head(1, 0), Head(1, 2), Head(2, 3)]
    at = t["base"]["positions"]["query_label"]
    got = activation_patch(tiny_llama, clean, source, [*heads, "EMB"], positions=at)
    captured = capture_sources(tiny_llama, source, [*heads, "EMB"])
    rows = torch.arange(len(at))
    d = tiny_llama.shape.d_head
    patches = [
        head_patch(tiny_llama, "z", h, captured[("z", h.layer)][rows, at, h.head * d : (h.head + 1) * d], at)
        for h in heads
    ]
    patches.append(Patch("emb", EMB_LAYER, captured[("emb", EMB_LAYER)][rows, at], at))
    want = run(tiny_llama, clean, patches).logits
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    assert not torch.allclose(want, run(tiny_llama, clean).logits, atol=1e-4)
