"""Tests added from mutmut's survivors in ``mechdiff/patching/core.py`` (see benchmarks/mutation.md):
the knowledge forward's site writes on fused and interleaved Q/K/V layouts, checked against the
patching driver's column patches, ``trace_sites``' gradient default and resumed runs, suffix-run refusals."""

from __future__ import annotations

import re

import pytest
import torch

from conftest import make_tiny
from mechdiff.patching.core import Patch, Resume, _join, _shifted, _suffix_hidden, run, suffix_start, trace_sites


def _qkv_of(model, nn, layer: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """From a fused projection: Q ``"b p (head d)"`` and K, V ``"b p (group d)"`` read through ``arch.columns`` (not ``fused_order``)."""
    arch, shape = model.arch, model.shape
    step = shape.n_heads // shape.n_kv_heads
    parts = []
    for kind, heads in (("q", range(shape.n_heads)), ("k", range(0, shape.n_heads, step)),
                        ("v", range(0, shape.n_heads, step))):
        site = arch.projection(nn, "q", layer).output  # fused layouts: one projection
        parts.append(torch.cat([site[..., arch.columns(kind, h, shape)] for h in heads], -1).clone())
    return parts[0], parts[1], parts[2]


@pytest.mark.parametrize("family", ["gpt2", "gpt_neox"])  # separate: the sink tests in test_mutants.py
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
    with pytest.raises(ValueError, match="^" + re.escape(
            "mm (hybrid): suffix runs (prefix=) are exact only over attention layers' keys and values, and its "
            "layers include ['linear_attention']; run without a prefix (full-length runs)") + "$"):
        check_suffix_support(multimodal)
    assert not suffix_supported(multimodal)

    class Recurrent:
        config = SimpleNamespace(layer_types=None)
        _is_stateful = True

    with pytest.raises(ValueError, match=re.escape("rnn (Recurrent): suffix runs") + ".*and it carries a recurrent "
                       "state; run without"):
        check_suffix_support(SimpleNamespace(name="rnn", model=Recurrent()))
    plain = SimpleNamespace(name="p", model=SimpleNamespace(config=SimpleNamespace(
        model_type="llama", layer_types=["full_attention", "sliding_attention"])))
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
        (dict(patches=[Patch("z", 1, z, torch.tensor([2, 2]))], prefix=kv, start=4),
         "start 4 lies after the first patched or read-out position 2"),
        (dict(prefix=Prefix(short.keys, short.values), start=4), "the prefix holds 3 positions, fewer than start 4"),
        (dict(capture=[("z", 0)], resume=Resume(1, torch.zeros(2, 6, 64))),
         "site ('z', 0) lies before the resumed layer 1; resume at or before the first patched or captured layer"),
        (dict(prefix=kv, position_ids=torch.arange(6)[None]),
         "position_ids are derived in a suffix run; give either position_ids or prefix"),
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
    for kind, head, cols in (("z", 2, slice(16, 24)), ("q", 3, slice(24, 32)), ("k", 3, slice(8, 16)),
                             ("v", 0, slice(0, 8))):
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
