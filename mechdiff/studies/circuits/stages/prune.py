"""Pruning (``prune:<model>``): a circuit's minimality on pruning's own prompts, by greedy search or the paper's
pairwise rule, and the pruned circuit. Its records make the report's pruning section (`report.pruning_section`)."""

from __future__ import annotations

import math
from typing import Any, Optional

from ....circuits.circuit import Circuit
from ....common.metrics import scored_metric
from ....models.devices import GIB
from ....runs.seeds import prompt_seed
from ....runs.stages import StageRecord, label
from ...planner import StageCost
from ..spec import MATRIX_ONLY, section_inputs
from .counting import Context, plan_steps, scored


def inputs(study: Any, name: str, circuit_key: str) -> dict:
    """The stage's key inputs: the model, the circuit's key, ``[scoring]`` less the matrix's random control and
    the other models' seeds, the task and the metric."""
    scoring = section_inputs("scoring", study.spec.scoring)
    own = scoring.pop("models", {}).get(name)  # another model's seed leaves this stage's key alone
    for k, keyed in MATRIX_ONLY.items():  # the matrix's random control leaves pruning's key alone
        if keyed is None:
            scoring.pop(k, None)
        else:
            scoring[k] = keyed
    return {
        "model": study.digests[name],
        "circuit": circuit_key,
        "scoring": {**scoring, **({"models": {name: own}} if own is not None else {})},
        "task": study.task_inputs(),
        **study.metric_inputs(),
    }


def metric(study: Any) -> str:
    """The metric pruning decides on: ``accuracy``, or for ``[scoring] prune_metric = "prob"`` (the continuous)
    the task's own (the answer's probability, or the logit difference)."""
    return scored_metric(study.spec.scoring.prune_metric, study.task.metric)


def run(study: Any, name: str, circuit_rec: StageRecord) -> StageRecord:
    """The circuit of ``circuit_rec`` pruned on ``name``; ``[scoring.models.NAME] seed`` (the paper: one per
    model) draws this model's pruning reference and greedy candidates in place of the study's seed."""
    from ....circuits.pruning import disjoint_groups, minimality, pairwise_minimality, prune

    s = study.spec.scoring
    own = s.models.get(name, {}).get("seed")
    seed = study.seed("prune") if own is None else prompt_seed(own, "prune")

    def compute() -> dict:
        circuit = Circuit.from_dict(circuit_rec.result["circuit"])
        if s.prune_disjoint:  # the paper: A minus B before pruning, so no pair is scored in two groups
            circuit = disjoint_groups(circuit)
        # Pruning decides on its own prompts, never on those the matrix reports.
        scorer = study.scorer(name, "prune", s.prune_n, own)
        decide = study.prune_metric()
        if s.prune_rule == "paper":
            result = pairwise_minimality(
                scorer, circuit, metric=decide, share=s.prune_share, threshold=s.prune_threshold
            )
        else:
            result = minimality(
                scorer,
                circuit,
                max_steps=s.prune_steps,
                n_candidates=s.prune_candidates,
                seed=seed,
                metric=decide,
                threshold=s.prune_threshold,
            )
        pruned = prune(circuit, result, s.prune_threshold)
        pruned.save(study.dir / "circuits" / f"{label(name)}.pruned.json")
        return {"circuit": pruned.to_dict(), "minimality": result}

    return study.cache.run(f"prune:{name}", inputs(study, name, circuit_rec.key), compute)


# ---------------------------------------------------------------------------------------------- its cost


def cost(ctx: Context, name: str) -> Optional[StageCost]:
    """Pruning's cost by ``[scoring] prune_rule``: the paper's pairwise rule, F(C \\ {u}) and F(C \\ {u, v}) once
    per set (the scorer caches them), each a suffix run from the group's position over the layers from the lowest
    removed head (half of them, on average); else greedy (`greedy_cost`)."""
    s = ctx.spec.scoring
    if not s.prune:
        return None
    sizes, t = group_sizes(ctx, name), ctx.lengths
    if s.prune_rule != "paper":
        return greedy_cost(ctx, name)
    cost = scored(ctx, f"prune:{name}", s.prune_n, 1, "pairwise: each head and each pair of heads of a group")
    keep_resumed(ctx, cost)
    for g, pos in zip(sizes, group_positions(ctx, len(sizes))):
        runs = s.prune_n * (g + g * (g - 1) / 2)
        cost.flops += ctx.fwd(runs, t.after(pos), t.tokens, ctx.dims.n_layers / 2)
        passes = (g + g * (g - 1) / 2) * math.ceil(s.prune_n / ctx.spec.eval.batch_size)
        cost.reads += ctx.reads(passes, ctx.dims.n_layers / 2)
    return cost


