"""Suffix runs (positions >= start from the clean run's key/value cache) against full runs: z/q/k/v
patches at every position kind of the entity-tracking prompts, with and without a layer resume,
senders stacked along the batch, on a tiny model of every family (sliding-window ones included),
padded batches, the remote path (nnsight's local simulation) and SmolLM2 (slow)."""

from __future__ import annotations

import pytest
import torch
from einops import repeat

from conftest import make_tiny
from mechdiff.models.loading import LoadedModel
from mechdiff.models.registry import ModelSpec
from mechdiff.patching.core import Patch, Prefix, Resume, run, suffix_start
from mechdiff.tasks.entity_tracking import pair_batch_tensors, path_patching_pairs

TOL = 1e-4  # max |d logit| of a suffix run against the full run (fp32)
POSITIONS = ("last", "query_label", "query_label_context", "first_object")


@pytest.fixture(scope="module")
def prompts(smollm2_tokenizer):
    """Clean and counterfactual prompts (3 boxes) with their named positions, one per example."""
    t = pair_batch_tensors(path_patching_pairs(smollm2_tokenizer, 4, n_boxes=3, seed=5))
    positions = dict(t["base"]["positions"])
    positions["first_object"] = positions.pop("objects")[:, 0]
    positions = {k: v for k, v in positions.items() if k in POSITIONS}
    return t["base"]["input_ids"], t["source"]["input_ids"], positions


def sliding_model(family: str, tokenizer) -> LoadedModel:
    """A tiny random model of a sliding-window family, the window (4) shorter than the prompts."""
    from transformers import AutoModelForCausalLM, Gemma2Config, MistralConfig, Qwen2Config

    common = dict(num_hidden_layers=3, num_attention_heads=4, num_key_value_heads=2, hidden_size=32,
                  intermediate_size=64, vocab_size=49152, max_position_embeddings=256)
    cfg = {"mistral": lambda: MistralConfig(sliding_window=4, **common),
           "gemma2": lambda: Gemma2Config(sliding_window=4, head_dim=8, **common),
           "qwen2": lambda: Qwen2Config(use_sliding_window=True, sliding_window=4, max_window_layers=1, **common)}[family]()
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(cfg, attn_implementation="eager").eval().requires_grad_(False)
    return LoadedModel(f"tiny-{family}", ModelSpec(f"tiny-{family}", "local", "<memory>"), model, tokenizer,
                       {"kind": "memory"})


def _source_patch(model: LoadedModel, source: dict, kind: str, layer: int, head: int, pos: torch.Tensor) -> Patch:
    cols = model.arch.columns(kind, head, model.shape)
    rows = torch.arange(len(pos))
    return Patch(kind, layer, source[(kind, layer)][rows, pos][:, cols], pos, cols)


def _check_every_site(model: LoadedModel, prompts) -> float:
    """Largest |d logit| of suffix (and suffix + resume) runs against full runs over kinds x positions."""
    clean_ids, source_ids, positions = prompts
    layer = model.shape.n_layers - 2
    clean = run(model, clean_ids, keep_kv=True, capture=[("resid", layer - 1)])
    sites = [(k, layer) for k in ("q", "k", "v", "z")]
    source = run(model, source_ids, capture=sites).captured
    worst, moved = 0.0, 0.0
    for name, pos in positions.items():
        for kind in ("z", "q", "k", "v"):
            patch = [_source_patch(model, source, kind, layer, 1, pos)]
            full = run(model, clean_ids, patch, capture=[("z", layer + 1)])
            suffix = run(model, clean_ids, patch, capture=[("z", layer + 1)], prefix=clean.kv)
            resumed = run(model, clean_ids, patch, prefix=clean.kv,
                          resume=Resume(layer, clean.captured[("resid", layer - 1)]))
            assert suffix.start == int(pos.min()), name
            for other in (suffix, resumed):
                worst = max(worst, float((other.logits - full.logits).abs().max()))
            z_full = full.captured[("z", layer + 1)][:, suffix.start:]
            assert (suffix.captured[("z", layer + 1)] - z_full).abs().max() <= TOL
            moved = max(moved, float((full.logits - clean.logits).abs().max()))
    assert moved > 1e-3  # the patches change the logits: the comparison is not vacuous
    return worst


