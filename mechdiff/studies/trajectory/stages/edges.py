"""``edges:<ckpt>`` and ``edges`` (only with ``[edges] on = true``): the EAP edge graph (heads and MLPs,
position-free) scored per prompt on the ranking prompts with the node ranking's metric and mean ablation
(`task_graph`) at ``[edges] steps`` (default: the steps the between-run null reads), then each checkpoint's top-n
edges and their nodes, edge overlap beside node overlap between consecutive steps and against the final one, with
the node structure's within-checkpoint null and prompt resamples (`edge_structure`). Each counts its cost beside its
computation (``costs``): the edge passes as the knowledge kind's edge stages count them (`FactSet`), the comparison's
products on the host (docs/trajectories.md, "Edges beside nodes", gives their measured times)."""

from __future__ import annotations

import math

from ....methods.edge_structure import EDGE_CHUNK
from ....runs.stages import StageRecord
from ...knowledge.facts import FactSet, plan_graph
from ...planner import StageCost
from ..settings import edge_checkpoints
from .base import PlanCounts, Stage

#: Host bytes a stage holds of each prompt's score of an edge: float64 (`prompt_edge_scores`), then the record's
#: float16 copy and its base64 bytes and text (`encode_half`).
SCORE_BYTES = 8 + 2 + 2 * 2 * 4 / 3
#: Host bytes the comparison holds of each: decoded to float64 (`decode_half`) beside its record's base64 text.
DECODED_BYTES = 8 + 2 * 4 / 3


def edge_prompts(p: PlanCounts) -> tuple[list[str], int]:
    """The checkpoints the edge stages score (`edge_checkpoints`; none with ``[edges]`` off) and the ranking prompts
    they all share."""
    names = edge_checkpoints(p.st.edges, p.st.runs, p.names)
    return names, min((p.ranking_n(c) for c in names), default=0)


class EdgeScoresStage(Stage):
    """Checkpoint ``name``'s per-prompt edge attribution (float16) on the ranking prompts, with the node ranking's
    metric and position-wise mean ablation (`task_graph`)."""

    kind = "edges"

    def prompts(self) -> int:
        """Ranking prompts the edge stages score: those every scored checkpoint's ranking shares (the first rows of
        the ranking set, as the structure stage reads them)."""
        return min(self.s.ranking_n(n) for n in self.s.edge_checkpoints())

    def inputs(self, name: str) -> dict:
        s, e = self.s, self.s.st.edges
        return {
            "model": s.digests[name],
            "task": s.task_inputs(),
            "prompts": self.prompts(),
            "scoring": s.reference_inputs(),
            "edges": {"method": e.method, **({"ig_steps": e.ig_steps} if e.method == "eap-ig" else {})},
        }

    def compute(self, name: str) -> dict:
        from ....methods.edge_structure import encode_half
        from ....methods.knowledge.graph import Graph
        from ....methods.knowledge.task_graph import group_ablations, prompt_edge_scores, task_batches

        s, e, n = self.s, self.s.st.edges, self.prompts()
        ranker = s.scorer(name, "ranking", n)  # the node ranking's prompts and metric
        model = s.checkpoints().model(name)
        graph = Graph.for_model(model)
        reference = s.task.reference_records(s.tokenizer, s.st.scoring.reference_n, s.seed("reference"), **s.options())
        scores = prompt_edge_scores(
            model,
            graph,
            task_batches(ranker.records, e.batch_size, ranker.metric),
            group_ablations(model, graph, reference, e.batch_size),
            e.method,
            e.ig_steps,
            s.progress,
        )
        return {"graph": graph.to_dict(), "prompts": n, "metric": ranker.metric, "scores": encode_half(scores)}

    @staticmethod
    def costs(p: PlanCounts) -> list:
        """Each scored checkpoint: the reference means (`group_ablations`: an edge forward of each reference prompt,
        the senders' outputs kept) and `prompt_edge_scores` (a pass with gradients a batch, ``ig_steps`` with
        EAP-IG) on the ranking prompts, in batches of ``[edges] batch_size`` (`FactSet`: FLOPs at the mean token
        length, a batch's memory at the longest). Held beside the model: the means (one group of template and
        length counted: each more holds as much again) and, on the host, the scores (`SCORE_BYTES`); a batch's
        peak is its pass with gradients. The ranking scorer's means are the circuit stage's, read from the store.
        Its time is its FLOPs' (the plan's rule), which the pass with gradients takes longer to run than a forward
        does, more so the deeper the model (docs/trajectories.md, "In the plan")."""
        names, n = edge_prompts(p)
        return [edge_scores_cost(p, f"edges:{c}", n) for c in names]


