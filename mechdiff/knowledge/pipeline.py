"""The knowledge-circuit study of one relation on one or more checkpoints.

For each model: keep the facts it gets right by Hit@k (the paper's sampling); score every edge
(EAP-IG by default, or run ACDC); choose the circuit as the smallest circuit among ``sizes``
(greedy growth from the logits by score, or top scores; dangling edges pruned) whose Hit@k
reaches ``target`` x the full model's; compare with
random circuits of the same edge count; the MIB-style faithfulness curve with CPR and CMD;
logit lens and head roles; figures and tables. With two or more models the facts are those every
model gets right, and the circuits are compared (edge and node overlap, persisting heads).
"""

from __future__ import annotations

import logging
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Optional, Sequence

import numpy as np

from ..circuits.overlap import hypergeom_p
from ..io import write_json, write_text
from ..models.loading import LoadedModel
from ..report.tables import to_markdown, write_table
from ..stats import bootstrap
from . import figures
from .analysis import attention_mass, head_roles, logit_lens
from .data import Fact, Relation, batches, build_facts
from .acdc import acdc, discovery_batch
from .discovery import attribution_scores, greedy_edges, iterative_pruning, top_edges
from .evaluate import SIZES, evaluate, faithfulness_curve, random_mask
from .forward import Ablation, check_supported, mean_ablation
from .graph import EdgeCircuit, Graph

log = logging.getLogger(__name__)


@dataclass
class KnowledgeSettings:
    relation: str = "country_language"
    template: int = 0
    method: str = "eap"  # eap | iterative | eap-ig | acdc
    ig_steps: int = 5
    shrink: float = 0.25  # iterative: at most this fraction of the edges kept per round
    ablation: str = "mean"  # mean | zero
    keep_first: bool = False  # never ablate position 0 (the attention sink)
    k: int = 10  # Hit@k
    target: float = 0.7  # circuit Hit@k >= target * full model's
    sizes: tuple = (0.001, 0.002, 0.005, 0.01, 0.02, 0.05, 0.1)  # candidate circuit sizes (fraction of edges)
    curve_sizes: tuple = SIZES
    curve: bool = True
    tau: float = 0.02  # ACDC threshold on its metric (paper: 0.02, 0.01, 0.005)
    acdc_metric: str = "match_nll"  # match_nll (the paper's) | nll | kl: see knowledge/acdc.py
    acdc_prefilter: float = 0.0  # ACDC only on this top fraction of edges by |EAP| (0: every edge)
    acdc_batch: int = 0  # candidate edges per forward (0: sized by memory)
    acdc_facts: int = 0  # ACDC on at most this many top-1 facts of one length (0: every fact)
    n_random: int = 3
    max_facts: int = 0  # 0: every fact of the relation
    batch_size: int = 32
    signed: bool = False  # rank edges by score instead of |score|
    prune_unreached: bool = True  # also drop edges from senders without inputs (exact under zero ablation only)
    selection: str = "greedy"  # greedy (grow from the logits) | topk (top edges, dangling ones pruned)
    seed: int = 0
    max_graph_edges: int = 200  # edges drawn in the circuit figure


def full_model_hits(model: LoadedModel, facts: Sequence[Fact], settings: KnowledgeSettings) -> np.ndarray:
    graph = Graph.for_model(model)
    return evaluate(model, graph, batches(facts, settings.batch_size), None, Ablation(), settings.k).hit


def load_facts(model: LoadedModel, settings: KnowledgeSettings) -> list[Fact]:
    facts = build_facts(model.tokenizer, Relation.load(settings.relation), settings.template)
    if settings.max_facts:
        facts = facts[:settings.max_facts]
    return facts


