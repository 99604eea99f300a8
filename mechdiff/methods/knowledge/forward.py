"""The edge-patching forward pass: every receiver reads its own residual stream, on the adapter's sites.

The residual stream entering a layer is the sum of its senders' outputs (``EMB``: the input of
block 0; each head's output after the output projection; each MLP's output). Receiver ``r`` of a
circuit reads

    x_r = sum_s ( m_rs * a_s + (1 - m_rs) * abl_s )  =  sum_s abl_s + sum_s m_rs * (a_s - abl_s)

where ``a_s`` is sender ``s``'s output *in this run* (computed from its own patched inputs),
``abl_s`` its ablated value (zero, or its mean over the relation's facts) and ``m_rs`` the
edge's mask (1: in the circuit). The receivers' inputs are written where the model reads them,
through the one driver (`mechdiff.patching.core.trace_sites`) on the architecture adapter's
sites, so every family the adapters resolve is served:

- Q of head ``h``: its columns of the Q projection output <- ``attn_norm(x_r) @ W_q[h].T + b_q[h]``
  (before any Q norm and rotary embedding; fused and interleaved projections included),
- K / V of KV group ``g``: the group's K / V columns (no ungrouping),
- ``MLP{l}``: the MLP's input <- ``mlp_norm(x_r)``,
- ``LOGITS``: the final norm's output <- ``final_norm(x_r)``.

The norms are the model's own modules (their class ``forward`` applied to ``x_r``). A head's output
is ``z_h @ W_o[h].T`` plus its share ``b_o / n_heads`` of the output bias. Where the attention output
passes a post-norm before the residual add (Gemma 2/3, OLMo 2), that RMS norm is linear given its
per-position scale: ``post(o) = F * o`` with ``F`` read from this run, and head ``h`` contributes
``F * head_h``; an MLP post-norm's output is the MLP's contribution. In a parallel block (GPT-J,
GPT-NeoX, Phi, Cohere) the MLP reads the block input, so the graph has no edge from a layer's heads
into its MLP (`Graph.for_model`).

The residual stream itself is left alone; only what each receiver reads changes. With every
mask 1 the pass reproduces the model (up to float rounding); with every mask 0 under zero
ablation every receiver reads 0.

Attribution (`edge_gradients`): with every mask equal to ``alpha`` all receivers of a layer
read the same ``x``; each gets its own copy so autograd gives ``g_r = d metric / d x_r`` per
receiver, and ``d metric / d m_rs = g_r . (a_s - abl_s)`` for every edge at once — EAP at
``alpha = 1`` (Syed et al. 2023), and integrated gradients over the edge masks when averaged over
``alpha`` between 0 (empty circuit) and 1 (full model): EAP-IG.

Refused, with the reason: a block whose output is not input + attention + MLP (a residual
multiplier, Granite), an MLP that is not one module (OPT), a post-norm that is not an RMS norm.
"""

from __future__ import annotations

import weakref
from dataclasses import dataclass
from typing import Any, Callable, Optional

import numpy as np
import torch
from einops import rearrange

from ...models.architectures import get_path
from ...models.loading import LoadedModel
from ...patching.ablation import PositionMeans, sink_apart
from ...patching.core import Resume, trace_sites
from .graph import Graph


def check_supported(model: LoadedModel) -> None:
    """Refuse, before any work, a model whose blocks the edge forward cannot decompose into senders."""
    arch = model.arch
    name = f"{model.name} ({arch.name})"
    if not arch.flow:
        raise ValueError(
            f"knowledge circuits on {name}: the block's data flow could not be probed (a model whose "
            "weights are not here, e.g. on NDIF); run it locally"
        )
    if arch.mlp is None:
        raise ValueError(
            f"knowledge circuits on {name}: its MLP is not one module of the block (MLP{{l}} is a node of the graph)"
        )
    if arch.additive is None:
        raise ValueError(
            f"knowledge circuits on {name}: whether a block's output is the sum of its input, attention "
            "and MLP outputs could not be checked (no weights here); run it locally"
        )
    if not arch.additive:
        raise ValueError(
            f"knowledge circuits on {name}: a block's output is not its input plus its attention and "
            "MLP outputs (a residual multiplier?), so the residual stream is not a sum of senders"
        )
    receiver_weights(model)  # checks the post-norms


