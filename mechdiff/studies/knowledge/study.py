"""The knowledge-circuit study (kind ``knowledge``) of one or more relations on one or more checkpoints.

For each model: keep the facts it gets right by Hit@k (the paper's sampling); score every edge
(EAP-IG by default, or run ACDC); choose the circuit as the smallest circuit among ``sizes``
(greedy growth from the logits by score, or top scores; dangling edges pruned) whose Hit@k
reaches ``target`` x the full model's; compare with
random circuits of the same edge count; the MIB-style faithfulness curve with CPR and CMD;
logit lens and head roles; figures and tables. With two or more models the facts are those every
model gets right, and the circuits are compared (edge and node overlap, persisting heads).

Stages, each cached in ``<out>/stages/`` by `mechdiff.runs.stages.StageCache` under a key of
what it reads: ``facts`` (which facts every model gets right), and per model ``discovery`` (edge
scores), ``scoring`` (the circuit, random circuits, the curve) and ``analysis`` (logit lens, head
roles). A rerun recomputes only the stages a changed option reaches; tables, figures and reports are
rewritten from the records every time. Random circuits draw their seeds by name
(`mechdiff.runs.seeds.derive`). The methods (edge graph, EAP/ACDC, evaluation, logit lens) are the
library `mechdiff.methods.knowledge`; this module runs them as stages (`KnowledgeStudy`).
"""

from __future__ import annotations

import logging
import math
import time
from dataclasses import asdict, dataclass, field, replace
from functools import cached_property
from pathlib import Path
from typing import Any, Callable, Optional, Sequence

import numpy as np

from ...circuits.overlap import hypergeom_p
from ...common.io import write_json, write_text
from ...methods.knowledge.acdc import METRICS, acdc, discovery_batch
from ...methods.knowledge.analysis import attention_mass, head_roles, logit_lens
from ...methods.knowledge.discovery import attribution_scores, greedy_edges, iterative_pruning, top_edges
from ...methods.knowledge.evaluate import CURVE_RANKING, SIZES, CircuitEval, evaluate, faithfulness_curve, random_mask
from ...methods.knowledge.forward import Ablation, check_supported, mean_ablation
from ...methods.knowledge.graph import EdgeCircuit, Graph
from ...models.loading import LoadedModel
from ...models.modelset import check_vocabularies
from ...report.tables import write_table
from ...runs.seeds import derive
from ...runs.stages import Pending, StageCache, StageRecord, key_hash
from ...tasks.relation_data import Fact, Relation, batches, build_facts
from ..base import Study, load_section_file, section_study
from .report import compare_report, write_model_report

log = logging.getLogger(__name__)

METHODS = ("eap", "iterative", "eap-ig", "acdc")
ABLATIONS = ("mean", "zero")
SELECTIONS = ("greedy", "topk")


@dataclass
class KnowledgeSettings:
    """The ``[knowledge]`` section of a task file (``tasks/knowledge.toml``); the command's flags override it."""

    relation: str = "country_language"
    unedited: bool = False  # an edit file's subjects with their original objects (the facts before the edit)
    models: tuple = ("smollm2-135m",)  # one circuit each on the facts all get right, then their overlap
    template: int = 0
    method: str = "eap"  # one of METHODS
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
    acdc_metric: str = "match_nll"  # one of acdc.METRICS (match_nll: the paper's); see knowledge/acdc.py
    acdc_prefilter: float = 0.0  # ACDC tries only this top fraction of edges by |EAP| (0: every edge)
    acdc_batch: int = 0  # ACDC candidate edges per forward (0: sized by memory)
    acdc_facts: int = 0  # ACDC on at most this many top-1 facts of one length (0: every fact)
    n_random: int = 3
    max_facts: int = 0  # 0: every fact of the relation
    batch_size: int = 32
    signed: bool = False  # rank edges by score instead of |score|
    prune_unreached: bool = True  # also drop edges from senders without inputs (exact under zero ablation only)
    selection: str = "greedy"  # greedy (grow from the logits) | topk (top edges, dangling ones pruned)
    seed: int = 0
    max_graph_edges: int = 200  # edges drawn in the circuit figure
    # the study (`mechdiff run`): these relations, each into <[output] dir>/<relation> (empty: `relation` into dir)
    relations: tuple = ()
    templates: dict = field(default_factory=dict)  # relation -> its template, where not `template`

    @property
    def label(self) -> str:
        """The relation as reports name it (an edit file's facts before the edit: ``<relation> (unedited)``)."""
        return f"{self.relation} (unedited)" if self.unedited else self.relation