def run_model(model: LoadedModel, facts: Sequence[Fact], settings: KnowledgeSettings, out: Path,
              progress: bool = True) -> dict:
    """The circuit of ``facts`` (already filtered) on ``model``; writes ``out`` and returns the results."""
    check_supported(model)
    out.mkdir(parents=True, exist_ok=True)
    graph = Graph.for_model(model)
    bs = batches(facts, settings.batch_size)
    timings: dict[str, float] = {}
    t = time.time()
    ablation = mean_ablation(model, graph, bs) if settings.ablation == "mean" else Ablation()
    ablation.keep_first = settings.keep_first
    timings["ablation"] = time.time() - t

    t = time.time()
    full = evaluate(model, graph, bs, None, ablation, settings.k)
    empty = evaluate(model, graph, bs, np.zeros(graph.n_edges, dtype=bool), ablation, settings.k)
    full_hit = float(full.hit.mean())
    timings["full_and_empty"] = time.time() - t

    t = time.time()
    pruned: Optional[dict] = None
    acdc_run: Optional[dict] = None
    if settings.method == "acdc":
        found_on = [discovery_batch(bs, full.rank == 0, settings.acdc_facts)] if settings.acdc_facts else bs
        found = acdc(model, graph, found_on, settings.tau, ablation, settings.acdc_metric, batch=settings.acdc_batch,
                     prefilter=settings.acdc_prefilter or None, progress=progress)
        mask, scores, acdc_run = found.mask, np.nan_to_num(found.effect, nan=0.0), found.summary()
        acdc_run["facts"] = [f.prompt for b in found_on for f in b.facts]
        sweep, chosen = [], {"fraction": float(mask.mean()), "n_edges": int(mask.sum())}
    elif settings.method == "iterative":
        wanted = sorted({*settings.sizes, *(settings.curve_sizes if settings.curve else ())} - {1.0})
        pruned, scores = iterative_pruning(model, graph, bs, wanted, ablation, settings.shrink, progress,
                                           settings.prune_unreached)
    else:
        scores = attribution_scores(model, graph, bs, settings.method, settings.ig_steps, ablation, progress)
    timings["discovery"] = time.time() - t

    t = time.time()
    if settings.method != "acdc":
        sweep = []
        chosen = None
        for frac in settings.sizes:
            if pruned is not None:
                mask = pruned[frac]
            else:
                select = greedy_edges if settings.selection == "greedy" else top_edges
                mask = select(graph, scores, max(1, int(round(frac * graph.n_edges))), prune=True,
                              signed=settings.signed, forward=settings.prune_unreached)
            if not mask.any():
                log.info("size %s: no edge left after pruning dangling edges", frac)
                continue
            ev = evaluate(model, graph, bs, mask, ablation, settings.k)
            row = {"fraction_requested": frac, "n_edges": int(mask.sum()), "fraction": float(mask.mean()),
                   f"hit@{settings.k}": float(ev.hit.mean()),
                   "ratio_to_full": float(ev.hit.mean()) / full_hit if full_hit else float("nan"),
                   "logprob": float(ev.logprob.mean())}
            sweep.append(row)
            log.info("size %s: %s", frac, row)
            if chosen is None and row[f"hit@{settings.k}"] >= settings.target * full_hit:
                chosen = dict(row, mask=mask, eval=ev)
                break
        if chosen is None:
            chosen = dict(sweep[-1], mask=mask, eval=ev)
            log.warning("no size up to %s reached %s x the full model's Hit@%s", settings.sizes[-1], settings.target,
                        settings.k)
        mask = chosen.pop("mask")
        circuit_eval = chosen.pop("eval")
    else:
        circuit_eval = evaluate(model, graph, bs, mask, ablation, settings.k)
    timings["selection"] = time.time() - t

    t = time.time()
    n_edges = int(mask.sum())
    random_hits = [float(evaluate(model, graph, bs, random_mask(graph, n_edges, settings.seed + i), ablation,
                                  settings.k).hit.mean()) for i in range(settings.n_random)]
    timings["random"] = time.time() - t

    t = time.time()
    curve = (faithfulness_curve(model, graph, bs, scores, ablation, settings.curve_sizes, settings.k, full, empty,
                                progress, masks=pruned) if settings.curve and settings.method != "acdc" else None)
    timings["curve"] = time.time() - t

    circuit = EdgeCircuit.from_mask(model.name, f"knowledge/{settings.relation}", graph, mask, scores,
                                    meta={"settings": asdict(settings), "fingerprint": model.fingerprint})
    t = time.time()
    nodes = [n for n in circuit.nodes() if n != "LOGITS"]
    heads = [n for n in nodes if n.startswith("L")]
    lens = logit_lens(model, graph, bs, nodes)
    attn = attention_mass(model, bs, heads)
    roles = head_roles(attn, lens["nodes"])
    timings["analysis"] = time.time() - t

    hit_key = f"hit@{settings.k}"
    summary = {
        "model": model.name, "fingerprint": model.fingerprint, "relation": settings.relation,
        "n_facts": len(facts), "n_edges_graph": graph.n_edges,
        "full": full.summary(settings.k), "empty": empty.summary(settings.k), "circuit": circuit_eval.summary(settings.k),
        "circuit_edges": n_edges, "circuit_fraction": n_edges / graph.n_edges, "circuit_nodes": len(nodes),
        "circuit_heads": len(heads),
        "ratio_to_full": float(circuit_eval.hit.mean()) / full_hit if full_hit else float("nan"),
        "random": {hit_key: random_hits, "mean": float(np.mean(random_hits)) if random_hits else float("nan")},
        "sweep": sweep, "curve": curve, "roles": roles, "acdc": acdc_run,
        "role_counts": {r: sum(v["role"] == r for v in roles.values()) for r in ("mover", "relation", "mixed", "other")},
        "logit_lens": {"layers": lens["layers"],
                       "last_median_rank": np.median(lens["last"], 1).tolist(),
                       "last_subject_median_rank": np.median(lens["last_subject"], 1).tolist(),
                       "first_layer_top10_last": _first_layer(lens["last"], settings.k, lens["layers"]),
                       "first_layer_top10_subject": _first_layer(lens["last_subject"], settings.k, lens["layers"]),
                       "nodes_median_rank": {n: float(np.median(r)) for n, r in lens["nodes"].items()}},
        "done_when": {"hit_ratio_at_least_0.7": bool(float(circuit_eval.hit.mean()) >= 0.7 * full_hit),
                      "under_10pct_edges": n_edges / graph.n_edges < 0.10,
                      "beats_random": bool(float(circuit_eval.hit.mean()) > max(random_hits, default=0.0))},
        "timings_s": timings, "settings": asdict(settings),
        "facts": [f.to_dict() for f in facts],
    }
    circuit.meta.update({"hit": float(circuit_eval.hit.mean()), "full_hit": full_hit})
    circuit.save(out / "circuit.json")
    write_json(out / "results.json", summary)
    _write_tables_and_figures(summary, circuit, lens, roles, curve, out, settings, full_hit)
    return summary


