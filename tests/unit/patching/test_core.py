"""Suffix runs (positions >= start from the clean run's key/value cache) against full runs: z/q/k/v
patches at every position kind of the entity-tracking prompts, with and without a layer resume,
senders stacked along the batch, on a tiny model of every family (sliding-window ones included),
padded batches, the remote path (nnsight's local simulation) and SmolLM2 (slow)."""

from __future__ import annotations

import re

import pytest
import torch
from conftest import make_tiny
from einops import repeat

from mechdiff.common.components import Head
from mechdiff.models.loading import LoadedModel
from mechdiff.models.registry import ModelSpec
from mechdiff.patching.core import (
    Patch,
    Prefix,
    Resume,
    _join,
    _shifted,
    _suffix_hidden,
    head_patch,
    run,
    suffix_start,
    trace_sites,
)
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

    common = dict(
        num_hidden_layers=3,
        num_attention_heads=4,
        num_key_value_heads=2,
        hidden_size=32,
        intermediate_size=64,
        vocab_size=49152,
        max_position_embeddings=256,
    )
    cfg = {
        "mistral": lambda: MistralConfig(sliding_window=4, **common),
        "gemma2": lambda: Gemma2Config(sliding_window=4, head_dim=8, **common),
        "qwen2": lambda: Qwen2Config(use_sliding_window=True, sliding_window=4, max_window_layers=1, **common),
    }[family]()
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(cfg, attn_implementation="eager").eval().requires_grad_(False)
    return LoadedModel(
        f"tiny-{family}", ModelSpec(f"tiny-{family}", "local", "<memory>"), model, tokenizer, {"kind": "memory"}
    )


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
            resumed = run(
                model, clean_ids, patch, prefix=clean.kv, resume=Resume(layer, clean.captured[("resid", layer - 1)])
            )
            assert suffix.start == int(pos.min()), name
            for other in (suffix, resumed):
                worst = max(worst, float((other.logits - full.logits).abs().max()))
            z_full = full.captured[("z", layer + 1)][:, suffix.start :]
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
        mask[copy * n : (copy + 1) * n, head * 8 : (head + 1) * 8] = 0
    stacked_ids, stacked_pos = repeat(clean_ids, "b p -> (s b) p", s=3), repeat(pos, "b -> (s b)", s=3)
    patch = Patch("z", 1, value, stacked_pos, mask=mask)
    for kwargs in ({}, {"resume": Resume(1, clean.captured[("resid", 0)])}):
        stacked = run(tiny_llama, stacked_ids, [patch], prefix=clean.kv, **kwargs).logits
        for copy, head in enumerate((0, 2, 3)):
            cols = slice(head * 8, (head + 1) * 8)
            one = run(tiny_llama, clean_ids, [Patch("z", 1, src[torch.arange(n), pos][:, cols], pos, cols)]).logits
            assert (stacked[copy * n : (copy + 1) * n] - one).abs().max() <= TOL
    assert all(torch.equal(a, b) for a, b in zip(before, clean.kv.keys))


def test_slices_readouts_and_derived_starts(tiny_model, prompts):
    clean_ids, source_ids, positions = prompts
    length = clean_ids.shape[1]
    clean = run(tiny_model, clean_ids, keep_kv=True)
    src = run(tiny_model, source_ids, capture=[("z", 1)]).captured[("z", 1)]
    start = int(positions["query_label"].min())
    patch = Patch("z", 1, src[:, start : start + 2], slice(start, start + 2))
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
    assert everywhere.start == 0 and torch.equal(
        everywhere.logits, run(tiny_model, clean_ids, [Patch("z", 1, src)]).logits
    )
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
    from mechdiff.common.components import Head
    from mechdiff.methods.cmap import _base_scores
    from mechdiff.methods.cmap_patches import CMAP_KINDS, capture_sites, cmap_patches, scopes
    from mechdiff.tasks.entity_tracking import batch_tensors, generate

    base, ft = make_tiny("llama", smollm2_tokenizer, seed=1), make_tiny("llama", smollm2_tokenizer, seed=2)
    circuit = Circuit(
        "tiny", "entity-tracking", {"A": [Head(2, 0), Head(1, 3)], "B": [Head(1, 1)]}, {"A": "last", "B": "query_label"}
    )
    batch = batch_tensors(generate(smollm2_tokenizer, 4, n_boxes=3, seed=0))
    ids, answer = batch["input_ids"], batch["answer_ids"]
    captured = run(ft, ids, capture=capture_sites(circuit.heads())).captured
    kinds = list(CMAP_KINDS)
    from mechdiff.methods.cmap_patches import isolation_patches

    base_z = {
        l: t for (k, l), t in run(base, ids, capture=[("z", l) for l in range(base.shape.n_layers)]).captured.items()
    }
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
    pos, layer = torch.tensor([9, 10]), LAYERS - 2  # a later layer reads the patch
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