CHOICES = {
    ("knowledge", "method"): METHODS,
    ("knowledge", "ablation"): ABLATIONS,
    ("knowledge", "selection"): SELECTIONS,
    ("knowledge", "acdc_metric"): METRICS,
}


def load_settings(path: str | Path) -> KnowledgeSettings:
    """The ``[knowledge]`` section of the task file ``path`` (unknown keys refused with their line)."""
    return load_file(path)[0]


def load_file(path: str | Path) -> tuple[KnowledgeSettings, str]:
    """The ``[knowledge]`` settings and the ``[output] dir`` of the task file ``path`` (checked with their line)."""
    return load_section_file(path, "knowledge", KnowledgeSettings, CHOICES, "tasks/knowledge.toml")


def full_model_hits(model: LoadedModel, facts: Sequence[Fact], settings: KnowledgeSettings) -> np.ndarray:
    graph = Graph.for_model(model)
    return evaluate(model, graph, batches(facts, settings.batch_size), None, Ablation(), settings.k).hit


def load_facts(model: LoadedModel, settings: KnowledgeSettings) -> list[Fact]:
    relation = Relation.load(settings.relation)
    facts = build_facts(model.tokenizer, relation.unedited() if settings.unedited else relation, settings.template)
    if settings.max_facts:
        facts = facts[: settings.max_facts]
    return facts


def facts_key(facts: Sequence[Fact]) -> str:
    """What a stage reads of the facts: their tokens and answer tokens."""
    return key_hash([[f.ids, f.answer_id] for f in facts])


# --------------------------------------------------------------------------------------
# Stages of one model: discovery (edge scores), scoring (the circuit and its controls), analysis
# --------------------------------------------------------------------------------------


class _Run:
    """One model on one fact set: the graph, batches, and (computed on first use, only when a stage that
    needs them is not cached) the ablation and the full and empty circuits' evaluations."""

    def __init__(self, model: LoadedModel, facts: Sequence[Fact], settings: KnowledgeSettings, progress: bool):
        self.model, self.facts, self.settings, self.progress = model, facts, settings, progress
        self.graph = Graph.for_model(model)
        self.batches = batches(facts, settings.batch_size)
        self.timings: dict[str, float] = {}

    def timed(self, name: str, fn):
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
        from ...version import __version__

        s = self.settings
        return {
            "model": self.model.fingerprint,
            "facts": facts_key(self.facts),
            "ablation": s.ablation,
            "keep_first": s.keep_first,
            "batch_size": s.batch_size,
            "mechdiff": __version__,
        }


def _wanted_sizes(s: KnowledgeSettings) -> list[float]:
    return sorted({*s.sizes, *(s.curve_sizes if s.curve else ())} - {1.0})


def discovery_inputs(s: KnowledgeSettings) -> dict:
    """The options edge scoring reads, per method."""
    acdc_options = {"tau": s.tau, "metric": s.acdc_metric, "prefilter": s.acdc_prefilter, "acdc_facts": s.acdc_facts}
    per_method = {
        "eap-ig": {"ig_steps": s.ig_steps},
        "acdc": acdc_options,
        "iterative": {"shrink": s.shrink, "sizes": _wanted_sizes(s), "prune_unreached": s.prune_unreached},
    }
    return {"method": s.method, **per_method.get(s.method, {})}