def _first_layer(ranks: np.ndarray, k: int, layers: list[str]) -> Optional[str]:
    med = np.median(ranks, 1)
    hit = np.flatnonzero(med < k)
    return layers[int(hit[0])] if len(hit) else None


def _write_tables_and_figures(summary: dict, circuit: EdgeCircuit, lens: dict, roles: dict, curve: Optional[dict],
                              out: Path, settings: KnowledgeSettings, full_hit: float) -> None:
    k = settings.k
    hk = f"hit@{k}"
    rows = [{"run": "full model", "edges": summary["n_edges_graph"], "edges_%": 100.0,
             hk: summary["full"][hk]["value"], "low": summary["full"][hk]["low"], "high": summary["full"][hk]["high"]},
            {"run": "circuit", "edges": summary["circuit_edges"], "edges_%": 100 * summary["circuit_fraction"],
             hk: summary["circuit"][hk]["value"], "low": summary["circuit"][hk]["low"],
             "high": summary["circuit"][hk]["high"]},
            {"run": f"random ({settings.n_random} draws, mean)", "edges": summary["circuit_edges"],
             "edges_%": 100 * summary["circuit_fraction"], hk: summary["random"]["mean"], "low": None, "high": None},
            {"run": "empty circuit", "edges": 0, "edges_%": 0.0, hk: summary["empty"][hk]["value"],
             "low": summary["empty"][hk]["low"], "high": summary["empty"][hk]["high"]}]
    write_table(rows, out / "hit", caption=f"Hit@{k} on {summary['n_facts']} facts of {settings.relation}")
    if summary["sweep"]:
        write_table(summary["sweep"], out / "sweep", caption="circuit sizes tried (top-|score|, dangling edges pruned)")
    if curve:
        write_table(curve["rows"], out / "faithfulness_curve",
                    caption=f"faithfulness curve (CPR {curve['cpr']:.3f}, CMD {curve['cmd']:.3f})")
        figures.faithfulness_figure(curve, out / "faithfulness_curve.png", full_hit,
                                    title=f"{summary['model']} {settings.relation}: CPR {curve['cpr']:.3f}, "
                                          f"CMD {curve['cmd']:.3f}")
    role_rows = [{"head": h, **r} for h, r in sorted(roles.items(), key=lambda t: (t[1]["role"], t[0]))]
    if role_rows:
        write_table(role_rows, out / "head_roles", caption="head roles in the circuit")
        figures.head_roles_figure(roles, out / "head_roles.png", title=f"{summary['model']} {settings.relation}: head roles")
    figures.logit_lens_figure(lens, out / "logit_lens.png",
                              title=f"{summary['model']} {settings.relation}: logit lens of the residual stream")
    if lens["nodes"]:
        figures.node_lens_figure(lens["nodes"], roles, out / "node_lens.png",
                                 title=f"{summary['model']} {settings.relation}: logit lens of circuit nodes")
    figures.circuit_graph(circuit, out / "circuit.png", settings.max_graph_edges, roles)
    write_text(out / "report.md", _report(summary, settings, curve, role_rows))