def greedy_cost(ctx: Context, name: str) -> StageCost:
    """mechdiff's greedy minimality: F(M), F(C) and F(C)'s run kept for resuming; per pair v, F(C \\ {v}) and, for
    each pair searched, ``prune_steps * prune_candidates`` runs F(C \\ {v, u}) (F(C \\ {u}) is u's own first run);
    each a suffix run from v's layer and position. The share of pairs searched (the others pass the threshold at
    K = {}) is the run's where known, else all."""
    s, t, dims = ctx.spec.scoring, ctx.lengths, ctx.dims
    pairs = circuit_pairs(ctx, name)
    assumed = "" if name in ctx.known.get("circuit", {}) else f" (a circuit of {len(pairs)} pairs assumed)"
    cost = scored(ctx, f"prune:{name}", s.prune_n, 2, f"greedy: suffix runs a pair and candidate{assumed}")
    keep_resumed(ctx, cost)
    searched = ctx.known.get("searched", {}).get(name, 1.0)
    passes = 1 + searched * s.prune_steps * s.prune_candidates  # a pair's runs, each of its prune_n prompts
    for layer, pos in pairs:
        cost.flops += ctx.fwd(s.prune_n * passes, t.after(pos), t.tokens, dims.n_layers - layer)
        cost.reads += ctx.reads(passes * math.ceil(s.prune_n / ctx.spec.eval.batch_size), dims.n_layers - layer)
    return cost


def keep_resumed(ctx: Context, cost: StageCost) -> None:
    """``cost`` keeps F(C)'s run of every one of its prompts (`Context.resumed_runs`), and says so."""
    cost.kept = ctx.resumed_runs(cost.n)
    cost.note += f"; keeps F(C)'s run of each of its {cost.n} prompts ({cost.kept / GIB:.1f} GiB, grows with prune_n)"


def group_sizes(ctx: Context, name: str) -> list[int]:
    """Each group's heads before pruning: the path circuit's ``circuit_k`` (or ``top_k``) for ``name``; a curve
    circuit's largest size spread over the position classes."""
    d, dims = ctx.spec.discovery, ctx.dims
    if d.method == "path":
        own = d.models.get(name, {})
        return list((own.get("circuit_k") or d.circuit_k or own.get("top_k") or d.top_k).values())
    pairs = max(d.sizes) * dims.n_layers * dims.n_heads * ctx.lengths.classes
    return [math.ceil(pairs / ctx.lengths.classes)] * ctx.lengths.classes


def group_positions(ctx: Context, count: Optional[int] = None) -> list[str]:
    """The position of each group (``count``: of the circuit's first ``count`` groups): a path circuit's step's
    sender position, else the group's name (a position class)."""
    steps = {step.name: step.sender for step in plan_steps(ctx)} if ctx.spec.discovery.method == "path" else {}
    groups = ctx.spec.dcm.groups if count is None else list(steps)[:count] or ctx.spec.dcm.groups[:count]
    return [steps.get(g, g) for g in groups]


def circuit_pairs(ctx: Context, name: str) -> list[tuple[float, str]]:
    """``name``'s circuit as (layer, position) pairs: the run's where known (``known["circuit"]``), else assumed:
    a path circuit's ``circuit_k`` heads a step at the middle layer; a curve circuit the middle of ``[discovery]
    sizes`` (an assumption: the pick is not known before the curve) spread over every layer and position class."""
    from ....common.components import parse_heads

    found = ctx.known.get("circuit", {}).get(name)
    if found is not None:
        pos = found["positions"]
        return [(h.layer, pos[g]) for g, heads in found["groups"].items() for h in parse_heads(heads)]
    d, dims = ctx.spec.discovery, ctx.dims
    if d.method == "path":
        return [(dims.n_layers / 2, p) for g, p in zip(group_sizes(ctx, name), group_positions(ctx)) for _ in range(g)]
    size = sorted(d.sizes)[len(d.sizes) // 2]
    count = round(size * dims.n_layers * dims.n_heads * ctx.lengths.classes)
    return [((dims.n_layers - 1) / 2, "")] * count