def _qkv_of(model, nn, layer: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """From a fused projection: Q ``"b p (head d)"`` and K, V ``"b p (group d)"`` read through ``arch.columns`` (not
    ``fused_order``)."""
    arch, shape = model.arch, model.shape
    step = shape.n_heads // shape.n_kv_heads
    parts = []
    for kind, heads in (
        ("q", range(shape.n_heads)),
        ("k", range(0, shape.n_heads, step)),
        ("v", range(0, shape.n_heads, step)),
    ):
        site = arch.projection(nn, "q", layer).output  # fused layouts: one projection
        parts.append(torch.cat([site[..., arch.columns(kind, h, shape)] for h in heads], -1).clone())
    return parts[0], parts[1], parts[2]


@pytest.mark.parametrize(
    "family", ["gpt2", "gpt_neox"]
)  # separate: the sink tests in methods/knowledge/test_forward.py
def test_write_qkv_matches_column_patches(family):
    """Writing back the layer's own Q/K/V is the clean run; writing V with KV group 0 zeroed equals the
    driver's column patch of that group; on the fused (GPT-2) and interleaved (NeoX) layouts."""
    model = make_tiny(family, None, seed=2)
    ids = torch.randint(0, 500, (2, 6), generator=torch.Generator().manual_seed(1))
    layer, d = 1, model.shape.d_head
    with torch.no_grad():
        clean = model.model(ids).logits[:, -1]

    def body(sites, zero_group: bool):
        q, k, v = _qkv_of(model, sites.nn, layer)
        if zero_group:
            v = v.clone()
            v[..., :d] = 0
        sites.write_qkv(layer, q, k, v)
        return sites.logits().clone()

    same = trace_sites(model, ids, lambda s: body(s, False))
    torch.testing.assert_close(same, clean, atol=1e-5, rtol=1e-5)
    zeroed = trace_sites(model, ids, lambda s: body(s, True))
    cols = model.arch.columns("v", 0, model.shape)
    expected = run(model, ids, [Patch("v", layer, torch.zeros(1, 1, d), columns=cols)]).logits
    torch.testing.assert_close(zeroed, expected, atol=1e-5, rtol=1e-5)
    assert not torch.allclose(zeroed, clean, atol=1e-4)  # the write took effect


def test_trace_sites_keeps_no_graph_unless_asked():
    """``grad`` defaults to False: the returned logits carry no autograd graph; ``grad=True`` keeps it."""
    model = make_tiny("llama", None, seed=2)
    ids = torch.randint(0, 500, (1, 5), generator=torch.Generator().manual_seed(1))
    w = torch.ones((), requires_grad=True)  # the model's own weights are frozen
    assert not trace_sites(model, ids, lambda s: s.logits() * w).requires_grad
    assert trace_sites(model, ids, lambda s: s.logits() * w, grad=True).requires_grad


def test_suffix_start_is_the_earliest_written_or_read_position():
    """The minimum over the read-out positions and each patch's first position (negative ones counted from
    the end); 0 as soon as a patch writes every position; the last position with neither."""
    v = torch.zeros(1, 1)
    assert suffix_start([], None, 6) == 5
    assert suffix_start([], torch.tensor([4, 2]), 6) == 2
    assert suffix_start([Patch("z", 0, v, positions=slice(3, None))], torch.tensor([5, 5]), 6) == 3
    assert suffix_start([Patch("z", 0, v, positions=torch.tensor([-2, -1]))], None, 6) == 4
    assert suffix_start([Patch("z", 0, v, positions=torch.tensor([0, 3]))], None, 6) == 0
    assert suffix_start([Patch("z", 0, v, positions=slice(None, 3))], None, 6) == 0
    assert suffix_start([Patch("z", 0, v, positions=slice(4, None)), Patch("z", 1, v)], None, 6) == 0


def test_suffix_hidden_cuts_stacks_and_names_bad_shapes():
    """A full-length stream is cut at ``start``, a suffix-length one kept; a batch of ``b`` is repeated to the
    stacked ``copies * b`` rows; a wrong length or a batch that does not divide is refused with both sizes."""
    hidden = torch.arange(2 * 6 * 5, dtype=torch.float).reshape(2, 6, 5)
    assert torch.equal(_suffix_hidden(hidden, 2, 6, 0), hidden)
    assert torch.equal(_suffix_hidden(hidden, 2, 6, 2), hidden[:, 2:])
    suffix = hidden[:, :4]
    assert torch.equal(_suffix_hidden(suffix, 2, 6, 2), suffix)  # already the suffix: not cut again
    assert torch.equal(_suffix_hidden(hidden, 6, 6, 2), hidden[:, 2:].repeat(3, 1, 1))
    assert torch.equal(_suffix_hidden(hidden[:1, 2:], 4, 6, 2), hidden[:1, 2:].repeat(4, 1, 1))  # 4 positions too
    with pytest.raises(ValueError, match=r"covers 3 positions; expected 6 or the suffix's 4"):
        _suffix_hidden(hidden[:, :3], 2, 6, 2)
    with pytest.raises(ValueError, match=r"has batch 2, which does not divide 3"):
        _suffix_hidden(hidden, 3, 6, 2)


def test_masked_patch_of_a_slice_mixes_with_the_site():
    """``site <- site * mask + value * (1 - mask)`` on the sliced positions and columns only."""
    site = torch.randn(2, 5, 4, generator=torch.Generator().manual_seed(0))
    before = site.clone()
    value, mask = torch.full((2, 2, 2), 3.0), torch.tensor([0.25, 1.0])
    Patch("z", 0, value, positions=slice(2, 4), columns=slice(1, 3), mask=mask).apply(site)
    expected = before.clone()
    expected[:, 2:4, 1:3] = before[:, 2:4, 1:3] * mask + 3.0 * (1 - mask)
    torch.testing.assert_close(site, expected)


def test_shifted_and_join_refuse_what_a_suffix_run_cannot_do():
    """A patch of every position, or a slice starting before ``start``, cannot be shifted; a batch that is not
    a multiple of the prefix's cannot stack it; each refusal names the offending patch or sizes."""
    v = torch.zeros(1, 1)
    with pytest.raises(ValueError, match=r"every position \(z, 1\) needs start=0"):
        _shifted(Patch("z", 1, v), 2)
    with pytest.raises(ValueError, match=r"slice\(1, None, None\) of \(z, 1\) starts before position 2"):
        _shifted(Patch("z", 1, v, positions=slice(1, None)), 2)
    with pytest.raises(ValueError, match=r"starts before position 2"):
        _shifted(Patch("z", 1, v, positions=slice(3, None, 2)), 2)  # a step: not one run of positions
    with pytest.raises(ValueError, match=r"starts before position 1"):
        _shifted(Patch("z", 1, v, positions=slice(None, 3)), 1)
    assert _shifted(Patch("z", 1, v, positions=slice(3, 5)), 2).positions == slice(1, 3)
    assert _shifted(Patch("z", 1, v, positions=slice(3, None)), 2).positions == slice(1, None)
    with pytest.raises(ValueError, match=r"batch 3 cannot stack a prefix of batch 2"):
        _join(torch.zeros(2, 1, 4, 2), torch.zeros(3, 1, 1, 2))


def test_trace_sites_resumed_from_the_clean_stream_is_the_clean_run():
    """``resume``: blocks below ``resume.layer`` are skipped, each from the given stream; resumed from the
    clean stream the logits are the clean run's, and from a changed stream they change."""
    model = make_tiny("llama", None, seed=2)
    ids = torch.randint(0, 500, (2, 5), generator=torch.Generator().manual_seed(1))
    clean = run(model, ids, capture=[("resid", 1)])
    hidden = clean.captured[("resid", 1)]
    resumed = trace_sites(model, ids, lambda s: s.logits().clone(), resume=Resume(2, hidden))
    torch.testing.assert_close(resumed, clean.logits, atol=1e-5, rtol=1e-5)
    other = trace_sites(model, ids, lambda s: s.logits().clone(), resume=Resume(2, hidden * 1.5))
    assert not torch.allclose(other, clean.logits, atol=1e-3)


def test_suffix_support_reads_the_text_config_and_names_the_reason():
    """A multimodal model's layer types live in its text config; a recurrent state is refused too; the
    refusal names the model, its family, the reason and the way out."""
    from types import SimpleNamespace

    from mechdiff.patching.core import check_suffix_support, suffix_supported

    text = SimpleNamespace(model_type="hybrid", layer_types=["full_attention", "linear_attention", "sliding_attention"])
    multimodal = SimpleNamespace(name="mm", model=SimpleNamespace(config=SimpleNamespace(get_text_config=lambda: text)))
    with pytest.raises(
        ValueError,
        match="^"
        + re.escape(
            "mm (hybrid): suffix runs (prefix=) are exact only over attention layers' keys and values, and its "
            "layers include ['linear_attention']; run without a prefix (full-length runs)"
        )
        + "$",
    ):
        check_suffix_support(multimodal)
    assert not suffix_supported(multimodal)

    class Recurrent:
        config = SimpleNamespace(layer_types=None)
        _is_stateful = True

    with pytest.raises(
        ValueError, match=re.escape("rnn (Recurrent): suffix runs") + ".*and it carries a recurrent state; run without"
    ):
        check_suffix_support(SimpleNamespace(name="rnn", model=Recurrent()))
    plain = SimpleNamespace(
        name="p",
        model=SimpleNamespace(
            config=SimpleNamespace(model_type="llama", layer_types=["full_attention", "sliding_attention"])
        ),
    )
    check_suffix_support(plain)
    assert suffix_supported(plain)


@pytest.mark.parametrize("family", ["llama", "gpt2"])
def test_q_k_v_of_one_layer_captured_together_are_each_its_own(family):
    """Separate projections (llama) are three sites; a fused one (GPT-2) is one site, read once per layer
    (each kind's columns are taken from it later): capturing Q, K and V of one layer in one run gives what
    each capture alone gives."""
    model = make_tiny(family, None, seed=2)
    ids = torch.randint(0, 500, (2, 5), generator=torch.Generator().manual_seed(1))
    together = run(model, ids, capture=[("q", 1), ("k", 1), ("v", 1)]).captured
    for kind in ("q", "k", "v"):
        alone = run(model, ids, capture=[(kind, 1)]).captured[(kind, 1)]
        torch.testing.assert_close(together[(kind, 1)], alone, rtol=0, atol=0)  # exact: one forward, read twice
    if model.arch.qkv_layout == "separate":
        assert not torch.equal(together[("q", 1)][..., :8], together[("k", 1)][..., :8])


def test_run_refuses_what_it_cannot_do_and_says_so():
    from mechdiff.patching.core import Prefix

    model = make_tiny("llama", None, seed=2)
    ids = torch.randint(0, 500, (2, 6), generator=torch.Generator().manual_seed(1))
    kv = run(model, ids, keep_kv=True).kv
    short = run(model, ids[:, :3], keep_kv=True).kv
    z = torch.zeros(2, 1, 32)
    cases = [
        (dict(prefix=kv, keep_kv=True), "keep_kv needs a full run: no prefix, resume or stop"),
        (
            dict(patches=[Patch("z", 1, z, torch.tensor([2, 2]))], prefix=kv, start=4),
            "start 4 lies after the first patched or read-out position 2",
        ),
        (dict(prefix=Prefix(short.keys, short.values), start=4), "the prefix holds 3 positions, fewer than start 4"),
        (
            dict(capture=[("z", 0)], resume=Resume(1, torch.zeros(2, 6, 64))),
            "site ('z', 0) lies before the resumed layer 1; resume at or before the first patched or captured layer",
        ),
        (
            dict(prefix=kv, position_ids=torch.arange(6)[None]),
            "position_ids are derived in a suffix run; give either position_ids or prefix",
        ),
    ]
    for kwargs, message in cases:
        with pytest.raises(ValueError, match="^" + re.escape(message) + "$"):
            run(model, ids, **kwargs)


def test_head_patch_writes_the_heads_columns():
    """``head_patch``: a patch of one head's columns of a site (a query head's Q; its KV group's K and V)."""
    from mechdiff.common.components import Head
    from mechdiff.patching.core import head_patch

    model = make_tiny("llama", None, seed=2)  # 4 query heads of 8, 2 KV groups
    value, at = torch.ones(2, 8), torch.tensor([3, 4])
    for kind, head, cols in (
        ("z", 2, slice(16, 24)),
        ("q", 3, slice(24, 32)),
        ("k", 3, slice(8, 16)),
        ("v", 0, slice(0, 8)),
    ):
        patch = head_patch(model, kind, Head(1, head), value, at)
        assert (patch.kind, patch.layer, patch.columns) == (kind, 1, cols)
        assert patch.value is value and patch.positions is at


def test_a_suffix_run_starts_no_later_than_its_readout():
    """``readout`` before every patched position: the suffix run starts at the readout, whose logits are the
    full run's."""
    from mechdiff.common.components import Head
    from mechdiff.patching.core import head_patch

    model = make_tiny("llama", None, seed=2)
    ids = torch.randint(0, 500, (2, 7), generator=torch.Generator().manual_seed(1))
    kv = run(model, ids, keep_kv=True).kv
    patch = head_patch(model, "z", Head(1, 2), torch.ones(2, 8), torch.tensor([5, 6]))
    readout = torch.tensor([2, 3])
    full = run(model, ids, [patch], readout=readout).logits
    suffix = run(model, ids, [patch], readout=readout, prefix=kv)
    assert suffix.start == 2
    torch.testing.assert_close(suffix.logits, full, rtol=1e-5, atol=1e-5)


def _ids(n=2, length=9):
    return torch.randint(0, 1000, (n, length), generator=torch.Generator().manual_seed(0))


def test_plain_run_matches_model(tiny_model):
    ids = _ids()
    with torch.no_grad():
        expected = tiny_model.model(ids).logits[:, -1]
    assert torch.allclose(run(tiny_model, ids).logits, expected, atol=1e-6)


@pytest.mark.parametrize("kind", ["z", "q", "k", "v"])
def test_writing_a_slice_back_is_bit_identical(tiny_model, kind):
    ids = _ids()
    clean = run(tiny_model, ids, capture=[(kind, 1)])
    cols = tiny_model.arch.columns(kind, 2, tiny_model.shape)
    same = Patch(kind, 1, clean.captured[(kind, 1)][:, :, cols].clone(), None, cols)
    assert torch.equal(run(tiny_model, ids, [same]).logits, clean.logits)


def test_zeroing_one_head_changes_only_it(tiny_model):
    ids = _ids()
    shape = tiny_model.shape
    sites = [(k, l) for l in range(shape.n_layers) for k in ("q", "z")]
    clean = run(tiny_model, ids, capture=sites)
    zeroed = run(
        tiny_model, ids, [head_patch(tiny_model, "z", Head(1, 2), torch.zeros(2, 9, shape.d_head))], capture=sites
    )
    cols = tiny_model.arch.columns("z", 2, shape)
    z1 = zeroed.captured[("z", 1)]
    assert torch.equal(z1[:, :, cols], torch.zeros_like(z1[:, :, cols]))
    other = torch.ones(z1.shape[-1], dtype=torch.bool)
    other[cols] = False
    assert torch.equal(z1[:, :, other], clean.captured[("z", 1)][:, :, other])  # same layer: untouched
    assert torch.equal(zeroed.captured[("z", 0)], clean.captured[("z", 0)])  # earlier layer: untouched
    assert torch.equal(zeroed.captured[("q", 1)], clean.captured[("q", 1)])  # own layer's Q: before z
    assert not torch.allclose(zeroed.captured[("q", 2)], clean.captured[("q", 2)])  # later layers: changed
    assert not torch.allclose(zeroed.logits, clean.logits)


def test_kv_columns_follow_groups(tiny_model):
    shape, arch = tiny_model.shape, tiny_model.arch
    groups = {arch.columns("k", h, shape).start for h in range(shape.n_heads)}
    assert len(groups) == shape.n_kv_heads
    qs = [arch.columns("q", h, shape) for h in range(shape.n_heads)]
    assert len({s.start for s in qs}) == shape.n_heads


def test_q_slice_is_the_head_query(tiny_model):
    """The q columns of head h are what the model multiplies with head h's keys: zeroing
    them makes head h attend uniformly (checked on the attention pattern)."""
    ids = _ids()
    shape = tiny_model.shape
    z = torch.zeros(2, 9, shape.d_head)
    with torch.no_grad(), tiny_model.nn.trace(input_ids=ids):
        tiny_model.arch.site(tiny_model.nn, "q", 0)[:, :, tiny_model.arch.columns("q", 1, shape)] = z
        pattern = tiny_model.arch.site(tiny_model.nn, "pattern", 0).save()
    causal_uniform = torch.tril(torch.ones(9, 9)) / torch.arange(1, 10)[:, None]
    assert torch.allclose(pattern[:, 1], causal_uniform.expand(2, 9, 9), atol=1e-5)
    assert not torch.allclose(pattern[:, 0], causal_uniform.expand(2, 9, 9), atol=1e-3)
