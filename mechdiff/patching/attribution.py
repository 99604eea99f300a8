"""Attribution screening: a first-order estimate of every sender's path-patching score at once.

The estimate of sender ``s`` (layer ``l``, columns ``c``) at its position ``p`` is
``sum_b grad_b . (z_source - z_clean)[b, p, c] / (N mean p_clean)``, where ``grad`` is the
gradient of the step's objective with respect to ``z`` in the *frozen* model: every layer's
``z`` is made a leaf equal to its clean value, so gradients flow through the residual
stream and the MLPs but not through other heads (exactly what path patching freezes).

- Step A (no receivers): the objective is ``sum_b p_b`` (the task's metric, `PairBatch.measure`: answer
  probability or logit difference) at the logits; an answer of several tokens teacher-forced (each of its rows'
  gradients summed at the prompt's positions, which the rows share).
- Steps with receivers: first ``g_r = d(sum_b p_b) / d(receiver site at its position)`` in the
  ordinary clean model (one forward + backward); then the objective of the frozen pass is
  ``sum_r <g_r, receiver site>``, the linearised effect of the receivers' change on ``p``.

Cost: two forward+backward passes per step for all senders (one for step A), against one
forward per sender (two with receivers) for exact path patching.
"""

from __future__ import annotations

from typing import Optional, Sequence

import torch
from einops import rearrange

from ..common.components import Head
from ..models.loading import LoadedModel
from ..models.remote import keep
from .core import Patch, run
from .path import Receivers, batch_position, eligible_senders, receiver_sites
from .path_pairs import PairBatch, PairBatches, PairStream, parts


def attribution_scores(
    model: LoadedModel,
    batch: PairBatch | PairBatches | PairStream,
    sender_position: str,
    receivers: Optional[Receivers] = None,
    senders: Optional[Sequence[Head]] = None,
) -> dict[Head, float]:
    """Estimated path-patching score of each sender (default: every eligible sender). Over several groups
    (`PairBatches`; parts: `PairStream`) each
    one's sum is taken alone and the sums are normalised by every prompt's clean probability, as path patching's
    ratio of means."""
    senders = list(senders) if senders is not None else eligible_senders(model, receivers)
    if isinstance(batch, (PairBatches, PairStream)):
        totals = []
        for part in parts(batch):
            scores = attribution_scores(model, part, sender_position, receivers, senders)
            totals.append((scores, part.pairs * float(part.p_clean.mean())))
            del part  # a streamed part is freed before the next is prepared
        denom = sum(d for _, d in totals)
        return {h: sum(scores[h] * d for scores, d in totals) / denom for h in senders}
    spos = batch_position(batch, sender_position)
    start = int(spos.min())
    top = model.shape.n_layers if receivers is None else receivers.max_layer
    with model.session():  # remote: the forward and backward passes run on the server, in one request
        grads = keep(_gradients(model, batch, receivers, start, top))
    return _dot(model, batch, senders, spos, start, grads)


def _gradients(
    model: LoadedModel, batch: PairBatch, receivers: Optional[Receivers], start: int, top: int
) -> dict[int, Optional[torch.Tensor]]:
    """Gradient of the objective with respect to every layer's z from ``start`` on: ``layer -> "batch pos cols"``."""
    leaves = {l: batch.clean_z[l][:, start:].detach().clone().float().requires_grad_() for l in range(top)}
    patches = [Patch("z", l, leaf, slice(start, None)) for l, leaf in leaves.items()]
    if receivers is None:
        out = run(model, batch.clean_ids, patches, grad=True, **batch.readout())
        objective = batch.measure(out.logits).sum()
    else:
        objective = _receiver_objective(model, batch, receivers, patches)
    grads = torch.autograd.grad(objective, list(leaves.values()), allow_unused=True)
    return {l: None if g is None else g.detach() for l, g in zip(leaves, grads)}


def _receiver_objective(
    model: LoadedModel, batch: PairBatch, receivers: Receivers, frozen_patches: list[Patch]
) -> torch.Tensor:
    """``sum_r <g_r, site_r>`` with ``g_r`` the gradient of the answer probability at the receivers."""
    sites = receiver_sites(model, receivers)
    rpos = batch_position(batch, receivers.position)
    rows = torch.arange(len(batch))
    kinds = [(receivers.kind, l) for l in sorted({l for l, _ in sites})]
    # 1. gradient of p at the receiver sites in the ordinary clean model
    with torch.no_grad():
        clean = run(model, batch.clean_ids, capture=kinds).captured
    leaves = [
        clean[(receivers.kind, l)][rows, rpos, cols].detach().clone().float().requires_grad_() for l, cols in sites
    ]
    out = run(
        model,
        batch.clean_ids,
        [Patch(receivers.kind, l, leaf, rpos, cols) for (l, cols), leaf in zip(sites, leaves)],
        grad=True,
        **batch.readout(),
    )
    g = torch.autograd.grad(batch.measure(out.logits).sum(), leaves)
    # 2. the receiver sites as functions of the frozen model's z
    frozen = run(model, batch.clean_ids, frozen_patches, capture=kinds, grad=True, stop=True).captured
    return sum((gi * frozen[(receivers.kind, l)][rows, rpos, cols]).sum() for gi, (l, cols) in zip(g, sites))


def _dot(
    model: LoadedModel,
    batch: PairBatch,
    senders: list[Head],
    spos: torch.Tensor,
    start: int,
    grads: dict[int, Optional[torch.Tensor]],
) -> dict[Head, float]:
    """``grad . (source - clean)`` at the sender position, per head, normalised like path patching."""
    rows = torch.arange(len(batch))
    denom = batch.pairs * float(batch.p_clean.mean())
    scores: dict[Head, float] = {}
    by_layer: dict[int, torch.Tensor] = {}
    for layer in sorted({h.layer for h in senders}):
        grad = grads.get(layer)
        if grad is None:
            by_layer[layer] = torch.zeros(model.shape.n_heads)
            continue
        delta = (batch.source_z[layer][rows, spos] - batch.clean_z[layer][rows, spos]).float()  # "batch (head d_head)"
        prod = rearrange(grad[rows, spos - start] * delta, "b (head d) -> b head d", head=model.shape.n_heads)
        by_layer[layer] = prod.sum((0, 2)) / denom
    for h in senders:
        scores[h] = float(by_layer[h.layer][h.head])
    return scores
