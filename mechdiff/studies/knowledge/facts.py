"""The ``facts`` stage of the knowledge kind: which facts of a relation every model gets right (Hit@k of the
full model), its key, and the counting every stage's cost shares: a fact set in passes of the edge forward
(`edge_forward`: a forward of the model plus every receiver's input mixed from the senders, 2 x edges x d_model
FLOPs a token) over the facts' batches (one token length each, `batches`)."""

from __future__ import annotations

from typing import Any, Sequence

import numpy as np

from ...methods.knowledge.evaluate import evaluate
from ...methods.knowledge.forward import Ablation
from ...methods.knowledge.graph import Graph
from ...models.footprint import backward_bytes, dtype_bytes
from ...models.loading import LoadedModel
from ...runs.stages import StageCache, StageRecord, key_hash
from ...tasks.relation_data import Fact, Relation, batches, build_facts
from ..planner import StageCost
from .settings import KnowledgeSettings


def full_model_hits(model: LoadedModel, facts: Sequence[Fact], settings: KnowledgeSettings) -> np.ndarray:
    """Per fact, whether ``model`` (every edge kept) has its answer in the top ``settings.k``."""
    graph = Graph.for_model(model)
    return evaluate(model, graph, batches(facts, settings.batch_size), None, Ablation(), settings.k).hit


def load_facts(model: LoadedModel, settings: KnowledgeSettings) -> list[Fact]:
    """The facts of ``settings.relation`` (before its edit where ``unedited``) under ``model``'s tokenizer."""
    relation = Relation.load(settings.relation)
    facts = build_facts(model.tokenizer, relation.unedited() if settings.unedited else relation, settings.template)
    if settings.max_facts:
        facts = facts[: settings.max_facts]
    return facts


def facts_key(facts: Sequence[Fact]) -> str:
    """What a stage reads of the facts: their tokens and answer tokens."""
    return key_hash([[f.ids, f.answer_id] for f in facts])


def facts_stage(
    models: Sequence[LoadedModel], facts: Sequence[Fact], settings: KnowledgeSettings, cache: StageCache
) -> StageRecord:
    """Which facts every model gets right (Hit@k of the full model), and each model's Hit@k on all facts."""

    def compute() -> dict:
        keep = np.ones(len(facts), dtype=bool)
        full_hits = {}
        for m in models:
            hits = full_model_hits(m, facts, settings)
            full_hits[m.name] = float(hits.mean())
            keep &= hits
        return {"kept": np.flatnonzero(keep).tolist(), "full_hits": full_hits}

    inputs = {
        "models": {m.name: m.fingerprint for m in models},
        "facts": facts_key(facts),
        "k": settings.k,
        "batch_size": settings.batch_size,
    }
    return cache.run("facts", inputs, compute)


def fact_lengths(facts: Sequence[Fact]) -> dict[int, int]:
    """Facts per token length: what `batches` groups them by."""
    out: dict[int, int] = {}
    for f in facts:
        out[len(f.ids)] = out.get(len(f.ids), 0) + 1
    return dict(sorted(out.items()))


class FactSet:
    """A fact set's cost in edge-forward passes (`Meter` counts) of batches of ``batch``: ``lengths`` facts per
    token length."""

    def __init__(self, meter: Any, graph: Graph, lengths: dict[int, int], batch: int):
        self.meter, self.graph, self.lengths, self.batch = meter, graph, lengths, batch

    @property
    def passes(self) -> int:
        """Batches `batches` makes: per token length, ``ceil(facts / batch)``."""
        return sum(-(-n // self.batch) for n in self.lengths.values())

    def flops(self, runs: float = 1.0) -> float:
        """``runs`` edge forwards of every fact: the model's FLOPs and the receivers' inputs mixed from the
        senders (2 x edges x d_model a token)."""
        m, d = self.meter, self.meter.dims.d_model
        return runs * sum(m.fwd(n, t) + 2 * self.graph.n_edges * d * n * t for t, n in self.lengths.items())

    def transient(self, kept_outputs: bool = False, backward: bool = False) -> int:
        """A batch's activations: the forward's, the senders' outputs buffer (``senders x rows x tokens x d``) and a
        block's receivers' inputs; ``kept_outputs``: the buffer copied out; ``backward``: (EAP) every block's
        receiver inputs, the senders' outputs and their deltas kept for the backward, and the backward's own."""
        m, g = self.meter, self.graph
        t = max(self.lengths, default=1)
        rows = m.rows(sum(self.lengths.values()), self.batch)
        row = rows * t * m.dims.d_model * dtype_bytes(m.dtype)
        if backward:
            receivers = len(g.receivers)
            return backward_bytes(m.dims, rows, t, m.dims.n_layers, m.dtype) + (3 * g.n_senders + receivers) * row
        return m.act(rows, t) + (g.n_senders * (2 if kept_outputs else 1) + g.n_attn_receivers) * row


def facts_cost(meter: Any, s: KnowledgeSettings, graph: Graph, every: FactSet, stage: str) -> StageCost:
    """`facts_stage`: each model's full forward of every fact of the relation."""
    models = len(s.models)
    passes = models * every.passes
    return StageCost(
        stage, models, sum(every.lengths.values()), every.meter.rows(sum(every.lengths.values()), s.batch_size),
        every.flops(models), models * meter.weights, 0, every.transient(), batch_option="[knowledge] batch_size",
        reads=meter.reads(passes),
    )  # fmt: skip
