"""The ``discovery`` stage of the knowledge kind (per model): every edge's score by the settings' method (EAP,
EAP-IG, iterative pruning or ACDC; ACDC's circuit, iterative pruning's circuit per size), its key (the method's
options) and its cost in edge forwards."""

from __future__ import annotations

import math
import time
from typing import Any

import numpy as np

from ...methods.knowledge.acdc import acdc, discovery_batch
from ...methods.knowledge.discovery import attribution_scores, iterative_pruning
from ...methods.knowledge.graph import Graph
from ..planner import StageCost
from .facts import FactSet
from .model_run import ModelRun, edge_indices
from .settings import KnowledgeSettings


def wanted_sizes(s: KnowledgeSettings) -> list[float]:
    """The circuit sizes iterative pruning stops at: scoring's ``sizes`` and the curve's, below the whole graph."""
    return sorted({*s.sizes, *(s.curve_sizes if s.curve else ())} - {1.0})


def discovery_inputs(s: KnowledgeSettings) -> dict:
    """The options edge scoring reads, per method."""
    acdc_options = {"tau": s.tau, "metric": s.acdc_metric, "prefilter": s.acdc_prefilter, "acdc_facts": s.acdc_facts}
    per_method = {
        "eap-ig": {"ig_steps": s.ig_steps},
        "acdc": acdc_options,
        "iterative": {"shrink": s.shrink, "sizes": wanted_sizes(s), "prune_unreached": s.prune_unreached},
    }
    return {"method": s.method, **per_method.get(s.method, {})}


def discovery_stage(run: ModelRun) -> dict:
    """Edge scores (and ACDC's circuit, or iterative pruning's circuit per size)."""
    s, g = run.settings, run.graph
    t = time.time()
    out: dict[str, Any] = {"pruned": None, "acdc_edges": None, "acdc": None}
    if s.method == "acdc":
        on = (
            [discovery_batch(run.batches, run.full_and_empty[0].rank == 0, s.acdc_facts)]
            if s.acdc_facts
            else run.batches
        )
        found = acdc(
            run.model,
            g,
            on,
            s.tau,
            run.ablation,
            s.acdc_metric,
            batch=s.acdc_batch,
            prefilter=s.acdc_prefilter or None,
            progress=run.progress,
        )
        scores = np.nan_to_num(found.effect, nan=0.0)
        out["acdc_edges"] = edge_indices(found.mask)
        out["acdc"] = found.summary() | {"facts": [f.prompt for b in on for f in b.facts]}
    elif s.method == "iterative":
        pruned, scores = iterative_pruning(
            run.model, g, run.batches, wanted_sizes(s), run.ablation, s.shrink, run.progress, s.prune_unreached
        )
        out["pruned"] = {repr(frac): edge_indices(m) for frac, m in pruned.items()}
    else:
        scores = attribution_scores(run.model, g, run.batches, s.method, s.ig_steps, run.ablation, run.progress)
    run.timings["discovery"] = time.time() - t
    return {**out, "scores": np.asarray(scores, dtype=float).tolist(), "timings": dict(run.timings)}


def ablation_runs(s: KnowledgeSettings) -> int:
    """Edge forwards a fact set's mean ablation takes (one; none for zero ablation)."""
    return 1 if s.ablation == "mean" else 0


def discovery_runs(s: KnowledgeSettings, edges: int) -> tuple[float, float, str]:
    """The edge forwards (of every kept fact) `discovery_stage` takes, the share of them with a backward, and a
    note: the mean ablation, then EAP's one forward and backward (EAP-IG: ``ig_steps``); iterative pruning's, one
    per step of its schedule; ACDC's full and empty circuits and (an estimate: it skips dead receivers and stops
    trying none) one run a tried edge, ``acdc_batch`` (else up to 16) edges a run."""
    ablation = ablation_runs(s)
    if s.method in ("eap", "eap-ig"):
        steps = 1 if s.method == "eap" else s.ig_steps
        return ablation + steps, steps, ""
    if s.method == "iterative":
        sizes, f, schedule = sorted(wanted_sizes(s), reverse=True), 1.0, 0
        for t in sizes:
            while f * s.shrink > t:
                f, schedule = f * s.shrink, schedule + 1
            schedule, f = schedule + 1, t
        return ablation + schedule, schedule, ""
    tried = math.ceil((s.acdc_prefilter or 1.0) * edges)
    prefilter = 1 if s.acdc_prefilter else 0  # EAP scores the edges it tries
    runs = ablation + 2 + prefilter + math.ceil(tried / (s.acdc_batch or 16))
    return runs, prefilter, f"ACDC: about {tried} edges tried, {s.acdc_batch or 'up to 16'} a run (an estimate)"


def discovery_cost(meter: Any, s: KnowledgeSettings, graph: Graph, kept: FactSet, stage: str) -> StageCost:
    """`discovery_stage` on the kept facts (`discovery_runs`): its passes with gradients as `FactSet.gradient_flops`
    counts them (at a partial circuit's mask for iterative pruning), the others as edge forwards."""
    runs, backward, note = discovery_runs(s, graph.n_edges)
    on = kept
    if s.method == "acdc" and s.acdc_facts:  # the trials run on one batch of acdc_facts facts of one length
        t = max(kept.lengths, key=kept.lengths.__getitem__, default=1)
        on = FactSet(meter, graph, {t: min(s.acdc_facts, kept.lengths.get(t, 0))}, s.acdc_facts)
    trials = runs - ablation_runs(s) - (2 if s.method == "acdc" else 0) - backward
    full = runs - trials
    passes = full * kept.passes + trials * on.passes
    flops = kept.flops(full - backward) + kept.gradient_flops(backward, s.method == "iterative") + on.flops(trials)
    n = sum(kept.lengths.values())
    return StageCost(
        stage, len(s.models), n, meter.rows(n, s.batch_size), flops, len(s.models) * meter.weights, 0,
        kept.transient(kept_outputs=True, backward=backward > 0), note=note, batch_option="[knowledge] batch_size",
        reads=meter.reads(passes),
    )  # fmt: skip