def _report(summary: dict, settings: KnowledgeSettings, curve: Optional[dict], role_rows: list[dict]) -> str:
    k = settings.k
    hk = f"hit@{k}"
    f = lambda e: f"{e['value']:.3f} [{e['low']:.3f}, {e['high']:.3f}]"  # noqa: E731
    lines = [f"# Knowledge circuit: {settings.relation} on {summary['model']}", "",
             f"- Facts the model gets right by Hit@{k}: {summary['n_facts']} (template "
             f"{settings.template}); method {settings.method}, {settings.ablation} ablation.",
             f"- Full model Hit@{k}: {f(summary['full'][hk])}; empty circuit: {f(summary['empty'][hk])}.",
             f"- Circuit: {summary['circuit_edges']} of {summary['n_edges_graph']} edges "
             f"({100 * summary['circuit_fraction']:.2f}%), {summary['circuit_nodes']} nodes "
             f"({summary['circuit_heads']} heads); Hit@{k} {f(summary['circuit'][hk])} = "
             f"{summary['ratio_to_full']:.2f} of the full model's.",
             f"- Random circuits of the same edge count: Hit@{k} "
             + ", ".join(f"{v:.3f}" for v in summary["random"][hk]) + ".",
             ]
    if summary.get("acdc"):
        a = summary["acdc"]
        pre = "every edge" if a["prefilter"] is None else f"the top {100 * a['prefilter']:.2f}% of edges by |EAP|"
        lines.append(f"- ACDC: metric {a['metric']}, tau {a['tau']}, on {pre} ({a['n_candidates']} edges); "
                     f"{a['trials']} edges tried in {a['forwards']} forwards ({a['cost']:.0f} forward-pass "
                     f"equivalents), {a['skipped']} removed as edges into dead nodes; metric {a['metric_full']:.3f} "
                     f"-> {a['metric_final']:.3f}; {a['seconds']:.0f} s.")
    if curve:
        lines.append(f"- Faithfulness curve (mean answer log-probability): CPR {curve['cpr']:.3f}, CMD {curve['cmd']:.3f} "
                     f"({curve['area']}).")
    ll = summary["logit_lens"]
    lines += [f"- Logit lens: the answer first reaches median rank < {k} at the last subject token after "
              f"{ll['first_layer_top10_subject']}, at the last token after {ll['first_layer_top10_last']}.",
              f"- Head roles: {summary['role_counts']}.", "",
              "![circuit](circuit.png)", "", "![logit lens](logit_lens.png)", "", "![node lens](node_lens.png)", "",
              "![head roles](head_roles.png)", ""]
    if curve:
        lines += ["![faithfulness](faithfulness_curve.png)", ""]
    if summary["sweep"]:
        lines += ["## Sizes tried", "", to_markdown(summary["sweep"]), ""]
    if role_rows:
        lines += ["## Head roles", "", to_markdown(role_rows), ""]
    lines += ["## Time (s)", "", to_markdown([{"stage": s, "seconds": v} for s, v in summary["timings_s"].items()]), ""]
    return "\n".join(lines)


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
        return {"what": what, "first": len(x), "second": len(y), "intersection": inter,
                "jaccard": inter / len(x | y) if x | y else float("nan"),
                "p_value": hypergeom_p(inter, total, len(x), len(y))}

    heads_a = {n for n in na if n.startswith("L")}
    heads_b = {n for n in nb if n.startswith("L")}
    rows = [row("edges", ea, eb, g.n_edges), row("nodes", na, nb, g.n_senders),
            row("heads", heads_a, heads_b, g.n_layers * g.n_heads)]
    persisting = {}
    for role in ("mover", "relation", "mixed"):
        xa = {h for h, v in ra["roles"].items() if v["role"] == role}
        xb = {h for h, v in rb["roles"].items() if v["role"] == role}
        persisting[role] = {"first": sorted(xa), "second": sorted(xb), "both": sorted(xa & xb)}
    return {"models": [a, b], "overlap": rows, "persisting_roles": persisting}


