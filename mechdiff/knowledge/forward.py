"""The edge-patching forward pass: every receiver reads its own residual stream, on nnsight.

The residual stream entering a layer is the sum of its senders' outputs (``EMB``, each head's
output after ``o_proj``, each MLP's output). Receiver ``r`` of a circuit reads

    x_r = sum_s ( m_rs * a_s + (1 - m_rs) * abl_s )  =  sum_s abl_s + sum_s m_rs * (a_s - abl_s)

where ``a_s`` is sender ``s``'s output *in this run* (computed from its own patched inputs),
``abl_s`` its ablated value (zero, or its mean over the relation's facts) and ``m_rs`` the
edge's mask (1: in the circuit). The receivers' inputs are written where the model reads them:

- Q of head ``h``: ``q_proj.output[..., h]`` <- ``input_layernorm(x_r) @ W_q[h].T`` (before RoPE),
- K / V of KV group ``g``: the group's ``k_proj`` / ``v_proj`` columns (no ungrouping),
- ``MLP{l}``: ``post_attention_layernorm.output`` <- ``post_attention_layernorm(x_r)``,
- ``LOGITS``: the final norm's output <- ``norm(x_r)``.

The residual stream itself is left alone; only what each receiver reads changes. With every
mask 1 the pass reproduces the model (up to float rounding); with every mask 0 under zero
ablation every receiver reads 0 and the logits are ``lm_head(norm(0)) = 0``.

Attribution (:func:`edge_gradients`): with every mask equal to ``alpha`` all receivers of a layer
read the same ``x``; each gets its own copy so autograd gives ``g_r = d metric / d x_r`` per
receiver, and ``d metric / d m_rs = g_r . (a_s - abl_s)`` for every edge at once — EAP at
``alpha = 1`` (Syed et al. 2023), and integrated gradients over the edge masks when averaged over
``alpha`` between 0 (empty circuit) and 1 (full model): EAP-IG.

Supported families: llama, mistral, qwen2 (pre-norm blocks with RMSNorm and separate Q/K/V
projections); others raise a clear error.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Optional

import numpy as np
import torch
from einops import rearrange

from ..models.architectures import _get
from ..models.loading import LoadedModel
from .graph import Graph

SUPPORTED = ("llama", "mistral", "qwen2")


def check_supported(model: LoadedModel) -> None:
    mt = getattr(model.model.config, "model_type", None)
    if mt not in SUPPORTED:
        raise ValueError(f"knowledge circuits support model families {SUPPORTED}, not {mt!r}: the edge-patching "
                         "forward recomputes RMSNorm and the Q/K/V projections per receiver")


def _rms(x: torch.Tensor, norm) -> torch.Tensor:
    """Llama RMSNorm of ``x`` with the weights of ``norm`` (the torch module)."""
    eps = getattr(norm, "variance_epsilon", getattr(norm, "eps", 1e-6))
    xf = x.float()
    out = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    return norm.weight * out.to(x.dtype)


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
        idx = torch.ones(n_pos, dtype=torch.long)
        idx[0] = 0
        return self.means[:, idx].unsqueeze(1)


class _Weights:
    """The per-layer weights the receivers need, reshaped per head / KV group."""

    def __init__(self, model: LoadedModel):
        hf, arch, shape = model.model, model.arch, model.shape
        self.layers = []
        for layer in range(shape.n_layers):
            block = arch.block(hf, layer)
            attn = _get(block, arch.attn)
            q, k, v, o = (_get(attn, p) for p in (arch.q_proj, arch.k_proj, arch.v_proj, arch.out_proj))
            self.layers.append(dict(
                ln1=block.input_layernorm, ln2=block.post_attention_layernorm,
                wq=rearrange(q.weight, "(h e) d -> h e d", h=shape.n_heads),
                wk=rearrange(k.weight, "(g e) d -> g e d", g=shape.n_kv_heads),
                wv=rearrange(v.weight, "(g e) d -> g e d", g=shape.n_kv_heads),
                bq=q.bias, bk=k.bias, bv=v.bias,
                wo=rearrange(o.weight, "d (h e) -> h e d", h=shape.n_heads),
            ))
        self.final_norm = arch.final_norm_module(hf)


def _weights(model: LoadedModel) -> _Weights:
    cached = getattr(model, "_knowledge_weights", None)
    if cached is None:
        cached = _Weights(model)
        object.__setattr__(model, "_knowledge_weights", cached)
    return cached


def _project(normed: torch.Tensor, w: torch.Tensor, b: Optional[torch.Tensor]) -> torch.Tensor:
    """``"unit batch pos d"`` inputs through each unit's rows of a projection -> ``"batch pos (unit e)"``."""
    out = torch.einsum("ubpd,ued->bpue", normed, w)
    if b is not None:
        out = out + rearrange(b, "(u e) -> u e", u=w.shape[0])
    return rearrange(out, "b p u e -> b p (u e)")