def apply_norm(norm: Optional[torch.nn.Module], x: torch.Tensor) -> torch.Tensor:
    """``norm(x)`` with the model's own norm module (its class ``forward``: no hook of the trace fires);
    ``x`` itself where the block has no norm there."""
    return x if norm is None else type(norm).forward(norm, x)


def _linear(module: Any) -> tuple[torch.Tensor, Optional[torch.Tensor]]:
    """``(weight "out in", bias)`` of an ``nn.Linear`` or a GPT-2 ``Conv1D``."""
    w = module.weight.t() if type(module).__name__ == "Conv1D" else module.weight
    return w, getattr(module, "bias", None)


def _rms_gain(norm: torch.nn.Module, d_model: int, what: str) -> torch.Tensor:
    """The gain ``g`` of an RMS norm (``norm(x) = s(x) * g * x``, ``s`` a scalar per position), checked."""
    p = next(norm.parameters(), None)
    kw = dict(device=p.device if p is not None else None, dtype=p.dtype if p is not None else torch.float32)
    with torch.no_grad():
        gain = apply_norm(norm, torch.ones(d_model, **kw))
        x = torch.randn(4, d_model, generator=torch.Generator().manual_seed(0)).to(**kw)
        # checked in float32 to the norm's precision: a bf16 / fp16 norm's outputs are rounded far above 1e-3
        y, gx = apply_norm(norm, x).float(), gain.float() * x.float()
        s = (y * gx).sum(-1, keepdim=True) / (gx * gx).sum(-1, keepdim=True)
        rtol = max(1e-3, 4 * torch.finfo(kw["dtype"]).eps)
        ok = torch.allclose(y, s * gx, rtol=rtol, atol=1e-5 * float(y.abs().max()))
    if not ok:
        raise ValueError(
            f"knowledge circuits: the {what} ({type(norm).__name__}) is not an RMS norm, so a head's "
            "share of its output is not defined; only RMS post-norms are supported"
        )
    return gain


def _rows(t: torch.Tensor, cols: list[slice]) -> torch.Tensor:
    """``t``'s rows in ``cols``: a view when they are one contiguous range (separate and ``q | k | v``
    layouts: weights changed in place stay visible), a copy for an interleaved layout."""
    if all(a.stop == b.start for a, b in zip(cols, cols[1:])):
        return t[cols[0].start : cols[-1].stop]
    return torch.cat([t[c] for c in cols])


class _Weights:
    """The per-layer modules and weights the receivers need, reshaped per head / KV group."""

    def __init__(self, model: LoadedModel):
        hf, arch, shape = model.model, model.arch, model.shape
        H, r = shape.n_heads, shape.group_size
        self.layers = []
        for layer in range(shape.n_layers):
            block = arch.block(hf, layer)
            w = {}
            for kind, units in (("q", range(H)), ("k", range(0, H, r)), ("v", range(0, H, r))):
                weight, bias = _linear(arch.projection(hf, kind, layer))
                cols = [arch.columns(kind, h, shape) for h in units]
                w["w" + kind] = _rows(weight, cols).unflatten(0, (len(cols), shape.d_head))  # "unit e d"
                w["b" + kind] = None if bias is None else _rows(bias, cols)
            wo, bo = _linear(arch.projection(hf, "o", layer))
            norm = lambda path: get_path(block, path) if path else None  # noqa: E731
            self.layers.append(
                dict(
                    w,
                    wo=rearrange(wo, "d (h e) -> h e d", h=H),
                    bo=None if bo is None else bo / H,
                    ln1=norm(arch.attn_norm),
                    ln2=norm(arch.mlp_norm),
                    post_gain=None
                    if arch.attn_post_norm is None
                    else _rms_gain(norm(arch.attn_post_norm), shape.d_model, f"attention post-norm of layer {layer}"),
                )
            )
        self.final_norm = arch.final_norm_module(hf)


