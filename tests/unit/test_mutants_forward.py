"""Tests added from mutmut's survivors in ``mechdiff/methods/knowledge/forward.py`` (see benchmarks/mutation.md): the
RMS post-norm gain in the norm's own dtype (bf16 / fp16 included: they were refused before) and the refusal of
other norms, the per-head weight rows (a view where contiguous), edge gradients under mean ablation, and
sink-apart means from prompts of different lengths."""

from __future__ import annotations

import dataclasses
import math

import numpy as np
import pytest
import torch
from transformers.models.gemma3.modeling_gemma3 import Gemma3RMSNorm
from transformers.models.olmo2.modeling_olmo2 import Olmo2RMSNorm

from conftest import make_tiny
from mechdiff.methods.knowledge.forward import _rms_gain, _rows, check_supported, edge_forward, edge_gradients, mean_ablation
from mechdiff.methods.knowledge.graph import Graph

D = 64


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("cls", [Gemma3RMSNorm, Olmo2RMSNorm])
def test_rms_gain_is_the_norm_of_ones_in_the_norms_dtype(cls, dtype):
    """``norm(1) = g / sqrt(1 + eps)``: Gemma scales by ``1 + w``, OLMo 2 by ``w``; half precision is accepted."""
    norm = cls(D, eps=1e-6)
    w = torch.randn(D, generator=torch.Generator().manual_seed(1)) * 0.3 + (0 if cls is Gemma3RMSNorm else 1)
    with torch.no_grad():
        norm.weight.copy_(w)
    norm = norm.to(dtype)
    gain = _rms_gain(norm, D, "post-norm")
    assert gain.dtype == dtype and not gain.requires_grad
    w = norm.weight.double()
    want = (1 + w if cls is Gemma3RMSNorm else w) / math.sqrt(1 + 1e-6)
    eps = torch.finfo(dtype).eps
    torch.testing.assert_close(gain.double(), want, rtol=max(eps, 1e-6), atol=0)  # Gemma computes in float32


def test_rms_gain_of_a_norm_without_parameters():
    norm = torch.nn.RMSNorm(D, eps=1e-6, elementwise_affine=False)
    gain = _rms_gain(norm, D, "post-norm")
    assert gain.dtype == torch.float32
    torch.testing.assert_close(gain, torch.full((D,), 1 / math.sqrt(1 + 1e-6)))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_rms_gain_refuses_a_layer_norm(dtype):
    norm = torch.nn.LayerNorm(D)
    with torch.no_grad():
        norm.bias.fill_(0.5)
    with pytest.raises(ValueError) as err:
        _rms_gain(norm.to(dtype), D, "attention post-norm of layer 2")
    assert str(err.value) == ("knowledge circuits: the attention post-norm of layer 2 (LayerNorm) is not an RMS norm, "
                              "so a head's share of its output is not defined; only RMS post-norms are supported")


def test_check_supported_names_the_post_norm_it_refuses():
    from unit.models.test_architectures import build_family

    model = build_family("gemma3_text", seed=4)
    model = dataclasses.replace(model, name="tiny-gemma3-layernorm")
    block = model.arch.block(model.model, 1)
    path = model.arch.attn_post_norm
    parent = block
    for part in path.split(".")[:-1]:
        parent = getattr(parent, part)
    setattr(parent, path.split(".")[-1], torch.nn.LayerNorm(model.shape.d_model))
    with pytest.raises(ValueError, match=r"the attention post-norm of layer 1 \(LayerNorm\) is not an RMS norm"):
        check_supported(model)


def test_edge_forward_on_a_bf16_gemma3():
    """Every edge kept reproduces a bf16 Gemma 3 (post-norms) to bf16 precision."""
    from unit.models.test_architectures import IDS, build_family

    model = build_family("gemma3_text", seed=5)
    model.model.to(torch.bfloat16)
    ids = IDS
    with torch.no_grad():
        full = edge_forward(model, Graph.for_model(model), ids, None).logits.float()
        clean = model.model(input_ids=ids, use_cache=False).logits[:, -1].float()
    assert full.dtype == clean.dtype
    torch.testing.assert_close(full, clean, atol=0.05 * float(clean.abs().max()), rtol=0.05)


