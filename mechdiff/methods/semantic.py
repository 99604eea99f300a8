"""Semantic patching across models (Prakash et al. 2024, Sec. 4): the heads a DCM mask selected, patched from each
pair's source into its base within each model of a set, with the target accuracy per model against its unpatched floor
and against random heads of the same layers.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Iterable, Optional, Sequence

import numpy as np

from ..common import inference as inf
from ..common.components import Head
from ..common.outcomes import bits, outcome_record
from ..common.stats import pooled_proportion
from ..models.loading import LoadedModel
from ..tasks.base import PairRecord
from .dcm import DCMConfig, random_heads
from .dcm_cache import PairCache


@dataclass
class SemanticResult:
    """Target accuracy of one model with the selected heads patched (source -> base), its unpatched floor and
    random heads of the selection's layers and position (`random_heads`), per pair, with the paired tests of
    the patched heads against each (`paired`)."""

    model: str
    accuracy: inf.Interval
    floor: inf.Interval
    outcomes: list[int] = field(default_factory=list)  # per pair: 1 where the patched run gives the target
    floor_outcomes: list[int] = field(default_factory=list)  # per pair: 1 where the unpatched run gives it
    random_heads: list[list[Head]] = field(default_factory=list)  # each draw's heads
    random_outcomes: list[list[int]] = field(default_factory=list)  # each draw's per-pair outcomes
    random: Optional[inf.Interval] = None  # the draws' mean, resampling draws and pairs

    def tests(self) -> dict[str, inf.Test]:
        """The patched heads against the floor (exact McNemar on the same pairs) and against the random heads (the
        per-pair share of draws that give the target: the sign-flip test over pairs)."""
        if not self.outcomes or not self.floor_outcomes:
            return {}
        out = {"floor": inf.paired(self.outcomes, self.floor_outcomes, claim="patched - unpatched floor")}
        if self.random_outcomes:
            share = np.mean(self.random_outcomes, 0)
            out["random"] = inf.paired(self.outcomes, share, claim="patched - random heads (per-pair mean of draws)")
        return out

    def to_dict(self) -> dict:
        out = {"model": self.model, "accuracy": self.accuracy.to_dict(), "floor": self.floor.to_dict()}
        if self.outcomes:
            out["outcomes"] = outcome_record(self.outcomes)
        if self.floor_outcomes:
            out["floor_outcomes"] = bits(self.floor_outcomes)
        if self.random_outcomes:
            out["random"] = self.random.to_dict() if self.random is not None else None
            out["random_heads"] = [[h.name for h in hs] for hs in self.random_heads]
            out["random_outcomes"] = [bits(o) for o in self.random_outcomes]
        out.update({f"vs_{k}": t.row() for k, t in self.tests().items()})
        return out


def semantic_patching(
    models: Iterable[LoadedModel],
    heads: Sequence[Head],
    position: str,
    pairs: Sequence[PairRecord],
    batch_size: int = 32,
    progress: bool = True,
    n_random: int = 0,
    seed: int = 0,
    mode: str = "file",
) -> list[SemanticResult]:
    """Patch ``heads`` (e.g. a DCM selection) from each pair's source into its base, within each model,
    and report the desideratum's target accuracy per model (with the unpatched floor); with ``n_random``, also
    that many random head sets of the selection's layers at ``position`` (`random_heads`, drawn once by
    ``seed`` and patched into every model), each draw's per-pair outcomes kept; ``mode``: each
    `PairCache`'s."""
    return semantic_selections(models, [(heads, position)], pairs, batch_size, progress, n_random, seed, mode)[0]


def semantic_selections(
    models: Iterable[LoadedModel],
    selections: Sequence[tuple[Sequence[Head], str]],
    pairs: Sequence[PairRecord],
    batch_size: int = 32,
    progress: bool = True,
    n_random: int = 0,
    seed: int = 0,
    mode: str = "file",
) -> list[list[SemanticResult]]:
    """`semantic_patching` of each ``(heads, position)`` of ``selections`` (the selections of one desideratum, on its
    ``pairs``): per selection, one `SemanticResult` per model. One `PairCache` per model serves every selection (two
    forward passes a pair, then the patched runs of each): each selection's patched runs resume at its own lowest
    layer from the same base run as a cache of its own, so its outcomes are the same, for a third of the forwards
    where a desideratum's three groups select heads."""
    selections = [(list(heads), position) for heads, position in selections]
    if not selections or not all(heads for heads, _ in selections):
        raise ValueError("semantic patching needs at least one head (the DCM selection was empty)")
    models = list(models)
    config = DCMConfig(random_pool="layer")
    drawn = [random_heads(models[0], h, h, config, n_random, seed) if models else [] for h, _ in selections]
    out: list[list[SemanticResult]] = [[] for _ in selections]
    for model in models:
        cache = PairCache.build(model, pairs, selections, batch_size, progress, mode)
        for (heads, position), draws_heads, results in zip(selections, drawn, out):
            acc = cache.accuracy(model, range(len(pairs)), heads, position, batch_size, progress)
            draws = [cache.accuracy(model, range(len(pairs)), hs, position, batch_size) for hs in draws_heads]
            results.append(
                SemanticResult(
                    model.name,
                    inf.proportion(acc),
                    inf.proportion(cache.floor),
                    np.asarray(acc).astype(int).tolist(),
                    np.asarray(cache.floor).astype(int).tolist(),
                    draws_heads,
                    [np.asarray(d).astype(int).tolist() for d in draws],
                    pooled_proportion(draws) if draws else None,
                )
            )
        cache.close()
    return out