_WEIGHTS: "weakref.WeakKeyDictionary[torch.nn.Module, _Weights]" = weakref.WeakKeyDictionary()


def receiver_weights(model: LoadedModel) -> _Weights:
    """The receivers' weights of ``model``, built once per loaded torch model (dropped with it)."""
    if model.model not in _WEIGHTS:
        _WEIGHTS[model.model] = _Weights(model)
    return _WEIGHTS[model.model]


def _project(normed: torch.Tensor, w: torch.Tensor, b: Optional[torch.Tensor]) -> torch.Tensor:
    """``"unit batch pos d"`` inputs through each unit's rows of a projection -> ``"batch pos (unit e)"``."""
    out = torch.einsum("ubpd,ued->bpue", normed, w)
    if b is not None:
        out = out + rearrange(b, "(u e) -> u e", u=w.shape[0])
    return rearrange(out, "b p u e -> b p (u e)")


def _head_outputs(z: torch.Tensor, w: dict, H: int, post: Optional[tuple]) -> torch.Tensor:
    """``"head batch pos d_model"``: each head's contribution to the residual stream."""
    heads = torch.einsum("bphe,hed->hbpd", rearrange(z, "b p (h e) -> b p h e", h=H), w["wo"])
    if w["bo"] is not None:
        heads = heads + w["bo"]
    if post is not None:  # post(o) = F * o, F = s * gain with s fitted per position (exact for an RMS norm)
        o, p = post
        go = o * w["post_gain"]
        s = (p * go).sum(-1, keepdim=True) / (go * go).sum(-1, keepdim=True).clamp_min(torch.finfo(o.dtype).tiny)
        heads = heads * (s * w["post_gain"])
    return heads


@dataclass
class Ablation:
    """What a removed edge carries instead of its sender's output.

    ``zero``: nothing. ``mean``: the sender's mean output over the relation's facts, one mean for
    position 0 (the attention sink, whose outputs are far larger) and one for all later positions.
    """

    kind: str = "zero"
    means: Optional[torch.Tensor] = None  # "sender 2 d_model"
    keep_first: bool = False  # position 0 (the attention sink) is never ablated: every edge kept there

    def values(self, n_pos: int) -> Optional[torch.Tensor]:
        """``"sender 1 pos d_model"`` ablated values for prompts of ``n_pos`` tokens (None for zero)."""
        if self.kind == "zero":
            return None
        if self.means is None:
            raise ValueError("mean ablation needs means; build it with mean_ablation(model, graph, batches)")
        return self.means[:, sink_apart(n_pos)].unsqueeze(1)


@dataclass
class EdgeRun:
    logits: torch.Tensor  # "(copy batch) vocab" at the last position
    outputs: Optional[torch.Tensor] = None  # "sender (copy batch) pos d_model" (with keep_outputs)


@dataclass
class EdgeResume:
    """Start an edge forward at block ``layer``: the senders before it (``EMB`` and every node of layers
    ``< layer``) output ``outputs[:graph.senders_before_attn(layer)]`` (``"sender batch pos d_model"``, e.g.
    ``keep_outputs`` of an earlier run of the same prompts) and their blocks are skipped. Exact when no mask
    entry of an edge into a receiver below ``layer`` differs from that earlier run's: an edge into layer ``l``
    changes nothing before ``l``, so trying it recomputes only layers ``l ..`` (ACDC, `.acdc`)."""

    layer: int
    outputs: torch.Tensor