def _indices(mask: np.ndarray) -> list[int]:
    return np.flatnonzero(mask).tolist()


def _mask(graph: Graph, indices: Sequence[int]) -> np.ndarray:
    mask = np.zeros(graph.n_edges, dtype=bool)
    mask[list(indices)] = True
    return mask


def discovery_stage(run: _Run) -> dict:
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
        out["acdc_edges"] = _indices(found.mask)
        out["acdc"] = found.summary() | {"facts": [f.prompt for b in on for f in b.facts]}
    elif s.method == "iterative":
        pruned, scores = iterative_pruning(
            run.model, g, run.batches, _wanted_sizes(s), run.ablation, s.shrink, run.progress, s.prune_unreached
        )
        out["pruned"] = {repr(frac): _indices(m) for frac, m in pruned.items()}
    else:
        scores = attribution_scores(run.model, g, run.batches, s.method, s.ig_steps, run.ablation, run.progress)
    run.timings["discovery"] = time.time() - t
    return {**out, "scores": np.asarray(scores, dtype=float).tolist(), "timings": dict(run.timings)}


def _pruned(graph: Graph, disc: dict) -> Optional[dict[float, np.ndarray]]:
    return None if disc["pruned"] is None else {float(f): _mask(graph, ix) for f, ix in disc["pruned"].items()}


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


def _select(run: _Run, scores: np.ndarray, pruned: Optional[dict], full_hit: float) -> tuple[np.ndarray, list]:
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


def scoring_stage(run: _Run, disc: dict) -> dict:
    """The circuit (chosen size), its Hit@k against the full and empty models and random circuits, and the
    faithfulness curve."""
    s, g = run.settings, run.graph
    run.timings.clear()
    full, empty = run.full_and_empty
    full_hit = float(full.hit.mean())
    scores, pruned = np.asarray(disc["scores"]), _pruned(g, disc)
    t = time.time()
    if disc["acdc_edges"] is not None:
        mask, sweep = _mask(g, disc["acdc_edges"]), []
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
        "edges": _indices(mask),
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


def analysis_stage(run: _Run, circuit: EdgeCircuit) -> dict:
    """Logit lens of the residual stream and of the circuit's nodes, attention mass and head roles."""
    t = time.time()
    nodes = [n for n in circuit.nodes() if n != "LOGITS"]
    lens = logit_lens(run.model, run.graph, run.batches, nodes)
    attn = attention_mass(run.model, run.batches, [n for n in nodes if n.startswith("L")])
    roles = head_roles(attn, lens["nodes"])
    lens_json = {
        "layers": list(lens["layers"]),
        "last": np.asarray(lens["last"]).tolist(),
        "last_subject": np.asarray(lens["last_subject"]).tolist(),
        "nodes": {n: np.asarray(r).tolist() for n, r in lens["nodes"].items()},
    }
    return {"lens": lens_json, "roles": roles, "timings": {"analysis": time.time() - t}}


def _lens(saved: dict) -> dict:
    return {
        "layers": saved["layers"],
        "last": np.asarray(saved["last"]),
        "last_subject": np.asarray(saved["last_subject"]),
        "nodes": {n: np.asarray(r) for n, r in saved["nodes"].items()},
    }


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
    run = _Run(model, facts, settings, progress)
    return _finish(run, *model_stages(run, cache or StageCache(out)), out)


def model_stages(run: _Run, cache: StageCache) -> tuple[EdgeCircuit, StageRecord, StageRecord, StageRecord]:
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
        _mask(run.graph, edges),
        np.asarray(disc.result["scores"]),
        meta={"settings": asdict(settings), "fingerprint": model.fingerprint},
    )
    analysed = cache.run(
        f"analysis:{model.name}", base | {"edges": key_hash(edges)}, lambda: analysis_stage(run, circuit)
    )
    return circuit, disc, scored, analysed


