"""The circuit x model matrix (``matrix:<model>``): every circuit (and pruned circuit) of the study scored on one
model, random circuits and completeness for its own. Its records make the report's matrix, overlap and paired
tables (`report.matrix_section`, `report.paired_section`)."""

from __future__ import annotations

import math
from typing import Any

from ....circuits.circuit import Circuit
from ....runs.stages import StageRecord
from ...planner import StageCost
from ..spec import section_inputs
from .counting import Context, circuit_groups, scored


def inputs(study: Any, name: str, circuits: dict[str, StageRecord]) -> dict:
    """The stage's key inputs: the model, the task, the scored circuits' keys, ``[scoring]`` and the metric."""
    return {
        "model": study.digests[name],
        "task": study.task_inputs(),
        "circuits": {k: r.key for k, r in circuits.items()},
        "scoring": section_inputs("scoring", study.spec.scoring),
        **study.metric_inputs(),
    }


def run(study: Any, name: str, circuits: dict[str, StageRecord]) -> StageRecord:
    """Every circuit of ``circuits`` scored on ``name``; random circuits and completeness for its own."""
    from ....circuits.measures import completeness, matrix_rows

    s = study.spec.scoring

    def compute() -> dict:
        scorer = study.scorer(name, "matrix")
        loaded = {key: Circuit.from_dict(rec.result["circuit"]) for key, rec in circuits.items()}
        outcomes: dict = {}
        rows = matrix_rows(
            name,
            loaded,
            scorer,
            n_random=s.random_draws,
            seed=study.seed("matrix"),
            random_for=[name],
            outcomes=outcomes,
            random_prompts=s.random_prompts,
            # an item: a clean prompt (its tokens), so the draws' intervals resample prompts, not rows
            items=[" ".join(map(str, r.input_ids)) for r in scorer.records],
        )
        own = loaded.get(name)
        comp = (
            completeness(
                scorer,
                own,
                n_draws=s.completeness_draws,
                seed=study.seed("matrix"),
                groups=study.analysis_groups(own, s.completeness_groups or study.spec.dcm.groups, check=False),
            )
            if own is not None and s.completeness_draws > 0
            else None
        )
        return {"rows": rows, "completeness": comp, "outcomes": outcomes}

    return study.cache.run(f"matrix:{name}", inputs(study, name, circuits), compute)


# ---------------------------------------------------------------------------------------------- its cost


def cost(ctx: Context, name: str) -> StageCost:
    """Every model's circuit (and pruned circuit) kept, and completeness: two runs a draw and two a group removed
    whole (``completeness_groups``, else ``[dcm] groups``); the own circuit's ``random_draws`` random circuits, one
    run each on ``random_prompts`` of the prompts."""
    s, models = ctx.spec.scoring, len(ctx.spec.model_names)
    groups = len(completeness_groups(ctx, name))
    circuits = distinct_circuits(ctx) or models * (2 if s.prune else 1)
    runs = circuits + (2 * s.completeness_draws + 2 * groups if s.completeness_draws else 0)
    drawn = min(s.random_prompts or s.n, s.n)
    note = f"{s.random_draws} random circuits x {drawn} prompts = {s.random_draws * drawn} runs"
    cost = scored(ctx, f"matrix:{name}", s.n, runs, note if s.random_draws else "")
    cost.flops += ctx.fwd(s.random_draws * drawn, ctx.lengths.tokens)
    cost.reads += ctx.reads(s.random_draws * math.ceil(drawn / ctx.spec.eval.batch_size))
    return cost


def distinct_circuits(ctx: Context) -> int:
    """Circuits of different pairs among every model's circuit and pruned circuit, where the run found them all
    (the scorer runs a set of pairs once); else 0."""
    names = [n for m in ctx.spec.model_names for n in ([m, f"{m} pruned"] if ctx.spec.scoring.prune else [m])]
    found = ctx.known.get("circuit", {})
    if not all(n in found for n in names):
        return 0
    sets = {frozenset((h, found[n]["positions"][g]) for g, hs in found[n]["groups"].items() for h in hs) for n in names}
    return len(sets)


def completeness_groups(ctx: Context, name: str) -> list[str]:
    """The groups completeness removes whole: ``completeness_groups`` (else ``[dcm] groups``) that have heads in
    ``name``'s circuit where the run found it, else every non-empty group where they name none of its groups."""
    wanted = ctx.spec.scoring.completeness_groups or ctx.spec.dcm.groups
    return circuit_groups(ctx, name, wanted)