class EdgesStage(Stage):
    """Edge overlap beside node overlap across the scored checkpoints (`edge_structure`), with ``[structure]``'s
    splits, resamples and margin and the structure stage's seed."""

    kind = "edges"
    per_checkpoint = False

    def inputs(self, scored: dict[str, StageRecord]) -> dict:
        s = self.s.st.structure
        return {
            "scores": {c: r.key for c, r in scored.items()},
            "n": self.s.st.edges.n,
            "structure": {k: getattr(s, k) for k in ("draws", "resamples", "resample_splits", "margin")},
        }

    def compute(self, scored: dict[str, StageRecord]) -> dict:
        from ....methods.edge_structure import decode_half, edge_structure
        from ....methods.knowledge.graph import Graph

        s = self.s.st.structure
        g = next(iter(scored.values())).result["graph"]
        graph = Graph(g["n_layers"], g["n_heads"], g["n_kv_heads"], bool(g.get("parallel", False)))
        scores = {c: decode_half(rec.result["scores"]) for c, rec in scored.items()}
        return edge_structure(
            scores, graph, self.s.st.edges.n, s.draws, self.s.seed("ranking"), s.resamples, s.resample_splits, s.margin
        )

    @staticmethod
    def costs(p: PlanCounts) -> list:
        """No model: every scored checkpoint's scores decoded (`DECODED_BYTES`) and, on the host, the products of
        the halves' weights with them (`top_edges`: two halves, ``[structure] draws`` splits and ``resamples`` x
        ``resample_splits``, each a row of ``prompts x edges`` multiply-adds at float64), chunks of `EDGE_CHUNK` rows
        held with their top-n masks."""
        names, n = edge_prompts(p)
        if not names:
            return []
        s, graph = p.st.structure, plan_graph(p.meter.dims)
        boot = s.resamples * s.resample_splits
        rows, chunk = s.draws + boot, min(EDGE_CHUNK, max(s.draws, boot))
        flops = 2 * len(names) * rows * 2.0 * n * graph.n_edges
        held = len(names) * n * graph.n_edges * DECODED_BYTES
        # a chunk: the product, its absolute value and their argpartition (float64, int64), and every checkpoint's
        # edge masks on both halves
        chunk_bytes = 3 * chunk * graph.n_edges * 8 + 2 * len(names) * chunk * graph.n_edges
        note = "numpy on the host at float64 (its time there, not a GPU's)"
        cost = StageCost(
            "edges", 0, n, chunk, flops, 0, 0, 0, host_kept=int(held + chunk_bytes), note=note,
            batch_option="[structure] resamples",
        )  # fmt: skip
        return [cost]


def edge_scores_cost(p: PlanCounts, stage: str, n: int) -> StageCost:
    """`EdgeScoresStage` on one checkpoint (`EdgeScoresStage.costs`)."""
    e, meter, t = p.st.edges, p.meter, p.meter.lengths
    graph, d_model = plan_graph(meter.dims), meter.dims.d_model

    def prompts(k: int, tokens: float) -> FactSet:
        return FactSet(meter, graph, {tokens: k}, e.batch_size)

    reference, ranking = prompts(p.st.scoring.reference_n, t.tokens), prompts(n, t.tokens)
    steps = e.ig_steps if e.method == "eap-ig" else 1
    flops = reference.flops(1) + ranking.gradient_flops(steps)
    # the means' batch: its edge forward with the senders' outputs copied out, and their float64 copy summed
    rows = meter.rows(p.st.scoring.reference_n, e.batch_size)
    means = prompts(p.st.scoring.reference_n, t.longest).transient(kept_outputs=True)
    means += graph.n_senders * rows * t.longest * d_model * 8
    transient = max(means, prompts(n, t.longest).transient(backward=True))
    kept = graph.n_senders * t.longest * d_model * 4  # one group's position-wise means, float32
    note = (
        f"{e.method}{f' ({steps} steps)' if steps > 1 else ''}: {graph.n_edges} edges a prompt; time from FLOPs "
        "alone, low: a pass with gradients took 1.1x (4 layers) to 3x (12 layers) a forward's CPU time a FLOP"
    )
    return StageCost(
        stage, 1, n, meter.rows(n, e.batch_size), flops, meter.weights, kept, transient,
        host_kept=math.ceil(n * graph.n_edges * SCORE_BYTES), note=note, batch_option="[edges] batch_size",
        reads=meter.reads(reference.passes + steps * ranking.passes),
    )  # fmt: skip