def _finish(
    run: _Run, circuit: EdgeCircuit, disc: StageRecord, scored: StageRecord, analysed: StageRecord, out: Path
) -> dict:
    """The summary of one model (``results.json``), its circuit, tables, figures and report."""
    out.mkdir(parents=True, exist_ok=True)
    settings, graph, sc = run.settings, run.graph, scored.result
    lens, roles = _lens(analysed.result["lens"]), analysed.result["roles"]
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


# --------------------------------------------------------------------------------------
# The cost of each stage above, for the resource plan (`mechdiff.studies.planner`): passes of the edge forward
# (`edge_forward`: a forward of the model plus every receiver's input mixed from the senders, 2 x edges x d_model
# FLOPs a token) over the facts' batches (one token length each, `batches`)
# --------------------------------------------------------------------------------------


def fact_lengths(facts: Sequence[Fact]) -> dict[int, int]:
    """Facts per token length: what `batches` groups them by."""
    out: dict[int, int] = {}
    for f in facts:
        out[len(f.ids)] = out.get(len(f.ids), 0) + 1
    return dict(sorted(out.items()))


class _Facts:
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
        from ...models.footprint import backward_bytes, dtype_bytes

        m, g = self.meter, self.graph
        t = max(self.lengths, default=1)
        rows = m.rows(sum(self.lengths.values()), self.batch)
        row = rows * t * m.dims.d_model * dtype_bytes(m.dtype)
        if backward:
            receivers = len(g.receivers)
            return backward_bytes(m.dims, rows, t, m.dims.n_layers, m.dtype) + (3 * g.n_senders + receivers) * row
        return m.act(rows, t) + (g.n_senders * (2 if kept_outputs else 1) + g.n_attn_receivers) * row


def _ablation_runs(s: KnowledgeSettings) -> int:
    """Edge forwards a fact set's mean ablation takes (one; none for zero ablation)."""
    return 1 if s.ablation == "mean" else 0


def facts_cost(meter: Any, s: KnowledgeSettings, graph: Graph, every: _Facts, stage: str) -> Any:
    """`facts_stage`: each model's full forward of every fact of the relation."""
    from ..planner import StageCost

    models = len(s.models)
    passes = models * every.passes
    return StageCost(
        stage, models, sum(every.lengths.values()), every.meter.rows(sum(every.lengths.values()), s.batch_size),
        every.flops(models), models * meter.weights, 0, every.transient(), batch_option="[knowledge] batch_size",
        reads=meter.reads(passes),
    )  # fmt: skip


def discovery_runs(s: KnowledgeSettings, edges: int) -> tuple[float, float, str]:
    """The edge forwards (of every kept fact) `discovery_stage` takes, the share of them with a backward, and a
    note: the mean ablation, then EAP's one forward and backward (EAP-IG: ``ig_steps``); iterative pruning's, one
    per step of its schedule; ACDC's full and empty circuits and (an estimate: it skips dead receivers and stops
    trying none) one run a tried edge, ``acdc_batch`` (else up to 16) edges a run."""
    ablation = _ablation_runs(s)
    if s.method in ("eap", "eap-ig"):
        steps = 1 if s.method == "eap" else s.ig_steps
        return ablation + steps, steps, ""
    if s.method == "iterative":
        sizes, f, schedule = sorted(_wanted_sizes(s), reverse=True), 1.0, 0
        for t in sizes:
            while f * s.shrink > t:
                f, schedule = f * s.shrink, schedule + 1
            schedule, f = schedule + 1, t
        return ablation + schedule, schedule, ""
    tried = math.ceil((s.acdc_prefilter or 1.0) * edges)
    prefilter = 1 if s.acdc_prefilter else 0  # EAP scores the edges it tries
    runs = ablation + 2 + prefilter + math.ceil(tried / (s.acdc_batch or 16))
    return runs, prefilter, f"ACDC: about {tried} edges tried, {s.acdc_batch or 'up to 16'} a run (an estimate)"


