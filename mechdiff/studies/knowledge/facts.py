"""The ``facts`` stage of the knowledge kind: which facts of a relation every model gets right (Hit@k of the
full model), its key, and the counting every edge-graph stage's cost shares (this kind's and the trajectory's
``edges:<ckpt>``): a prompt set in passes of the edge forward (`edge_forward`: a forward of the model, each
receiver's Q, K and V projected again from its own input, and every receiver's input mixed from the senders,
2 x edges x d_model FLOPs a token) or of `edge_gradients` over its batches (one token length each, `batches`)."""

from __future__ import annotations

from typing import Any, Sequence

import numpy as np

from ...methods.knowledge.evaluate import evaluate
from ...methods.knowledge.forward import Ablation
from ...methods.knowledge.graph import Graph
from ...models.footprint import Dims, backward_bytes, dtype_bytes
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


def plan_graph(dims: Dims) -> Graph:
    """The edge graph of a model of ``dims`` (its config alone: sequential blocks assumed)."""
    return Graph(dims.n_layers, dims.n_heads, dims.n_kv_heads)


class FactSet:
    """A prompt set's cost in edge-forward passes (`Meter` counts) of batches of ``batch``: ``lengths`` prompts per
    token length (the knowledge kind's facts; a task's prompts at their mean or longest length)."""

    def __init__(self, meter: Any, graph: Graph, lengths: dict, batch: int):
        self.meter, self.graph, self.lengths, self.batch = meter, graph, lengths, batch

    @property
    def passes(self) -> int:
        """Batches `batches` makes: per token length, ``ceil(facts / batch)``."""
        return sum(-(-n // self.batch) for n in self.lengths.values())

    def _tokens(self, per_token: float, model: bool = True) -> float:
        """``per_token`` FLOPs at every token of every prompt, and the model's forward beside them (``model``)."""
        m = self.meter
        return sum((m.fwd(n, t) if model else 0.0) + per_token * n * t for t, n in self.lengths.items())

    def mix(self) -> float:
        """2 x edges x d_model FLOPs a token: every receiver's input mixed from the senders (a forward), or every
        edge's attribution from its receiver's gradient and its sender's delta (`edge_gradients`)."""
        return 2.0 * self.graph.n_edges * self.meter.dims.d_model

    def projections(self) -> float:
        """FLOPs a token of each receiver's Q, K and V projected from its own input (`edge_forward`'s ``write_qkv``;
        the model's own projections, which they replace, are its forward's)."""
        d = self.meter.dims
        return 2.0 * d.n_layers * d.d_model * (d.n_heads + 2 * d.n_kv_heads) * d.d_head

    def flops(self, runs: float = 1.0) -> float:
        """``runs`` edge forwards of every prompt: the model's FLOPs, the receivers' projections and their inputs
        mixed from the senders."""
        return runs * self._tokens(self.projections() + self.mix())

    def gradient_flops(self, runs: float = 1.0, masked: bool = False) -> float:
        """``runs`` passes of `edge_gradients` over every prompt: the forward (every mask alike, EAP's and EAP-IG's:
        the receivers read one sum, no mix) and its backward to the activations (the weights frozen: one forward's
        FLOPs again, as every kind counts a backward), then every edge's attribution (one mix); ``masked`` (a partial
        circuit's mask, iterative pruning): the forward's mix and its backward's as well."""
        forward = 2 * self._tokens(self.projections())
        return runs * (forward + (3 if masked else 1) * self._tokens(self.mix(), model=False))

    def transient(self, kept_outputs: bool = False, backward: bool = False) -> int:
        """A batch's activations: the forward's, the senders' outputs buffer (``senders x rows x tokens x d``) and a
        block's receivers' inputs; ``kept_outputs``: the buffer copied out; ``backward`` (`edge_gradients`, at the
        end of its forward): what the forward keeps for the backward (`backward_bytes`), each receiver's input and
        its gradient leaf, each sender's output and its delta, and a block's forward transient."""
        m, g = self.meter, self.graph
        t = max(self.lengths, default=1)
        rows = m.rows(sum(self.lengths.values()), self.batch)
        row = rows * t * m.dims.d_model * dtype_bytes(m.dtype)
        if backward:
            kept = backward_bytes(m.dims, rows, t, m.dims.n_layers, m.dtype) + m.act(rows, t)
            return int(kept + 2 * (g.n_senders + len(g.receivers)) * row)
        return int(m.act(rows, t) + (g.n_senders * (2 if kept_outputs else 1) + g.n_attn_receivers) * row)


def facts_cost(meter: Any, s: KnowledgeSettings, graph: Graph, every: FactSet, stage: str) -> StageCost:
    """`facts_stage`: each model's full forward of every fact of the relation."""
    models = len(s.models)
    passes = models * every.passes
    return StageCost(
        stage, models, sum(every.lengths.values()), every.meter.rows(sum(every.lengths.values()), s.batch_size),
        every.flops(models), models * meter.weights, 0, every.transient(), batch_option="[knowledge] batch_size",
        reads=meter.reads(passes),
    )  # fmt: skip