def test_suffix_runs_equal_full_runs_on_every_family(tiny_model, prompts):
    assert _check_every_site(tiny_model, prompts) <= TOL


@pytest.mark.parametrize("family", ["mistral", "gemma2", "qwen2"])
def test_suffix_runs_equal_full_runs_under_sliding_windows(family, smollm2_tokenizer, prompts):
    model = sliding_model(family, smollm2_tokenizer)
    assert _check_every_site(model, prompts) <= TOL


def test_stacked_copies_share_one_prefix(tiny_llama, prompts):
    """Three senders stacked along the batch ("(copy b)"), each patching another head, read one prefix of
    batch b; each copy equals its own full run. The prefix is not changed by the runs."""
    clean_ids, source_ids, positions = prompts
    pos, n = positions["query_label"], len(clean_ids)
    clean = run(tiny_llama, clean_ids, keep_kv=True, capture=[("resid", 0)])
    before = [k.clone() for k in clean.kv.keys]
    src = run(tiny_llama, source_ids, capture=[("z", 1)]).captured[("z", 1)]
    value = repeat(src[torch.arange(n), pos], "b c -> (s b) c", s=3).clone()
    mask = torch.ones(3 * n, value.shape[-1])
    for copy, head in enumerate((0, 2, 3)):  # copy i patches head (0, 2, 3)[i]: the rest keep their values
        mask[copy * n:(copy + 1) * n, head * 8:(head + 1) * 8] = 0
    stacked_ids, stacked_pos = repeat(clean_ids, "b p -> (s b) p", s=3), repeat(pos, "b -> (s b)", s=3)
    patch = Patch("z", 1, value, stacked_pos, mask=mask)
    for kwargs in ({}, {"resume": Resume(1, clean.captured[("resid", 0)])}):
        stacked = run(tiny_llama, stacked_ids, [patch], prefix=clean.kv, **kwargs).logits
        for copy, head in enumerate((0, 2, 3)):
            cols = slice(head * 8, (head + 1) * 8)
            one = run(tiny_llama, clean_ids, [Patch("z", 1, src[torch.arange(n), pos][:, cols], pos, cols)]).logits
            assert (stacked[copy * n:(copy + 1) * n] - one).abs().max() <= TOL
    assert all(torch.equal(a, b) for a, b in zip(before, clean.kv.keys))


def test_slices_readouts_and_derived_starts(tiny_model, prompts):
    clean_ids, source_ids, positions = prompts
    length = clean_ids.shape[1]
    clean = run(tiny_model, clean_ids, keep_kv=True)
    src = run(tiny_model, source_ids, capture=[("z", 1)]).captured[("z", 1)]
    start = int(positions["query_label"].min())
    patch = Patch("z", 1, src[:, start:start + 2], slice(start, start + 2))
    readout = (positions["query_label"] + 1).clamp(max=length - 1)
    full = run(tiny_model, clean_ids, [patch], readout=readout)
    suffix = run(tiny_model, clean_ids, [patch], readout=readout, prefix=clean.kv)
    assert suffix.start == start and (suffix.logits - full.logits).abs().max() <= TOL
    # nothing patched: the last position alone gives the clean logits
    alone = run(tiny_model, clean_ids, prefix=clean.kv)
    assert alone.start == length - 1 and (alone.logits - clean.logits).abs().max() <= TOL
    # an earlier explicit start is allowed, a later one refused; a patch of every position forces start 0
    earlier = run(tiny_model, clean_ids, [patch], readout=readout, prefix=clean.kv, start=2)
    assert earlier.start == 2 and (earlier.logits - full.logits).abs().max() <= TOL
    with pytest.raises(ValueError, match="after the first patched"):
        run(tiny_model, clean_ids, [patch], prefix=clean.kv, start=start + 1)
    assert suffix_start([Patch("z", 1, src)], None, length) == 0
    everywhere = run(tiny_model, clean_ids, [Patch("z", 1, src)], prefix=clean.kv)
    assert everywhere.start == 0 and torch.equal(everywhere.logits, run(tiny_model, clean_ids, [Patch("z", 1, src)]).logits)
    with pytest.raises(ValueError, match="keep_kv needs a full run"):
        run(tiny_model, clean_ids, keep_kv=True, prefix=clean.kv)