def discovery_cost(meter: Any, s: KnowledgeSettings, graph: Graph, kept: _Facts, stage: str) -> Any:
    """`discovery_stage` on the kept facts (`discovery_runs`); a backward counted as two forwards' FLOPs."""
    from ..planner import StageCost

    runs, backward, note = discovery_runs(s, graph.n_edges)
    on = kept
    if s.method == "acdc" and s.acdc_facts:  # the trials run on one batch of acdc_facts facts of one length
        t = max(kept.lengths, key=kept.lengths.__getitem__, default=1)
        on = _Facts(meter, graph, {t: min(s.acdc_facts, kept.lengths.get(t, 0))}, s.acdc_facts)
    trials = runs - _ablation_runs(s) - (2 if s.method == "acdc" else 0) - backward
    full = runs - trials
    passes = full * kept.passes + trials * on.passes
    flops = kept.flops(full + 2 * backward) + on.flops(trials)
    n = sum(kept.lengths.values())
    return StageCost(
        stage, len(s.models), n, meter.rows(n, s.batch_size), flops, len(s.models) * meter.weights, 0,
        kept.transient(kept_outputs=True, backward=backward > 0), note=note, batch_option="[knowledge] batch_size",
        reads=meter.reads(passes),
    )  # fmt: skip


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
    meter: Any, s: KnowledgeSettings, graph: Graph, kept: _Facts, stage: str, tried: Optional[int] = None
) -> Any:
    """`scoring_stage` (`scoring_runs`)."""
    from ..planner import StageCost

    runs = scoring_runs(s, graph.n_edges, tried)
    note = "" if tried is not None or s.method == "acdc" else "every size tried (the first to reach target ends it)"
    n = sum(kept.lengths.values())
    return StageCost(
        stage, len(s.models), n, meter.rows(n, s.batch_size), kept.flops(runs), len(s.models) * meter.weights, 0,
        kept.transient(), note=note, batch_option="[knowledge] batch_size", reads=meter.reads(runs * kept.passes),
    )  # fmt: skip


def analysis_cost(meter: Any, s: KnowledgeSettings, graph: Graph, kept: _Facts, stage: str) -> Any:
    """`analysis_stage`: the logit lens's edge forward of every kept fact (the senders' outputs kept) with the
    unembedding of the residual stream after every layer at two positions, and `attention_mass`'s plain forward."""
    from ..planner import StageCost

    d, n = meter.dims, sum(kept.lengths.values())
    lens = 2 * (1 + d.n_layers) * n * 2 * d.d_model * d.vocab_size
    flops = kept.flops(1) + sum(meter.fwd(c, t) for t, c in kept.lengths.items()) + lens
    return StageCost(
        stage, len(s.models), n, meter.rows(n, s.batch_size), flops, len(s.models) * meter.weights, 0,
        kept.transient(kept_outputs=True), batch_option="[knowledge] batch_size",
        reads=meter.reads(2 * kept.passes),
    )  # fmt: skip


def relation_costs(meter: Any, s: KnowledgeSettings, lengths: dict[int, int], known: dict, prefix: str) -> list:
    """The stages of one relation (its facts ``lengths``): facts, then each model's discovery, scoring and
    analysis. Every fact is assumed right in every model unless ``known["kept"]`` gives the kept facts' lengths;
    ``known["tried"]``: per model, the sizes scoring tried."""
    from ...models.architectures import ModelShape

    dims = meter.dims
    graph = Graph.from_shape(
        ModelShape(dims.n_layers, dims.n_heads, dims.n_kv_heads, dims.d_head, dims.d_model, dims.vocab_size)
    )
    every = _Facts(meter, graph, lengths, s.batch_size)
    kept = _Facts(meter, graph, known.get("kept") or lengths, s.batch_size)
    out = [facts_cost(meter, s, graph, every, f"{prefix}facts")]
    for m in s.models:
        tried = known.get("tried", {}).get(m)
        out += [
            discovery_cost(meter, s, graph, kept, f"{prefix}discovery:{m}"),
            scoring_cost(meter, s, graph, kept, f"{prefix}scoring:{m}", tried),
            analysis_cost(meter, s, graph, kept, f"{prefix}analysis:{m}"),
        ]
    return out