def edge_forward(
    model: LoadedModel,
    graph: Graph,
    ids: torch.Tensor,
    mask: Optional[np.ndarray | torch.Tensor],
    ablation: Ablation = Ablation(),
    keep_outputs: bool = False,
    resume: Optional[EdgeResume] = None,
    _grad_alpha: Optional[float] = None,
    _grad_inputs: Optional[list] = None,
    _deltas: Optional[list] = None,
) -> EdgeRun:
    """Logits at the last position with every edge not in ``mask`` ablated (``mask=None``: every edge kept).

    ``mask``: a vector over ``graph.edges`` (bool or float in [0, 1]), or ``"copy edge"``: one circuit per
    copy of the prompts, all in one forward (the batch is ``"(copy batch)"``, copy-major).
    ``keep_outputs``: also return every sender's output in this run.
    ``resume``: reuse the senders' outputs below ``resume.layer`` and compute only from there.
    """
    check_supported(model)
    W = receiver_weights(model)
    arch = model.arch
    if graph.parallel != arch.parallel:
        raise ValueError(
            f"the graph {'has' if graph.parallel else 'lacks'} parallel blocks but {model.name} "
            f"({arch.name}) {'has' if arch.parallel else 'has not'}; build it with Graph.for_model(model)"
        )
    dtype = next(model.model.parameters()).dtype
    device = model.device
    ids = ids.to(device)
    n_pos = ids.shape[1]
    abl = ablation.values(n_pos)
    if abl is not None:
        abl = abl.to(device=device, dtype=dtype)
        abl_cum = torch.cumsum(abl, 0)  # "sender 1 pos d": sum of the first s+1 ablated values
    grad_mode = _grad_inputs is not None  # gradients w.r.t. every receiver's input
    uniform = _grad_alpha is not None  # every mask equal to alpha (EAP / EAP-IG)
    n_copies = 1
    if not uniform:
        if mask is None:
            mask = np.ones(graph.n_edges, dtype=np.float32)
        m = torch.as_tensor(np.asarray(mask, dtype=np.float32), device=device, dtype=dtype)
        if m.dim() == 2:
            if grad_mode:
                raise ValueError("gradients are taken for one circuit at a time: give a mask vector, not a stack")
            n_copies = m.shape[0]
        m = m.reshape(n_copies, graph.n_edges)
    if (resume is not None or n_copies > 1) and grad_mode:
        raise ValueError("resume and stacked masks are for forward passes only, not gradients")
    B = ids.shape[0]
    run_ids = ids.repeat(n_copies, 1) if n_copies > 1 else ids
    H, G = graph.n_heads, graph.n_kv_heads
    result: dict = {}
    outs: list[torch.Tensor] = []  # sender outputs in this run (gradient mode)
    n_out = [0]  # senders written so far
    live = torch.ones((1, n_pos, 1), device=device, dtype=dtype)  # positions where masks act
    if ablation.keep_first:
        live[:, 0] = 0.0

    def grad_inputs(offset: int, n_recv: int, n_send: int) -> torch.Tensor:
        """``"receiver batch pos d"`` inputs of one block of receivers, in the autograd graph."""
        if uniform:
            # a zero leaf per receiver: its gradient is d metric / d x_r, and x_r stays connected upstream
            eps = torch.zeros(n_recv, *acc[0].shape, device=acc[0].device, dtype=acc[0].dtype, requires_grad=True)
            _grad_inputs.append(eps)
            return acc[0].unsqueeze(0) + eps
        block = m[0, offset : offset + n_recv * n_send].view(n_recv, n_send)
        stacked = torch.stack(outs[:n_send])  # "sender batch pos d"
        x = (block @ stacked.reshape(n_send, -1)).view(n_recv, *stacked.shape[1:])
        if abl is not None:  # + sum_s abl_s - sum_s m_rs abl_s
            fix = abl_cum[n_send - 1].view(1, -1) - block @ abl[:n_send].view(n_send, -1)
            x = x + fix.view(n_recv, 1, *stacked.shape[2:])
        if ablation.keep_first:  # position 0 reads the whole residual stream (it only sees itself: clean)
            x[:, :, 0] = stacked[:, :, 0].sum(0)
        eps = torch.zeros_like(x, requires_grad=True)
        _grad_inputs.append(eps)
        return x + eps

    def inputs(offset: int, n_recv: int, n_send: int) -> torch.Tensor:
        """``"receiver (copy batch) pos d"`` inputs of one block of receivers."""
        if grad_mode:
            return grad_inputs(offset, n_recv, n_send)
        C, s0 = n_copies, min(n_send, n_cached)
        block = m[:, offset : offset + n_recv * n_send].view(C, n_recv, n_send)
        x = torch.zeros(C, n_recv, B * n_pos * d_model, device=device, dtype=dtype)
        if s0:  # the resumed senders are the same in every copy: one product, no copy per copy
            x += (block[:, :, :s0].reshape(C * n_recv, s0) @ cached.reshape(n_cached, -1)[:s0]).view(C, n_recv, -1)
        if n_send > s0:
            x.baddbmm_(block[:, :, s0:], buf[:, s0:n_send].reshape(C, n_send - s0, -1))
        x = x.view(C, n_recv, B, n_pos, d_model)
        if abl is not None:  # + sum_s abl_s - sum_s m_rs abl_s
            fix = abl_cum[n_send - 1].reshape(1, 1, -1) - block @ abl[:n_send].reshape(n_send, -1)
            x = x + fix.view(C, n_recv, 1, n_pos, d_model)
        if ablation.keep_first:  # position 0 reads the whole residual stream (it only sees itself: clean)
            first_pos = buf[:, s0:n_send, :, 0].sum(1) + (cached[:s0, :, 0].sum(0) if s0 else 0)
            x[:, :, :, 0] = first_pos.unsqueeze(1)
        return x.transpose(0, 1).reshape(n_recv, C * B, n_pos, d_model)

    def add_sender(a: torch.Tensor) -> None:
        s = n_out[0]
        n_out[0] += 1
        if not grad_mode:
            buf[:, s] = a.view(n_copies, B, *a.shape[1:])
            return
        outs.append(a)
        ab = abl[s] if abl is not None else torch.zeros_like(a[:1])
        _deltas.append(((a - ab) * live).detach())
        if uniform:
            w = torch.full((1, n_pos, 1), _grad_alpha, device=a.device, dtype=a.dtype)
            if ablation.keep_first:  # masks do not act at position 0
                w[:, 0] = 1.0
            contrib = w * a + (1 - w) * ab
            acc[0] = contrib if acc[0] is None else acc[0] + contrib

    acc: list = [None]
    buf = (
        None
        if grad_mode
        else torch.empty(n_copies, graph.n_senders, B, n_pos, model.shape.d_model, device=device, dtype=dtype)
    )  # "copy sender batch pos d"
    blocks = {(k, l): (off, r, s) for k, l, off, r, s in graph.blocks}
    post = arch.attn_post_norm is not None
    first, skip, n_cached, cached = 0, None, 0, None
    d_model = model.shape.d_model
    if resume is not None:
        first = resume.layer
        n_before = graph.senders_before_attn(first)
        if not 0 < first <= graph.n_layers or resume.outputs.shape[0] < n_before or resume.outputs.shape[1] != B:
            raise ValueError(
                f"resume at layer {first} needs the outputs of the first {n_before} senders for batch "
                f"{B}; got {tuple(resume.outputs.shape)}"
            )
        cached = resume.outputs[:n_before].to(device=device, dtype=dtype)
        n_cached = n_out[0] = n_before
        skip = Resume(first, cached.sum(0).repeat(n_copies, 1, 1))  # the residual stream entering ``first``

    def body(sites) -> None:
        if resume is None:
            add_sender(sites.resid_in(0).clone())
        for layer in range(first, graph.n_layers):
            w = W.layers[layer]
            x = inputs(*blocks[("attn", layer)])
            normed = apply_norm(w["ln1"], x)
            sites.write_qkv(
                layer,
                _project(normed[:H], w["wq"], w["bq"]),
                _project(normed[H : H + G], w["wk"], w["bk"]),
                _project(normed[H + G :], w["wv"], w["bv"]),
            )
            z = sites.z(layer)
            heads = _head_outputs(z, w, H, sites.attn_post_norm(layer) if post else None)
            for h in range(H):
                add_sender(heads[h])  # a view of ``heads``: copied into the buffer, no new memory
            x = inputs(*blocks[("mlp", layer)])
            sites.write_mlp_in(layer, apply_norm(w["ln2"], x[0]))
            add_sender(sites.mlp_out(layer).clone())
        x = inputs(*blocks[("logits", -1)])
        sites.write_final_norm(apply_norm(W.final_norm, x[0]))
        result["logits"] = sites.logits()
        if keep_outputs:
            if n_cached:
                buf[:, :n_cached] = cached.unsqueeze(0)
            result["outputs"] = (
                buf.transpose(0, 1).reshape(graph.n_senders, n_copies * B, *buf.shape[3:]).clone()
                if buf is not None
                else torch.stack([o.detach() for o in outs])
            )

    trace_sites(model, run_ids, body, grad=grad_mode, resume=skip)
    return EdgeRun(result["logits"], result.get("outputs"))