def test_padded_batch_suffix_equals_full(tiny_model):
    """Left-padded rows: the attention mask spans prefix and suffix; positions count from the first real token."""
    g = torch.Generator().manual_seed(4)
    ids = torch.randint(0, 2000, (3, 12), generator=g)
    mask = torch.ones_like(ids)
    mask[0, :4], mask[2, :1] = 0, 0
    clean = run(tiny_model, ids, attention_mask=mask, keep_kv=True)
    src = torch.randn(3, tiny_model.shape.d_head, generator=g)
    pos = torch.tensor([8, 6, 9])
    cols = tiny_model.arch.columns("z", 2, tiny_model.shape)
    patch = [Patch("z", 1, src, pos, cols)]
    full = run(tiny_model, ids, patch, attention_mask=mask)
    suffix = run(tiny_model, ids, patch, attention_mask=mask, prefix=clean.kv)
    assert suffix.start == 6 and (suffix.logits - full.logits).abs().max() <= TOL
    # a padded row equals the same prompt unpadded (GPT-2's absolute positions included)
    alone = run(tiny_model, ids[:1, 4:], [Patch("z", 1, src[:1], pos[:1] - 4, cols)])
    assert (alone.logits - full.logits[:1]).abs().max() <= TOL


def test_remote_path_suffix_runs_match_local(smollm2_tokenizer, prompts):
    """Through nnsight's local simulation of NDIF: the kept prefix and a stacked suffix run give the local numbers."""
    local, remote = make_tiny("llama", smollm2_tokenizer, seed=1), make_tiny("llama", smollm2_tokenizer, seed=1)
    remote.remote = "local"
    clean_ids, source_ids, positions = prompts
    pos = repeat(positions["query_label"], "b -> (s b)", s=2)
    value = torch.randn(len(pos), 8, generator=torch.Generator().manual_seed(0))
    patch = [Patch("v", 1, value, pos, local.arch.columns("v", 3, local.shape))]
    ids = repeat(clean_ids, "b p -> (s b) p", s=2)
    outs = []
    for model in (local, remote):
        clean = run(model, clean_ids, keep_kv=True, capture=[("resid", 0)])
        assert isinstance(clean.kv, Prefix) and clean.kv.batch == len(clean_ids)
        with model.session():
            out = run(model, ids, patch, prefix=clean.kv, resume=Resume(1, clean.captured[("resid", 0)])).logits
        outs.append(out)
    full = run(local, ids, patch).logits
    assert (outs[0] - full).abs().max() <= TOL and torch.equal(outs[0], outs[1])


@pytest.mark.slow
def test_suffix_runs_on_smollm2(smollm2, prompts):
    """The real model (30 layers, GQA 9/3): z/q/k/v at every position kind, with and without resume."""
    assert _check_every_site(smollm2, prompts) <= TOL


