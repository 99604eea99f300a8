"""One model's three stages of the knowledge kind in order (`model_stages`: discovery, scoring, analysis, each
keyed by what it reads) and the results written from their records: per model its summary (``results.json``), its
circuit, tables, figures and report; per relation the comparison of the models' circuits and ``study.json``."""

from __future__ import annotations

from dataclasses import asdict
from pathlib import Path
from typing import Optional, Sequence

import numpy as np

from ...circuits.overlap import hypergeom_p
from ...common.io import write_json, write_text
from ...methods.knowledge.forward import check_supported
from ...methods.knowledge.graph import EdgeCircuit
from ...models.loading import LoadedModel
from ...report.tables import write_table
from ...runs.stages import Pending, StageCache, StageRecord, key_hash
from ...tasks.relation_data import Fact
from .analysis import analysis_stage, saved_lens
from .discovery import discovery_inputs, discovery_stage
from .model_run import ModelRun, edge_mask
from .report import compare_report, write_model_report
from .scoring import scoring_inputs, scoring_stage
from .settings import KnowledgeSettings


def run_model(
    model: LoadedModel,
    facts: Sequence[Fact],
    settings: KnowledgeSettings,
    out: Path,
    progress: bool = True,
    cache: Optional[StageCache] = None,
) -> dict:
    """The circuit of ``facts`` (already filtered) on ``model``; writes ``out`` and returns the results
    (`model_stages`, then the tables, figures and report)."""
    out.mkdir(parents=True, exist_ok=True)
    run = ModelRun(model, facts, settings, progress)
    return _finish(run, *model_stages(run, cache or StageCache(out)), out)


def model_stages(run: ModelRun, cache: StageCache) -> tuple[EdgeCircuit, StageRecord, StageRecord, StageRecord]:
    """Three stages of one model, cached in ``cache``, each keyed by what it reads: discovery (edge scores: the
    method's options), scoring (the circuit, random circuits, curve: the selection options and the discovery
    key), analysis (logit lens, head roles: the circuit's edges). Returns the circuit and the three records."""
    model, settings = run.model, run.settings
    check_supported(model)
    base = run.inputs()
    disc = cache.run(f"discovery:{model.name}", base | discovery_inputs(settings), lambda: discovery_stage(run))
    scored = cache.run(
        f"scoring:{model.name}",
        base | {"discovery": disc.key} | scoring_inputs(settings),
        lambda: scoring_stage(run, disc.result),
    )
    try:
        edges = scored.result["edges"]
    except Pending as pending:  # a plan: the analysis reads the circuit still to choose
        cache.pending(f"analysis:{model.name}", pending.stage)
        raise
    circuit = EdgeCircuit.from_mask(
        model.name,
        f"knowledge/{settings.label}",
        run.graph,
        edge_mask(run.graph, edges),
        np.asarray(disc.result["scores"]),
        meta={"settings": asdict(settings), "fingerprint": model.fingerprint},
    )
    analysed = cache.run(
        f"analysis:{model.name}", base | {"edges": key_hash(edges)}, lambda: analysis_stage(run, circuit)
    )
    return circuit, disc, scored, analysed


def _finish(
    run: ModelRun, circuit: EdgeCircuit, disc: StageRecord, scored: StageRecord, analysed: StageRecord, out: Path
) -> dict:
    """The summary of one model (``results.json``), its circuit, tables, figures and report."""
    out.mkdir(parents=True, exist_ok=True)
    settings, graph, sc = run.settings, run.graph, scored.result
    lens, roles = saved_lens(analysed.result["lens"]), analysed.result["roles"]
    n_edges, full_hit, hit = len(sc["edges"]), sc["full_hit"], sc["circuit_hit"]
    nodes = [n for n in circuit.nodes() if n != "LOGITS"]
    hit_key = f"hit@{settings.k}"
    random_hits = sc["random_hits"]
    summary = {
        "model": run.model.name,
        "fingerprint": run.model.fingerprint,
        "relation": settings.label,
        "n_facts": len(run.facts),
        "n_edges_graph": graph.n_edges,
        "full": sc["full"],
        "empty": sc["empty"],
        "circuit": sc["circuit"],
        "circuit_edges": n_edges,
        "circuit_fraction": n_edges / graph.n_edges,
        "circuit_nodes": len(nodes),
        "circuit_heads": sum(n.startswith("L") for n in nodes),
        "ratio_to_full": hit / full_hit if full_hit else float("nan"),
        "random": {hit_key: random_hits, "mean": float(np.mean(random_hits)) if random_hits else float("nan")},
        "heldout": sc.get("heldout"),
        "sweep": sc["sweep"],
        "curve": sc["curve"],
        "roles": roles,
        "acdc": disc.result.get("acdc"),
        "role_counts": {
            r: sum(v["role"] == r for v in roles.values()) for r in ("mover", "relation", "mixed", "other")
        },
        "logit_lens": {
            "layers": lens["layers"],
            "last_median_rank": np.median(lens["last"], 1).tolist(),
            "last_subject_median_rank": np.median(lens["last_subject"], 1).tolist(),
            "first_layer_top10_last": _first_layer(lens["last"], settings.k, lens["layers"]),
            "first_layer_top10_subject": _first_layer(lens["last_subject"], settings.k, lens["layers"]),
            "nodes_median_rank": {n: float(np.median(r)) for n, r in lens["nodes"].items()},
        },
        "done_when": {
            "hit_ratio_at_least_0.7": bool(hit >= 0.7 * full_hit),
            "under_10pct_edges": n_edges / graph.n_edges < 0.10,
            "beats_random": bool(hit > max(random_hits, default=0.0)),
        },
        "timings_s": {**disc.result["timings"], **sc["timings"], **analysed.result["timings"]},
        "stages": {r.name: {"key": r.key, "seconds": r.seconds, "cached": r.cached} for r in (disc, scored, analysed)},
        "settings": asdict(settings),
        "facts": [f.to_dict() for f in run.facts],
    }
    circuit.meta.update({"hit": hit, "full_hit": full_hit})
    circuit.save(out / "circuit.json")
    write_json(out / "results.json", summary)
    write_model_report(summary, circuit, lens, roles, sc["curve"], out, settings, full_hit)
    return summary