def edge_gradients(
    model: LoadedModel,
    graph: Graph,
    ids: torch.Tensor,
    metric: Callable[[torch.Tensor], torch.Tensor],
    alpha: float = 1.0,
    ablation: Ablation = Ablation(),
    mask: Optional[np.ndarray] = None,
    per_prompt: bool = False,
) -> np.ndarray:
    """``d metric / d m_e`` for every edge ``e`` (one forward + backward).

    At every mask equal to ``alpha``, or (``mask`` given) at that mask: the gradient of a partial
    circuit, for iterative pruning. ``per_prompt``: ``"batch edge"``, each prompt's own term (for a ``metric``
    that sums the prompts' values, each prompt's run depends on its own tokens only: the rows sum to the total)."""
    grad_inputs: list[torch.Tensor] = []
    deltas: list[torch.Tensor] = []
    run = edge_forward(
        model,
        graph,
        ids,
        mask,
        ablation,
        _grad_alpha=None if mask is not None else alpha,
        _grad_inputs=grad_inputs,
        _deltas=deltas,
    )
    value = metric(run.logits.float())
    grads = torch.autograd.grad(value, grad_inputs)
    B = ids.shape[0]
    out = np.empty((B, graph.n_edges) if per_prompt else graph.n_edges, dtype=np.float64)
    with torch.no_grad():
        D = torch.stack(deltas).float()  # "sender batch pos d"
        for (_kind, _layer, off, r, s), g in zip(graph.blocks, grads):
            if per_prompt:
                sc = torch.einsum("rbpd,sbpd->brs", g.float(), D[:s])
                out[:, off : off + r * s] = sc.reshape(B, -1).cpu().numpy()
            else:
                sc = torch.einsum("rbpd,sbpd->rs", g.float(), D[:s])
                out[off : off + r * s] = sc.reshape(-1).cpu().numpy()
    return out


def mean_ablation(model: LoadedModel, graph: Graph, batches) -> Ablation:
    """Mean ablation from the clean outputs of every sender over ``batches`` (position 0 kept apart).

    The means are `mechdiff.patching.ablation`'s, as circuit scoring's; they are applied per edge
    (a removed edge carries its sender's mean into one receiver), not as a patch of the sender."""
    means = PositionMeans(sink_apart, n_buckets=2)
    with torch.no_grad():
        for b in batches:
            means.add(edge_forward(model, graph, b.ids, None, keep_outputs=True).outputs)  # s b p d
    return Ablation("mean", means.mean())