def compare_report(cmp: dict, results: dict[str, dict], settings: KnowledgeSettings) -> str:
    a, b = cmp["models"]
    hk = f"hit@{settings.k}"
    rows = [{"model": m, "facts": r["n_facts"], f"full {hk}": r["full"][hk]["value"],
             f"circuit {hk}": r["circuit"][hk]["value"], "edges": r["circuit_edges"],
             "edges_%": 100 * r["circuit_fraction"], "random": r["random"]["mean"],
             "CPR": (r["curve"] or {}).get("cpr"), "CMD": (r["curve"] or {}).get("cmd"),
             **{f"{k}": v for k, v in r["role_counts"].items()}} for m, r in results.items()]
    lines = [f"# Knowledge circuits of {settings.relation} across checkpoints: {a} vs {b}", "",
             "Same facts in both models (those both get right by Hit@k).", "", to_markdown(rows), "",
             "## Overlap (hypergeometric p: random sets of the same sizes share at least this many)", "",
             to_markdown(cmp["overlap"]), "", "## Heads whose role persists", ""]
    for role, v in cmp["persisting_roles"].items():
        lines.append(f"- {role}: {a} {v['first']}; {b} {v['second']}; both {v['both']}")
    lines += ["", f"Per-model reports: [{a}]({a}/report.md), [{b}]({b}/report.md).", ""]
    return "\n".join(lines)


def run_study(models: Sequence[LoadedModel], settings: KnowledgeSettings, out: Path, progress: bool = True) -> dict:
    """Facts every model gets right; one circuit per model; the comparison when there are two or more."""
    facts = load_facts(models[0], settings)
    keep = np.ones(len(facts), dtype=bool)
    full_hits = {}
    for m in models:
        if m.tokenizer.get_vocab() != models[0].tokenizer.get_vocab():
            raise ValueError(f"{m.name} and {models[0].name} have different tokenizers; compare checkpoints of one model")
        hits = full_model_hits(m, facts, settings)
        full_hits[m.name] = float(hits.mean())
        keep &= hits
    kept = [f for f, k_ in zip(facts, keep) if k_]
    if not kept:
        raise ValueError(f"no fact of {settings.relation} is right (Hit@{settings.k}) in every model")
    log.info("keeping %d of %d facts", len(kept), len(facts))
    out.mkdir(parents=True, exist_ok=True)
    results, circuits = {}, {}
    single = len(models) == 1
    for m in models:
        sub = out if single else out / m.name
        results[m.name] = run_model(m, kept, settings, sub, progress)
        results[m.name]["all_facts_hit"] = full_hits[m.name]
        results[m.name]["n_facts_relation"] = len(facts)
        circuits[m.name] = EdgeCircuit.load(sub / "circuit.json")
    study = {"relation": settings.relation, "models": [m.name for m in models], "n_facts_relation": len(facts),
             "n_facts_kept": len(kept), "full_hit_all_facts": full_hits}
    if not single:
        cmp = compare(results, circuits)
        study["comparison"] = cmp
        write_table(cmp["overlap"], out / "overlap", caption="circuit overlap")
        write_text(out / "comparison.md", compare_report(cmp, results, settings))
    write_json(out / "study.json", study)
    return {"study": study, "results": results}