def test_rows_is_a_view_of_contiguous_ranges_and_a_copy_in_order_otherwise():
    t = torch.arange(24.0).view(12, 2)
    view = _rows(t, [slice(0, 2), slice(2, 4), slice(4, 6)])
    assert view.data_ptr() == t.data_ptr() and torch.equal(view, t[:6])
    interleaved = _rows(t, [slice(0, 2), slice(6, 8), slice(2, 4)])
    assert torch.equal(interleaved, torch.cat([t[0:2], t[6:8], t[2:4]]))


def test_edge_gradients_under_mean_ablation_are_the_derivative_of_the_mask():
    """``d metric / d m_e`` with the removed share carrying the sender's mean: a finite difference of the mask."""
    model = make_tiny("llama", None, seed=6)
    graph = Graph.from_shape(model.shape)
    ids = torch.randint(0, 2000, (3, 5), generator=torch.Generator().manual_seed(3))
    abl = mean_ablation(model, graph, [type("B", (), {"ids": ids})()])
    answers = torch.tensor([5, 17, 300])

    def metric(logits):
        return torch.log_softmax(logits, -1)[torch.arange(3), answers].sum()

    scores = edge_gradients(model, graph, ids, metric, ablation=abl)
    zero = edge_gradients(model, graph, ids, metric)
    assert not np.allclose(scores, zero, atol=1e-3)
    h = 1e-2
    with torch.no_grad():
        base = float(metric(edge_forward(model, graph, ids, None, abl).logits))
        for e in np.argsort(-np.abs(scores))[:4]:
            m = np.ones(graph.n_edges, dtype=np.float32)
            m[e] = 1 - h
            fd = (base - float(metric(edge_forward(model, graph, ids, m, abl).logits))) / h
            assert fd == pytest.approx(scores[e], rel=0.05, abs=1e-3)