@dataclass
class EdgeRun:
    logits: torch.Tensor  # "batch vocab" at the last position
    outputs: Optional[torch.Tensor] = None  # "sender batch pos d_model" (with keep_outputs)


def edge_forward(model: LoadedModel, graph: Graph, ids: torch.Tensor, mask: Optional[np.ndarray | torch.Tensor],
                 ablation: Ablation = Ablation(), keep_outputs: bool = False,
                 _grad_alpha: Optional[float] = None, _grad_inputs: Optional[list] = None,
                 _deltas: Optional[list] = None) -> EdgeRun:
    """Logits at the last position with every edge not in ``mask`` ablated (``mask=None``: every edge kept).

    ``mask``: a vector over ``graph.edges`` (bool or float in [0, 1]).
    ``keep_outputs``: also return every sender's output in this run.
    """
    check_supported(model)
    W = _weights(model)
    arch, nn = model.arch, model.nn
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
    if not uniform:
        if mask is None:
            mask = np.ones(graph.n_edges, dtype=np.float32)
        m = torch.as_tensor(np.asarray(mask, dtype=np.float32), device=device, dtype=dtype)
    H, G = graph.n_heads, graph.n_kv_heads
    result: dict = {}
    outs: list[torch.Tensor] = []  # sender outputs in this run
    live = torch.ones((1, n_pos, 1), device=device, dtype=dtype)  # positions where masks act
    if ablation.keep_first:
        live[:, 0] = 0.0

    def inputs(offset: int, n_recv: int, n_send: int) -> torch.Tensor:
        """``"receiver batch pos d"`` inputs of one block of receivers."""
        if uniform:
            # a zero leaf per receiver: its gradient is d metric / d x_r, and x_r stays connected upstream
            eps = torch.zeros(n_recv, *acc[0].shape, device=acc[0].device, dtype=acc[0].dtype, requires_grad=True)
            _grad_inputs.append(eps)
            return acc[0].unsqueeze(0) + eps
        block = m[offset:offset + n_recv * n_send].view(n_recv, n_send)
        stacked = torch.stack(outs[:n_send]) if grad_mode else buf[:n_send]  # "sender batch pos d"
        x = (block @ stacked.reshape(n_send, -1)).view(n_recv, *stacked.shape[1:])
        if abl is not None:  # + sum_s abl_s - sum_s m_rs abl_s
            fix = abl_cum[n_send - 1].view(1, -1) - block @ abl[:n_send].view(n_send, -1)
            x = x + fix.view(n_recv, 1, *stacked.shape[2:])
        if ablation.keep_first:  # position 0 reads the whole residual stream (it only sees itself: clean)
            x[:, :, 0] = stacked[:, :, 0].sum(0)
        if grad_mode:
            eps = torch.zeros_like(x, requires_grad=True)
            _grad_inputs.append(eps)
            x = x + eps
        return x

    def add_sender(a: torch.Tensor) -> None:
        s = len(outs)
        outs.append(a)
        if not grad_mode:
            buf[s] = a
            return
        ab = abl[s] if abl is not None else torch.zeros_like(a[:1])
        _deltas.append(((a - ab) * live).detach())
        if uniform:
            w = torch.full((1, n_pos, 1), _grad_alpha, device=a.device, dtype=a.dtype)
            if ablation.keep_first:  # masks do not act at position 0
                w[:, 0] = 1.0
            contrib = w * a + (1 - w) * ab
            acc[0] = contrib if acc[0] is None else acc[0] + contrib

    acc: list = [None]
    buf = None if grad_mode else torch.empty(graph.n_senders, ids.shape[0], n_pos, model.shape.d_model,
                                             device=device, dtype=dtype)
    blocks = {(k, l): (off, r, s) for k, l, off, r, s in graph.blocks}
    kwargs = dict(input_ids=ids, use_cache=False, logits_to_keep=1)
    with torch.set_grad_enabled(grad_mode), nn.trace(**kwargs):
        add_sender(_get(nn, arch.embed).output.clone())
        for layer in range(graph.n_layers):
            w = W.layers[layer]
            attn = arch.attention(nn, layer)
            block = arch.block(nn, layer)
            x = inputs(*blocks[("attn", layer)])
            normed = _rms(x, w["ln1"])
            q_site = _get(attn, arch.q_proj).output
            q_site[:] = _project(normed[:H], w["wq"], w["bq"])
            k_site = _get(attn, arch.k_proj).output
            k_site[:] = _project(normed[H:H + G], w["wk"], w["bk"])
            v_site = _get(attn, arch.v_proj).output
            v_site[:] = _project(normed[H + G:], w["wv"], w["bv"])
            z = _get(attn, arch.out_proj).input
            heads = torch.einsum("bphe,hed->hbpd", rearrange(z, "b p (h e) -> b p h e", h=H), w["wo"])
            for h in range(H):
                add_sender(heads[h])  # a view of ``heads``: copied into the buffer, no new memory
            x = inputs(*blocks[("mlp", layer)])
            ln2 = block.post_attention_layernorm.output
            ln2[:] = _rms(x[0], w["ln2"])
            add_sender(_get(block, arch.mlp).output.clone())
        x = inputs(*blocks[("logits", -1)])
        fn = arch.final_norm_module(nn).output
        fn[:] = _rms(x[0], W.final_norm)
        result["logits"] = nn.output.logits[:, -1]
        if keep_outputs:
            result["outputs"] = buf.clone() if buf is not None else torch.stack([o.detach() for o in outs])
    return EdgeRun(result["logits"], result.get("outputs"))


