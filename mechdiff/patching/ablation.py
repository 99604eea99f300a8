"""Mean ablation's means, written once: position-wise means of an activation over a reference set.

An activation ``"unit batch pos d"`` (a layer's ``z``, a sender's output, ...) is summed over the
batch and over the positions of each *bucket* in float64, and divided by the bucket's count:

- one bucket per position (`every_position`): circuit scoring's means
  (`mechdiff.circuits.scoring.position_means`, in memory or through
  `mechdiff.patching.store.ActivationStore.means`, which stores the per-batch sums of
  `position_sums` so that an interrupted run resumes);
- the first position apart from all later ones (`sink_apart`): knowledge circuits'
  per-sender means (`mechdiff.methods.knowledge.forward.mean_ablation`), since position 0 (the
  attention sink) has far larger outputs and prompts there differ in length.

How the means are *applied* differs, and is written once per kind of ablation: circuit scoring
replaces a head's ``z`` at a position (one mixing patch per layer,
`mechdiff.circuits.scoring.ablation_patches`); knowledge circuits ablate single edges, so a
receiver reads a sender's mean in place of its output only on the edges removed
(`mechdiff.methods.knowledge.forward.Ablation`), not through a patch of the sender.
"""

from __future__ import annotations

from typing import Callable, Iterable, Optional

import torch

from ..common.progress import progress_bar
from ..models.loading import LoadedModel
from .core import run

Buckets = Callable[[int], torch.Tensor]
"""``n_pos -> "pos"`` long: the bucket of each position."""


def every_position(n_pos: int) -> torch.Tensor:
    """Each position its own bucket."""
    return torch.arange(n_pos)


def sink_apart(n_pos: int) -> torch.Tensor:
    """Bucket 0 for position 0 (the attention sink), bucket 1 for every later position."""
    out = torch.ones(n_pos, dtype=torch.long)
    out[:1] = 0
    return out


def position_sums(x: torch.Tensor, buckets: torch.Tensor, n_buckets: int) -> torch.Tensor:
    """``"... batch pos d" -> "... bucket d"``: float64 sums over the batch and each bucket's positions."""
    per_pos = x.double().sum(-3)  # "... pos d"
    out = per_pos.new_zeros(*per_pos.shape[:-2], n_buckets, per_pos.shape[-1])
    return out.index_add_(-2, buckets.to(per_pos.device), per_pos)


class PositionMeans:
    """Running means of activations ``"... batch pos d"`` per position bucket: `add` each batch,
    then `mean` (``"... bucket d"``, float32). A bucket no position fell into has mean 0."""

    def __init__(self, buckets: Buckets = every_position, n_buckets: Optional[int] = None):
        self.buckets, self.n_buckets = buckets, n_buckets
        self.sums: Optional[torch.Tensor] = None
        self.counts: Optional[torch.Tensor] = None

    def add(self, x: torch.Tensor) -> None:
        """Add one batch ``"... batch pos d"``."""
        where = self.buckets(x.shape[-2])
        n = self.n_buckets if self.n_buckets is not None else int(where.max()) + 1
        sums = position_sums(x, where, n)
        counts = torch.bincount(where, minlength=n).double() * x.shape[-3]
        if self.sums is not None and self.sums.shape != sums.shape:
            raise ValueError(
                f"batches of different shapes: means so far {tuple(self.sums.shape)}, this batch's "
                f"{tuple(sums.shape)}; give prompts of one length or buckets with n_buckets"
            )
        self.sums = sums if self.sums is None else self.sums + sums
        self.counts = counts if self.counts is None else self.counts + counts

    def mean(self) -> torch.Tensor:
        """``"... bucket d"`` float32."""
        if self.sums is None:
            raise ValueError("no activations to average; add at least one batch")
        return (self.sums / self.counts.clamp_min(1).to(self.sums.device)[:, None]).float()


def site_means(
    model: LoadedModel, id_batches: Iterable[torch.Tensor], kind: str = "z", progress: bool = False, desc: str = "means"
) -> torch.Tensor:
    """Every layer's site ``kind`` averaged over the prompts of ``id_batches`` (each ``"batch pos"``, one
    length) at each position: ``"layer pos cols"`` float32, on the CPU (as the activation store gives it)."""
    sites = [(kind, layer) for layer in range(model.shape.n_layers)]
    means = [PositionMeans() for _ in sites]
    for ids in progress_bar(list(id_batches), desc=desc, disable=not progress, leave=False):
        with torch.no_grad():
            captured = run(model, ids, capture=sites).captured
        for m, site in zip(means, sites):
            m.add(captured[site])  # "batch pos cols"
    return torch.stack([m.mean().cpu() for m in means])