def _first_layer(ranks: np.ndarray, k: int, layers: list[str]) -> Optional[str]:
    """The first layer whose median rank of the answer is below ``k`` (None: none)."""
    med = np.median(ranks, 1)
    hit = np.flatnonzero(med < k)
    return layers[int(hit[0])] if len(hit) else None


def compare(results: dict[str, dict], circuits: dict[str, EdgeCircuit]) -> dict:
    """Edge and node overlap of the circuits of two models, and the heads whose role persists."""
    (a, ra), (b, rb) = list(results.items())[:2]
    ca, cb = circuits[a], circuits[b]
    g = ca.graph
    ea, eb = set(ca.edges), set(cb.edges)
    na = {n for n in ca.nodes() if n != "LOGITS"}
    nb = {n for n in cb.nodes() if n != "LOGITS"}

    def row(what, x, y, total):
        inter = len(x & y)
        return {
            "what": what,
            "first": len(x),
            "second": len(y),
            "intersection": inter,
            "jaccard": inter / len(x | y) if x | y else float("nan"),
            "p_value": hypergeom_p(inter, total, len(x), len(y)),
        }

    heads_a = {n for n in na if n.startswith("L")}
    heads_b = {n for n in nb if n.startswith("L")}
    rows = [
        row("edges", ea, eb, g.n_edges),
        row("nodes", na, nb, g.n_senders),
        row("heads", heads_a, heads_b, g.n_layers * g.n_heads),
    ]
    persisting = {}
    for role in ("mover", "relation", "mixed"):
        xa = {h for h, v in ra["roles"].items() if v["role"] == role}
        xb = {h for h, v in rb["roles"].items() if v["role"] == role}
        persisting[role] = {"first": sorted(xa), "second": sorted(xb), "both": sorted(xa & xb)}
    return {"models": [a, b], "overlap": rows, "persisting_roles": persisting}


def write_relation(settings: KnowledgeSettings, res: dict, out: Path, cache: StageCache) -> dict:
    """The results of one relation from its stage records: per model (one model: into ``out``, several: into
    ``out/<model>``), the comparison and ``study.json``; returns ``{"study", "results"}``."""
    facts, full_hits = res["facts"], res["data"].result["full_hits"]
    results, circuits = {}, {}
    single = len(res["models"]) == 1
    for name, (run, circuit, disc, scored, analysed) in res["models"].items():
        sub = out if single else out / name
        results[name] = _finish(run, circuit, disc, scored, analysed, sub)
        results[name]["all_facts_hit"] = full_hits[name]
        results[name]["n_facts_relation"] = len(facts)
        circuits[name] = circuit  # as _finish saved it
    study = {
        "relation": settings.label,
        "models": list(res["models"]),
        "n_facts_relation": len(facts),
        "n_facts_kept": len(res["kept"]),
        "full_hit_all_facts": full_hits,
        "stages": cache.summary(),
    }
    if not single:
        cmp = compare(results, circuits)
        study["comparison"] = cmp
        write_table(cmp["overlap"], out / "overlap", caption="circuit overlap")
        write_text(out / "comparison.md", compare_report(cmp, results, settings))
    write_json(out / "study.json", study)
    return {"study": study, "results": results}