def edge_gradients(model: LoadedModel, graph: Graph, ids: torch.Tensor,
                   metric: Callable[[torch.Tensor], torch.Tensor], alpha: float = 1.0,
                   ablation: Ablation = Ablation(), mask: Optional[np.ndarray] = None) -> np.ndarray:
    """``d metric / d m_e`` for every edge ``e`` (one forward + backward).

    At every mask equal to ``alpha``, or (``mask`` given) at that mask: the gradient of a partial
    circuit, for iterative pruning."""
    grad_inputs: list[torch.Tensor] = []
    deltas: list[torch.Tensor] = []
    run = edge_forward(model, graph, ids, mask, ablation, _grad_alpha=None if mask is not None else alpha,
                       _grad_inputs=grad_inputs, _deltas=deltas)
    value = metric(run.logits.float())
    grads = torch.autograd.grad(value, grad_inputs)
    out = np.empty(graph.n_edges, dtype=np.float64)
    with torch.no_grad():
        D = torch.stack(deltas).float()  # "sender batch pos d"
        for (kind, layer, off, r, s), g in zip(graph.blocks, grads):
            sc = torch.einsum("rbpd,sbpd->rs", g.float(), D[:s])
            out[off:off + r * s] = sc.reshape(-1).cpu().numpy()
    return out


def mean_ablation(model: LoadedModel, graph: Graph, batches) -> Ablation:
    """Mean ablation from the clean outputs of every sender over ``batches`` (position 0 kept apart)."""
    total = None
    n0 = nrest = 0
    with torch.no_grad():
        for b in batches:
            outs = edge_forward(model, graph, b.ids, None, keep_outputs=True).outputs.float()  # s b p d
            first = outs[:, :, 0].sum(1)
            rest = outs[:, :, 1:].sum((1, 2))
            cur = torch.stack([first, rest], 1)
            total = cur if total is None else total + cur
            n0 += outs.shape[1]
            nrest += outs.shape[1] * (outs.shape[2] - 1)
    means = total / torch.tensor([n0, max(nrest, 1)], dtype=total.dtype).view(1, 2, 1)
    return Ablation("mean", means)
