"""Path patching (Wang et al. 2022; Prakash et al. 2024), exact, several senders per forward pass.

For one sender head at its sender position:

1. *frozen run*: the clean prompt, the sender's ``z`` slice set to its counterfactual value
   at the sender position, every other head's ``z`` frozen to its clean value (MLPs
   recomputed); the receivers' Q (or V) at the receiver position is captured.
2. *receiver run*: the clean prompt with the receivers' Q/V at the receiver position
   overwritten by what the frozen run produced.

Score = ``(mean p_patched - mean p_clean) / mean p_clean`` on the answer token over the
batch (a ratio of means: stable where one prompt's clean probability is tiny). Without
receivers (step A: senders -> logits) the frozen run's own logits are read.

Freezing is applied from the earliest sender position on: positions before it cannot see
the sender (causal attention), so they equal the clean run already. Likewise the blocks below
the lowest sender (frozen run) or receiver (receiver run) equal the clean run: both runs resume
there from the clean residual stream (:class:`~mechdiff.patching.core.Resume`) instead of
recomputing them. Senders are copies of the
batch stacked along the batch dimension (``senders_per_pass`` at a time). Under grouped-query
attention V (and K) belongs to a KV group: patching a receiver's V patches its whole group
(all query heads that share it); :func:`receiver_sites` merges receivers of one group.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Optional, Sequence

import torch
from einops import repeat
from tqdm.auto import tqdm

from ..components import Head
from ..models.loading import LoadedModel
from ..models.remote import keep
from ..tasks.base import PairRecord, pair_batch_tensors
from .activation import answer_prob
from .core import Patch, Resume, run

log = logging.getLogger(__name__)


@dataclass
class PairBatch:
    """Clean (base) and counterfactual (source) runs of one batch of pairs, captured once."""

    clean_ids: torch.Tensor  # "batch pos"
    source_ids: torch.Tensor  # "batch pos"
    answer_ids: torch.Tensor  # "batch"
    positions: dict[str, torch.Tensor]  # name -> "batch", from the clean (base) records
    clean_z: dict[int, torch.Tensor]  # layer -> "batch pos (head d_head)"
    source_z: dict[int, torch.Tensor]
    clean_logits: torch.Tensor  # "batch vocab" at the last token
    clean_resid: Optional[dict[int, torch.Tensor]] = None  # layer -> "batch pos d_model" after that block (for Resume)

    @property
    def p_clean(self) -> torch.Tensor:
        return answer_prob(self.clean_logits, self.answer_ids)

    def __len__(self) -> int:
        return self.clean_ids.shape[0]


def prepare(model: LoadedModel, pairs: Sequence[PairRecord]) -> PairBatch:
    """Run clean and counterfactual once, capturing every layer's ``z`` (and the clean residual stream)."""
    tensors = pair_batch_tensors(pairs)
    layers = range(model.shape.n_layers)
    sites = [("z", layer) for layer in layers]
    resid = [("resid", layer) for layer in range(model.shape.n_layers - 1)]
    clean_ids, source_ids = tensors["base"]["input_ids"], tensors["source"]["input_ids"]
    with torch.no_grad():
        with model.session():  # remote: both runs in one request
            clean = run(model, clean_ids, capture=sites + resid)
            source = run(model, source_ids, capture=sites)
            clean_z = keep({l: clean.captured[("z", l)] for l in layers})
            source_z = keep({l: source.captured[("z", l)] for l in layers})
            clean_logits = keep(clean.logits)
            clean_resid = keep({l: clean.captured[("resid", l)] for _, l in resid})
    return PairBatch(clean_ids, source_ids, tensors["target_ids"], tensors["base"]["positions"], clean_z, source_z,
                     clean_logits, clean_resid)


@dataclass(frozen=True)
class Receivers:
    """Receiver heads, the site read on them (``q`` or ``v``; ``k`` allowed) and their position name."""

    heads: tuple[Head, ...]
    kind: str
    position: str

    def __post_init__(self) -> None:
        if self.kind not in ("q", "k", "v"):
            raise ValueError(f"receiver kind must be q, k or v, not {self.kind!r}")
        if not self.heads:
            raise ValueError("no receiver heads: path patching to receivers needs at least one")

    @property
    def max_layer(self) -> int:
        return max(h.layer for h in self.heads)


def receiver_sites(model: LoadedModel, receivers: Receivers) -> list[tuple[int, slice]]:
    """Distinct ``(layer, columns)`` written for the receivers (one per KV group for ``k``/``v``)."""
    seen: dict[tuple[int, int, int], None] = {}
    for h in receivers.heads:
        cols = model.arch.columns(receivers.kind, h.head, model.shape)
        seen.setdefault((h.layer, cols.start, cols.stop), None)
    merged = len(receivers.heads) - len(seen)
    if merged:
        log.info("GQA: %d receiver heads share KV groups; patching %s patches whole groups (%d sites)",
                 merged, receivers.kind.upper(), len(seen))
    return [(layer, slice(a, b)) for layer, a, b in seen]