def test_mean_ablation_from_prompts_of_different_lengths():
    """A batch of one-token prompts adds to the sink mean only; the later positions' mean is the longer batch's."""
    model = make_tiny("llama", None, seed=7)
    graph = Graph.from_shape(model.shape)
    gen = torch.Generator().manual_seed(4)
    one, four = torch.randint(0, 2000, (2, 1), generator=gen), torch.randint(0, 2000, (3, 4), generator=gen)
    abl = mean_ablation(model, graph, [type("B", (), {"ids": one})(), type("B", (), {"ids": four})()])
    with torch.no_grad():
        a = edge_forward(model, graph, one, None, keep_outputs=True).outputs.double()
        b = edge_forward(model, graph, four, None, keep_outputs=True).outputs.double()
    assert abl.kind == "mean" and abl.means.shape == (graph.n_senders, 2, model.shape.d_model)  # ACDC records the kind
    sink = torch.cat([a[:, :, 0], b[:, :, 0]], 1).mean(1)
    torch.testing.assert_close(abl.means[:, 0].double(), sink, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(abl.means[:, 1].double(), b[:, :, 1:].mean((1, 2)), atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("change, reason", [
    (dict(flow=False), "the block's data flow could not be probed (a model whose weights are not here, e.g. on NDIF); "
                       "run it locally"),
    (dict(mlp=None), "its MLP is not one module of the block (MLP{l} is a node of the graph)"),
    (dict(additive=None), "whether a block's output is the sum of its input, attention and MLP outputs could not be "
                          "checked (no weights here); run it locally"),
    (dict(additive=False), "a block's output is not its input plus its attention and MLP outputs (a residual "
                           "multiplier?), so the residual stream is not a sum of senders"),
], ids=["no-flow", "mlp", "additive-unknown", "not-additive"])
def test_check_supported_refuses_with_the_model_and_the_reason(change, reason):
    model = make_tiny("llama", None, seed=8)
    check_supported(model)  # the model itself is supported
    model.__dict__["arch"] = dataclasses.replace(model.arch, **change)  # as an adapter would describe another model
    with pytest.raises(ValueError) as err:
        check_supported(model)
    assert str(err.value) == f"knowledge circuits on tiny-llama-8 (llama): {reason}"


def test_mean_ablation_without_means_says_how_to_build_them():
    from mechdiff.methods.knowledge.forward import Ablation

    assert Ablation("zero").values(3) is None
    with pytest.raises(ValueError) as err:
        Ablation("mean").values(3)
    assert str(err.value) == "mean ablation needs means; build it with mean_ablation(model, graph, batches)"


def test_edge_forward_refusals_say_what_is_wrong():
    from mechdiff.methods.knowledge.forward import EdgeResume

    model = make_tiny("llama", None, seed=9)
    graph = Graph.from_shape(model.shape)
    ids = torch.randint(0, 2000, (2, 4), generator=torch.Generator().manual_seed(6))
    with pytest.raises(ValueError) as err:
        edge_forward(model, Graph.from_shape(model.shape, parallel=True), ids, None)
    assert str(err.value) == ("the graph has parallel blocks but tiny-llama-9 (llama) has not; build it with "
                              "Graph.for_model(model)")
    neox = make_tiny("gpt_neox", None, seed=9)  # parallel attention and MLP
    with pytest.raises(ValueError) as err:
        edge_forward(neox, Graph.from_shape(neox.shape), ids, None)
    assert str(err.value) == ("the graph lacks parallel blocks but tiny-gpt_neox-9 (gpt_neox) has; build it with "
                              "Graph.for_model(model)")
    outs = torch.zeros(5, 2, 4, model.shape.d_model)  # layer 1 needs EMB, 4 heads and MLP0: 6 senders
    with pytest.raises(ValueError) as err:
        edge_forward(model, graph, ids, None, resume=EdgeResume(1, outs))
    assert str(err.value) == "resume at layer 1 needs the outputs of the first 6 senders for batch 2; got (5, 2, 4, 32)"
    with pytest.raises(ValueError) as err:
        edge_gradients(model, graph, ids, lambda logits: logits.sum(), mask=np.ones((2, graph.n_edges)))
    assert str(err.value) == "gradients are taken for one circuit at a time: give a mask vector, not a stack"
    with pytest.raises(ValueError) as err:
        edge_forward(model, graph, ids, None, resume=EdgeResume(1, torch.zeros(6, 2, 4, 32)), _grad_alpha=1.0,
                     _grad_inputs=[], _deltas=[])
    assert str(err.value) == "resume and stacked masks are for forward passes only, not gradients"


@pytest.mark.parametrize("keep_first", [False, True])
def test_eap_ig_point_equals_the_gradient_at_that_mask(keep_first):
    """At every mask equal to ``alpha`` (the EAP-IG path, one shared input per layer) the gradients equal those
    taken at the explicit mask ``alpha * 1`` (per-receiver inputs), under mean ablation, with or without the
    sink position kept."""
    from mechdiff.methods.knowledge.forward import Ablation

    model = make_tiny("llama", None, seed=10)
    graph = Graph.from_shape(model.shape)
    ids = torch.randint(0, 2000, (2, 5), generator=torch.Generator().manual_seed(7))
    means = mean_ablation(model, graph, [type("B", (), {"ids": ids})()]).means
    abl = Ablation("mean", means, keep_first=keep_first)
    answers = torch.tensor([5, 17])

    def metric(logits):
        return torch.log_softmax(logits, -1)[torch.arange(2), answers].sum()

    path = edge_gradients(model, graph, ids, metric, alpha=0.4, ablation=abl)
    point = edge_gradients(model, graph, ids, metric, ablation=abl, mask=np.full(graph.n_edges, 0.4, dtype=np.float32))
    np.testing.assert_allclose(path, point, rtol=1e-4, atol=1e-6)
