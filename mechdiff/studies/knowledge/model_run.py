"""One model on one fact set, what the per-model stages of the knowledge kind (``discovery``, ``scoring``,
``analysis``) share: the graph, the batches, the ablation and the full and empty circuits' evaluations (each
computed on first use, only where a stage that needs them is not cached), and the key every such stage carries."""

from __future__ import annotations

import time
from functools import cached_property
from typing import Any, Callable, Optional, Sequence

import numpy as np

from ...methods.knowledge.evaluate import CircuitEval, evaluate
from ...methods.knowledge.forward import Ablation, mean_ablation
from ...methods.knowledge.graph import Graph
from ...models.loading import LoadedModel
from ...tasks.relation_data import Fact, batches
from ...version import __version__
from .facts import facts_key
from .settings import KnowledgeSettings


class ModelRun:
    """One model on one fact set: the graph, batches, and (computed on first use, only when a stage that
    needs them is not cached) the ablation and the full and empty circuits' evaluations."""

    def __init__(self, model: LoadedModel, facts: Sequence[Fact], settings: KnowledgeSettings, progress: bool):
        self.model, self.facts, self.settings, self.progress = model, facts, settings, progress
        self.graph = Graph.for_model(model)
        self.batches = batches(facts, settings.batch_size)
        self.timings: dict[str, float] = {}

    def timed(self, name: str, fn: Callable[[], Any]) -> Any:
        """``fn()``, its seconds kept in ``timings[name]``."""
        t = time.time()
        value = fn()
        self.timings[name] = time.time() - t
        return value

    @cached_property
    def ablation(self) -> Ablation:
        def make() -> Ablation:
            a = mean_ablation(self.model, self.graph, self.batches) if self.settings.ablation == "mean" else Ablation()
            a.keep_first = self.settings.keep_first
            return a

        return self.timed("ablation", make)

    def evaluate(self, mask: Optional[np.ndarray]) -> CircuitEval:
        return evaluate(self.model, self.graph, self.batches, mask, self.ablation, self.settings.k)

    @cached_property
    def full_and_empty(self) -> tuple[CircuitEval, CircuitEval]:
        return self.timed(
            "full_and_empty", lambda: (self.evaluate(None), self.evaluate(np.zeros(self.graph.n_edges, dtype=bool)))
        )

    def inputs(self) -> dict:
        """What every stage of this model depends on: weights, facts, how removed edges are ablated, the code
        version."""
        s = self.settings
        return {
            "model": self.model.fingerprint,
            "facts": facts_key(self.facts),
            "ablation": s.ablation,
            "keep_first": s.keep_first,
            "batch_size": s.batch_size,
            "mechdiff": __version__,
        }


def edge_indices(mask: np.ndarray) -> list[int]:
    """The indices of the edges ``mask`` keeps (as a stage record holds a circuit)."""
    return np.flatnonzero(mask).tolist()


def edge_mask(graph: Graph, indices: Sequence[int]) -> np.ndarray:
    """The mask of ``graph``'s edges keeping ``indices`` (`edge_indices`'s inverse)."""
    mask = np.zeros(graph.n_edges, dtype=bool)
    mask[list(indices)] = True
    return mask