def eligible_senders(model: LoadedModel, receivers: Optional[Receivers]) -> list[Head]:
    """Heads that can affect the receivers: every head in a layer below the deepest receiver."""
    top = model.shape.n_layers if receivers is None else receivers.max_layer
    return [Head(l, h) for l in range(top) for h in range(model.shape.n_heads)]


def path_patch(
    model: LoadedModel, batch: PairBatch, senders: Sequence[Head], sender_position: str,
    receivers: Optional[Receivers] = None, senders_per_pass: int = 8, progress: bool = True,
) -> dict[Head, float]:
    """The path-patching score of each sender (see the module docstring)."""
    out: dict[Head, float] = {}
    chunks = [list(senders[i:i + senders_per_pass]) for i in range(0, len(senders), senders_per_pass)]
    p_clean = batch.p_clean
    bar = progress and not model.remote  # remote: the step is one request, there is nothing to show per chunk
    with model.session():  # remote: the whole step (every chunk's frozen and receiver runs) in one request
        probs = keep(_chunk_probs(model, batch, chunks, sender_position, receivers, bar))
    for chunk, p in zip(chunks, probs):  # p: "sender batch"
        for head, ps in zip(chunk, p):
            out[head] = float((ps.mean() - p_clean.mean()) / p_clean.mean())
    return out


def _chunk_probs(model: LoadedModel, batch: PairBatch, chunks: list[list[Head]], sender_position: str,
                 receivers: Optional[Receivers], progress: bool) -> list[torch.Tensor]:
    """:func:`_patched_prob` of every chunk of senders (``"sender batch"`` each), on the model's side."""
    return [_patched_prob(model, batch, chunk, sender_position, receivers)
            for chunk in tqdm(chunks, desc=f"path patching {sender_position}", disable=not progress, leave=False)]


def _patched_prob(model: LoadedModel, batch: PairBatch, senders: list[Head], sender_position: str,
                  receivers: Optional[Receivers]) -> torch.Tensor:
    """Answer probability after path patching each sender: ``"sender batch"``."""
    n, s = len(batch), len(senders)
    spos = _position(batch, sender_position)
    if receivers is not None and any(h.layer >= receivers.max_layer for h in senders):
        raise ValueError(f"senders must lie below the deepest receiver layer {receivers.max_layer}")
    top = model.shape.n_layers if receivers is None else receivers.max_layer
    start = int(spos.min())
    # The frozen run starts at the lowest sender, or lower where it must capture a receiver there.
    first = min([h.layer for h in senders] + ([h.layer for h in receivers.heads] if receivers else []))
    patches = [_frozen_patch(model, batch, senders, spos, layer, start) for layer in range(first, top)]
    ids = repeat(batch.clean_ids, "b p -> (s b) p", s=s)
    with torch.no_grad():
        if receivers is None:
            logits = run(model, ids, patches, resume=_resume(batch, first, s)).logits
        else:
            sites = receiver_sites(model, receivers)
            rpos = repeat(_position(batch, receivers.position), "b -> (s b)", s=s)
            frozen = run(model, ids, patches, capture=[(receivers.kind, l) for l in sorted({l for l, _ in sites})],
                         stop=True, resume=_resume(batch, first, s))
            rows = torch.arange(n * s)
            writes = [Patch(receivers.kind, layer, frozen.captured[(receivers.kind, layer)][rows, rpos, cols],
                            rpos, cols) for layer, cols in sites]
            logits = run(model, ids, writes, resume=_resume(batch, min(l for l, _ in sites), s)).logits
    return answer_prob(logits, repeat(batch.answer_ids, "b -> (s b)", s=s)).reshape(s, n)


def _resume(batch: PairBatch, layer: int, copies: int) -> Optional[Resume]:
    """Start at ``layer`` from the clean residual stream, repeated for ``copies`` stacked copies of the batch."""
    if layer == 0 or not batch.clean_resid:
        return None
    return Resume(layer, repeat(batch.clean_resid[layer - 1], "b p d -> (s b) p d", s=copies))


def _frozen_patch(model: LoadedModel, batch: PairBatch, senders: list[Head], spos: torch.Tensor,
                  layer: int, start: int) -> Patch:
    """Layer ``layer``'s z for every sender copy: clean from ``start`` on, the copy's sender from the source."""
    n, d = len(batch), model.shape.d_head
    value = repeat(batch.clean_z[layer][:, start:], "b p c -> (s b) p c", s=len(senders)).clone()
    rows = torch.arange(n)
    for i, h in enumerate(senders):
        if h.layer == layer:
            cols = slice(h.head * d, (h.head + 1) * d)
            value[i * n + rows, spos - start, cols] = batch.source_z[layer][rows, spos, cols]
    return Patch("z", layer, value, slice(start, None))


def _position(batch: PairBatch, name: str) -> torch.Tensor:
    if name not in batch.positions:
        raise ValueError(f"unknown position {name!r}; the dataset records {sorted(batch.positions)}")
    pos = batch.positions[name]
    if pos.ndim != 1 or (pos < 0).any():
        raise ValueError(f"position {name!r} is missing (-1) or not one per example in some clean prompts")
    return pos
