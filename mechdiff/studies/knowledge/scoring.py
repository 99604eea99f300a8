"""The ``scoring`` stage of the knowledge kind (per model, given the edge scores): the circuit (the smallest size
of ``sizes`` whose Hit@k reaches ``target`` x the full model's), its Hit@k against the full and empty models and
random circuits of its edge count, and the faithfulness curve; its key (the selection options and the discovery
key) and its cost in edge forwards."""

from __future__ import annotations

import logging
import time
from typing import Any, Optional

import numpy as np

from ...methods.knowledge.discovery import greedy_edges, top_edges
from ...methods.knowledge.evaluate import CURVE_RANKING, faithfulness_curve, random_mask
from ...methods.knowledge.graph import Graph
from ...runs.seeds import derive
from ..planner import StageCost
from .facts import FactSet
from .model_run import ModelRun, edge_indices, edge_mask
from .settings import KnowledgeSettings

log = logging.getLogger(__name__)


def _pruned(graph: Graph, disc: dict) -> Optional[dict[float, np.ndarray]]:
    """Iterative pruning's circuit per size, from the discovery record (None for another method)."""
    return None if disc["pruned"] is None else {float(f): edge_mask(graph, ix) for f, ix in disc["pruned"].items()}


def scoring_inputs(s: KnowledgeSettings) -> dict:
    """The options choosing and scoring the circuit (given the edge scores)."""
    return {
        "k": s.k,
        "target": s.target,
        "sizes": list(s.sizes),
        "selection": s.selection,
        "signed": s.signed,
        "prune_unreached": s.prune_unreached,
        "n_random": s.n_random,
        "seed": s.seed,
        "curve": s.curve,
        "curve_sizes": list(s.curve_sizes),
        "curve_ranking": CURVE_RANKING.get(s.method, "|score|"),
    }


def _select(run: ModelRun, scores: np.ndarray, pruned: Optional[dict], full_hit: float) -> tuple[np.ndarray, list]:
    """The smallest size of ``settings.sizes`` whose Hit@k reaches target x the full model's (else the last)."""
    s, g = run.settings, run.graph
    sweep, mask = [], None
    for frac in s.sizes:
        if pruned is not None:
            mask = pruned[frac]
        else:
            select = greedy_edges if s.selection == "greedy" else top_edges
            mask = select(
                g, scores, max(1, int(round(frac * g.n_edges))), prune=True, signed=s.signed, forward=s.prune_unreached
            )
        if not mask.any():
            log.info("size %s: no edge left after pruning dangling edges", frac)
            continue
        ev = run.evaluate(mask)
        hit = float(ev.hit.mean())
        row = {
            "fraction_requested": frac,
            "n_edges": int(mask.sum()),
            "fraction": float(mask.mean()),
            f"hit@{s.k}": hit,
            "ratio_to_full": hit / full_hit if full_hit else float("nan"),
            "logprob": float(ev.logprob.mean()),
        }
        sweep.append(row)
        log.info("size %s: %s", frac, row)
        if hit >= s.target * full_hit:
            return mask, sweep
    log.warning("no size up to %s reached %s x the full model's Hit@%s", s.sizes[-1], s.target, s.k)
    return mask, sweep


def scoring_stage(run: ModelRun, disc: dict) -> dict:
    """The circuit (chosen size), its Hit@k against the full and empty models and random circuits, and the
    faithfulness curve."""
    s, g = run.settings, run.graph
    run.timings.clear()
    full, empty = run.full_and_empty
    full_hit = float(full.hit.mean())
    scores, pruned = np.asarray(disc["scores"]), _pruned(g, disc)
    t = time.time()
    if disc["acdc_edges"] is not None:
        mask, sweep = edge_mask(g, disc["acdc_edges"]), []
    else:
        mask, sweep = _select(run, scores, pruned, full_hit)
    circuit_eval = run.evaluate(mask)
    run.timings["selection"] = time.time() - t
    n_edges = int(mask.sum())
    # Each random circuit's seed is derived from the study's seed and the draw's name.
    random_hits = run.timed(
        "random",
        lambda: [
            float(run.evaluate(random_mask(g, n_edges, derive(s.seed, f"random-circuit-{i}"))).hit.mean())
            for i in range(s.n_random)
        ],
    )
    curve = run.timed(
        "curve",
        lambda: (
            faithfulness_curve(
                run.model,
                g,
                run.batches,
                scores,
                run.ablation,
                s.curve_sizes,
                s.k,
                full,
                empty,
                run.progress,
                masks=pruned,
            )
            if s.curve
            else None
        ),
    )
    seen = set((disc.get("acdc") or {}).get("facts", ()))
    held = np.array([f.prompt not in seen for b in run.batches for f in b.facts])  # in evaluation order
    heldout = (
        {
            "n": int(held.sum()),
            "full": full.subset(held).summary(s.k),
            "circuit": circuit_eval.subset(held).summary(s.k),
        }
        if seen and held.any()
        else None
    )
    return {
        "edges": edge_indices(mask),
        "sweep": sweep,
        "full": full.summary(s.k),
        "empty": empty.summary(s.k),
        "heldout": heldout,
        "circuit": circuit_eval.summary(s.k),
        "full_hit": full_hit,
        "circuit_hit": float(circuit_eval.hit.mean()),
        "random_hits": random_hits,
        "curve": curve,
        "timings": dict(run.timings),
    }


def scoring_runs(s: KnowledgeSettings, edges: int, tried: Optional[int] = None) -> int:
    """Evaluations (each an edge forward of every kept fact) `scoring_stage` makes: the full and empty circuits
    (ACDC's discovery ran them), each size `_select` tries (``tried``: as many as the run tried, else every one:
    it stops at the first that reaches the target), the circuit, ``n_random`` random circuits and each curve size
    smaller than the whole graph."""
    if s.method == "acdc":
        sizes = 0
    else:
        sizes = len(s.sizes) if tried is None else tried
    curve = sum(max(1, int(round(f * edges))) < edges for f in s.curve_sizes) if s.curve else 0
    return (0 if s.method == "acdc" else 2) + sizes + 1 + s.n_random + curve


def scoring_cost(
    meter: Any, s: KnowledgeSettings, graph: Graph, kept: FactSet, stage: str, tried: Optional[int] = None
) -> StageCost:
    """`scoring_stage` (`scoring_runs`)."""
    runs = scoring_runs(s, graph.n_edges, tried)
    note = "" if tried is not None or s.method == "acdc" else "every size tried (the first to reach target ends it)"
    n = sum(kept.lengths.values())
    return StageCost(
        stage, len(s.models), n, meter.rows(n, s.batch_size), kept.flops(runs), len(s.models) * meter.weights, 0,
        kept.transient(), note=note, batch_option="[knowledge] batch_size", reads=meter.reads(runs * kept.passes),
    )  # fmt: skip
