"""``edges:<ckpt>`` and ``edges`` (only with ``[edges] on = true``): the EAP edge graph (heads and MLPs,
position-free) scored per prompt on the ranking prompts with the node ranking's metric and mean ablation
(`task_graph`) at ``[edges] steps`` (default: the steps the between-run null reads), then each checkpoint's top-n
edges and their nodes, edge overlap beside node overlap between consecutive steps and against the final one, with
the node structure's within-checkpoint null and prompt resamples (`edge_structure`). The plan counts neither yet
(docs/trajectories.md, "Edges beside nodes", gives their measured times)."""

from __future__ import annotations

from ....runs.stages import StageRecord
from .base import Stage


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