def knowledge_found(run_dir: str | Path, facts: Sequence[Fact]) -> dict:
    """What a plan assumes and a finished relation's stage records (in ``run_dir``) know: the kept facts' token
    lengths (``"kept"``, of the relation's ``facts``) and, per model, the sizes scoring tried (``"tried"``)."""
    import json

    out: dict = {"tried": {}}
    for path in sorted((Path(run_dir) / "stages").glob("*.json")):
        rec = json.loads(path.read_text())
        kind, _, model = rec["name"].partition(":")
        if kind == "facts":
            out["kept"] = fact_lengths([facts[i] for i in rec["result"]["kept"]])
        elif kind == "scoring":
            out["tried"][model] = len(rec["result"]["sweep"])
    return out


def plan_facts(s: KnowledgeSettings) -> tuple[dict[str, dict[int, int]], str]:
    """Each relation's facts per token length (`fact_lengths`, after ``max_facts``) under the first model's
    tokenizer, else the stand-in's (`planning_tokenizer`), and which tokenizer counted them."""
    from ..planner import planning_tokenizer

    tokenizer, used = planning_tokenizer(s.models[0])
    out = {}
    for relation in tuple(s.relations) or (s.relation,):
        rs = replace(s, relation=relation, template=s.templates.get(relation, s.template))
        rel = Relation.load(relation)
        facts = build_facts(tokenizer, rel.unedited() if rs.unedited else rel, rs.template)
        out[relation] = fact_lengths(facts[: s.max_facts] if s.max_facts else facts)
    return out, used