def test_cmap_base_scores_on_suffix_runs_equal_full_runs(smollm2_tokenizer):
    """CMAP's patched runs (resumed, suffix from the first patched position) give the answer probabilities
    of full runs with the same patches, for every scope and kind."""
    import numpy as np

    from mechdiff.circuits.circuit import Circuit
    from mechdiff.methods.cmap import CMAP_KINDS, _base_scores, capture_sites, cmap_patches, scopes
    from mechdiff.common.components import Head
    from mechdiff.tasks.entity_tracking import batch_tensors, generate

    base, ft = make_tiny("llama", smollm2_tokenizer, seed=1), make_tiny("llama", smollm2_tokenizer, seed=2)
    circuit = Circuit("tiny", "entity-tracking", {"A": [Head(2, 0), Head(1, 3)], "B": [Head(1, 1)]},
                      {"A": "last", "B": "query_label"})
    batch = batch_tensors(generate(smollm2_tokenizer, 4, n_boxes=3, seed=0))
    ids, answer = batch["input_ids"], batch["answer_ids"]
    captured = run(ft, ids, capture=capture_sites(circuit.heads())).captured
    kinds = list(CMAP_KINDS)
    from mechdiff.methods.cmap import isolation_patches

    base_z = {l: t for (k, l), t in run(base, ids, capture=[("z", l) for l in range(base.shape.n_layers)]).captured.items()}
    moved = 0.0
    for isolate in (False, True):
        got = _base_scores(base, ids, answer, captured, scopes(circuit), kinds, batch["positions"], isolate=isolate)
        for scope, pairs in scopes(circuit).items():
            for kind in kinds:
                patches = cmap_patches(base, pairs, kind, captured, batch["positions"], ids.shape[1])
                if isolate:
                    patches += isolation_patches(base, pairs, kind, base_z, batch["positions"], ids.shape[1])
                logits = run(base, ids, patches).logits
                prob = logits.softmax(-1)[torch.arange(len(ids)), answer].numpy()
                np.testing.assert_allclose(got[(scope, kind)][1], prob, rtol=1e-4, atol=0)
                moved = max(moved, float(np.abs(prob / got["base"][1] - 1).max()))
    assert moved > 1e-2  # the patches change the probabilities (relative: a tiny random model's are small)


def _families():
    from unit.models.test_architectures import FAMILIES

    return list(FAMILIES)


@pytest.mark.parametrize("model_type", _families())
def test_suffix_run_is_exact_on_every_architecture_family(model_type):
    """A z patch late in the prompt by a suffix run equals the full run (max |d logit| <= 1e-4) on the tiny
    model of each of the families of tests/unit/models/test_architectures.py (one forward pair per family)."""
    from unit.models.test_architectures import LAYERS, VOCAB, build_family

    lm = build_family(model_type)
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(1, VOCAB, (2, 12), generator=g)
    pos, rows, layer = torch.tensor([9, 10]), torch.arange(2), LAYERS - 2  # a later layer reads the patch
    cols = lm.arch.columns("z", 1, lm.shape)
    value = 20 * torch.randn(2, cols.stop - cols.start, generator=g)  # far from clean: the patch moves the logits
    patch = Patch("z", layer, value, pos, cols)
    clean = run(lm, ids, keep_kv=True)
    full = run(lm, ids, [patch]).logits
    suffix = run(lm, ids, [patch], prefix=clean.kv)
    err, moved = (suffix.logits - full).abs().max(), (full - clean.logits).abs().max()
    assert suffix.start == 9 and err <= TOL
    assert moved > max(100 * err, 1e-5)  # not vacuous: a run that dropped the patch would miss by ``moved``


def test_suffix_runs_refused_where_not_exact(tiny_llama, prompts, monkeypatch):
    """A model with non-attention layers (e.g. linear attention, state-space) or a recurrent state is refused
    a prefix, with its family named and full-length runs suggested, before any forward."""
    clean_ids = prompts[0]
    clean = run(tiny_llama, clean_ids, keep_kv=True)
    config = tiny_llama.model.config
    monkeypatch.setattr(config, "layer_types", ["full_attention", "linear_attention"], raising=False)
    with pytest.raises(ValueError, match=r"\(llama\).*linear_attention.*run without a prefix"):
        run(tiny_llama, clean_ids, prefix=clean.kv)
    monkeypatch.setattr(config, "layer_types", ["full_attention", "sliding_attention"], raising=False)
    run(tiny_llama, clean_ids, prefix=clean.kv)  # attention layers only: allowed
    monkeypatch.setattr(tiny_llama.model, "_is_stateful", True, raising=False)
    with pytest.raises(ValueError, match=r"\(llama\).*recurrent state.*run without a prefix"):
        run(tiny_llama, clean_ids, prefix=clean.kv)