class KnowledgeStudy(Study):
    """The knowledge circuits of each relation (``relations``, else ``relation``) on ``settings.models``: per
    relation, the facts every model gets right, one circuit per model, their comparison. One relation: into
    ``out``; several: each into ``out/<relation>`` with its own stage cache (as the committed studies are laid out).
    ``load`` loads a model by name (`model_loader`; a test's tiny models)."""

    kind = "knowledge"

    def __init__(
        self, settings: KnowledgeSettings, out: str | Path, load: Callable[[str], LoadedModel], progress: bool = True
    ):
        super().__init__(out, progress)
        self.settings, self.load = settings, load
        for name in self.relations():
            Relation.load(name)  # an unknown relation is refused before any weights load
        self._models: dict[str, LoadedModel] = {}
        self._caches = {
            r: self.cache if len(self.relations()) == 1 else StageCache(self.dir / r) for r in self.relations()
        }
        self.outcome: dict[str, dict] = {}

    @classmethod
    def from_file(
        cls,
        path: Optional[str | Path],
        out: Optional[str] = None,
        progress: bool = True,
        models: Optional[dict] = None,
        task: Optional[str] = None,
    ) -> "KnowledgeStudy":
        """The study of a task file with ``[study] kind = "knowledge"``; ``models``: how models load (dtype, ...)."""
        return section_study(
            cls, path, out, progress, models, task, load_file, "knowledge", "tasks/knowledge_acdc.toml"
        )

    @classmethod
    def plan_inputs(cls, path: Optional[str | Path], task: Optional[str] = None, dtype: Optional[str] = None) -> Any:
        """The ``[knowledge]`` settings, the first model's dims (every model is assumed of its shape: checkpoints
        of one model) and each relation's facts per token length under its tokenizer (`plan_facts`)."""
        from ...models.footprint import model_dims
        from ..planner import Lengths, PlanInputs

        if path is None or task is not None:
            raise ValueError("a knowledge study is a task file's [knowledge] section; it has no [task] to override")
        s = load_file(path)[0]
        dims, source = model_dims(s.models[0])
        counts, used = plan_facts(s)
        every = [t for c in counts.values() for t, n in c.items() for _ in range(n)] or [1]
        lengths = Lengths(sum(every) / len(every), max(every), {}, 0, used)
        rows = min(2048, s.batch_size * lengths.longest)
        return PlanInputs(
            "knowledge", s, dims, source, lengths, dtype or "float32", tuple(s.models), len(s.models), rows,
            known={"facts": counts},
        )  # fmt: skip

    @classmethod
    def stage_costs(cls, inputs: Any, device: Any) -> list:
        """Per relation: facts, then each model's discovery, scoring and analysis (`relation_costs`)."""
        s, counts = inputs.settings, inputs.known["facts"]
        meter = inputs.meter(device)
        several = len(counts) > 1
        out = []
        for relation, lengths in counts.items():
            known = inputs.known.get("found", {}).get(relation, {})
            out += relation_costs(meter, s, lengths, known, f"{relation}/" if several else "")
        return out

    @classmethod
    def with_batch(cls, settings: Any, cost: Any, batch: int) -> Any:
        return replace(settings, batch_size=batch)

    def relations(self) -> tuple[str, ...]:
        return tuple(self.settings.relations) or (self.settings.relation,)

    def relation_settings(self, relation: str) -> KnowledgeSettings:
        """The settings of one relation: its template where ``templates`` names one."""
        s = self.settings
        return replace(s, relation=relation, template=s.templates.get(relation, s.template))

    def caches(self) -> list[StageCache]:
        return list(self._caches.values())

    def settings_record(self) -> dict:
        return asdict(self.settings)

    def model(self, name: str) -> LoadedModel:
        if name not in self._models:
            self._models[name] = self.load(name)
        return self._models[name]

    def stages(self) -> dict[str, dict]:
        """Per relation: the facts stage, then each model's discovery, scoring and analysis."""
        return {r: self._relation_stages(r) for r in self.relations()}

    def _relation_stages(self, relation: str) -> dict:
        settings, cache = self.relation_settings(relation), self._caches[relation]
        models = [self.model(n) for n in settings.models]
        check_vocabularies({m.name: m.tokenizer for m in models})
        facts = load_facts(models[0], settings)
        data = facts_stage(models, facts, settings, cache)
        try:
            kept = [facts[i] for i in data.result["kept"]]
        except Pending as pending:  # a plan: which facts every model gets right is still to compute
            for m in models:
                for stage in ("discovery", "scoring", "analysis"):
                    cache.pending(f"{stage}:{m.name}", pending.stage)
            return {}
        if not kept:
            raise ValueError(f"no fact of {settings.relation} is right (Hit@{settings.k}) in every model")
        log.info("%s: keeping %d of %d facts", relation, len(kept), len(facts))
        per_model = {}
        for m in models:
            run = _Run(m, kept, settings, self.progress)
            try:
                per_model[m.name] = (run, *model_stages(run, cache))
            except Pending:
                continue
        return {"facts": facts, "data": data, "kept": kept, "models": per_model}

    def write(self, results: dict[str, dict]) -> Path:
        """Per relation: each model's results, tables, figures, report and ``report.html``, the comparison and
        ``study.json``; the study directory's ``report.html`` where it holds several relations."""
        from ...report.html import write_html

        reports = []
        for relation, res in results.items():
            out = self._caches[relation].root
            self.outcome[relation] = _write_relation(self.relation_settings(relation), res, out, self._caches[relation])
            reports.append(out / ("comparison.md" if len(res["models"]) > 1 else "report.md"))
            write_html(out)  # each relation's page (its circuit, tables), as `mechdiff view` writes it
        if any(r.parent != self.dir for r in reports):
            write_html(self.dir)
        return reports[0] if len(reports) == 1 else self.dir


def _write_relation(settings: KnowledgeSettings, res: dict, out: Path, cache: StageCache) -> dict:
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
