"""CMAP (``cmap:<fine-tune>``): the fine-tune's activations patched into the base per group of a circuit and
per part (Q, K, V, z), against random heads. Its records make the report's CMAP section
(`report.cmap_section`)."""

from __future__ import annotations

import math
from dataclasses import asdict
from typing import Any, Optional

from ....circuits.circuit import Circuit
from ....models.footprint import dtype_bytes
from ....runs.stages import StageRecord
from ...planner import StageCost
from .counting import Context, circuit_groups, group_starts


def inputs(study: Any, finetune: str, circuit_rec: StageRecord, dcm_rec: Optional[StageRecord] = None) -> dict:
    """The stage's key inputs: the base and the fine-tune, the circuit's key, ``[cmap]``, the task, the metric,
    the DCM record's key where it cuts the circuit, and the classes of several tokens it may patch."""
    base = study.spec.models.base
    out = {
        "base": study.digests[base],
        "finetune": study.digests[finetune],
        "circuit": circuit_rec.key,
        "cmap": asdict(study.spec.cmap),
        "task": study.task_inputs(),
        **study.metric_inputs(),  # a logit_diff task's CMAP scores the logit difference too
    }
    if dcm_rec is not None:
        out["dcm"] = dcm_rec.key
    out.update(study.class_groups(study.spec.cmap.groups))
    return out


def run(study: Any, finetune: str, circuit_rec: StageRecord, dcm_rec: Optional[StageRecord] = None) -> StageRecord:
    """CMAP of ``finetune`` over ``circuit_rec``'s circuit (cut to ``dcm_rec``'s selections where given)."""
    key = inputs(study, finetune, circuit_rec, dcm_rec)
    return study.cache.run(f"cmap:{finetune}", key, lambda: compute(study, finetune, circuit_rec, dcm_rec))


def compute(study: Any, finetune: str, circuit_rec: StageRecord, dcm_rec: Optional[StageRecord]) -> dict:
    """What `run` caches: the groups the prompts carry, then `run_cmap` over them."""
    from ....circuits.measures import control_prompts
    from ....methods.cmap import run_cmap
    from ....methods.cmap_patches import dcm_cut

    c, base = study.spec.cmap, study.spec.models.base
    owner = finetune if c.scope == "paper" else base
    circuit = Circuit.from_dict(circuit_rec.result["circuit"])
    if dcm_rec is not None:
        circuit = dcm_cut(circuit, dcm_rec.result["dcm"], c.selection)
    if not circuit.heads():
        return {"skipped": f"the circuit of {owner} has no heads left after pruning; there is nothing to patch"}
    records = study.task.records(study.tokenizer, c.n, study.seed("cmap"), **study.options(prompts="cmap"))
    groups, left_out = study.group_choice(circuit, c.groups)
    if not groups:
        return {
            "skipped": f"no group of the circuit of {owner} sits at a position of the task's prompts",
            "left_out": left_out,
        }
    # the "circuit" scope: the union of these groups
    circuit = Circuit(
        circuit.model,
        circuit.task,
        {g: circuit.groups[g] for g in groups},
        {g: circuit.positions[g] for g in groups},
        names=dict(circuit.names),
    )
    res = run_cmap(
        study.model(base),
        study.model(finetune),
        circuit,
        records,
        c.parts,
        study.spec.eval.batch_size,
        progress=study.progress,
        isolate=c.isolate,
        n_random=c.n_random,
        seed=study.seed("cmap"),
        rule="paper" if c.scope == "paper" else "base",
        random_prompts=control_prompts(records, c.random_prompts, study.seed("cmap")) if c.n_random else None,
        metric=study.task.metric,
    )
    out = {**res.to_dict(), "left_out": left_out}
    return {**out, "circuit": circuit.to_dict()} if c.scope == "paper" else out


# ---------------------------------------------------------------------------------------------- its cost


def part_tokens(ctx: Context, part: str, position: str) -> float:
    """Tokens a CMAP run of ``part`` computes: a ``z`` patch from the group's position on; K/V patches (written up to
    the position) and the isolation of Q/K/V (`isolation_patches`, every position)
    from the first token."""
    c = ctx.spec.cmap
    whole = part != "z" and (c.isolate or c.scope == "paper" or bool(set(part) & {"k", "v"}))
    return ctx.lengths.tokens if whole else ctx.lengths.after(position)


def cost(ctx: Context, finetune: str) -> StageCost:
    """Per prompt the fine-tune's run (capturing) and the base's; then per scope (each group, the whole circuit)
    and part one patched base run, and ``n_random`` more per group on ``random_prompts`` of the prompts: suffix runs
    from the scope's lowest layer and position (the base's circuit, as ``[cmap] scope = "base"`` patches it)."""
    c, t, b, dims = ctx.spec.cmap, ctx.lengths, ctx.spec.eval.batch_size, ctx.dims
    base = ctx.spec.models.base
    starts = group_starts(ctx, base, circuit_groups(ctx, base, c.groups))
    if starts:  # the whole circuit: from its lowest layer and its earliest position
        whole = min(v[0] for v in starts.values()), max((v[1] for v in starts.values()), key=t.after)
        starts = {**starts, "": whole}
    flops, batches = ctx.fwd(2 * c.n, t.tokens), math.ceil(c.n / b)
    reads = ctx.reads(2 * batches)
    # the random draws on random_prompts of the prompts: where fewer than all, in a pass of their own
    drawn = min(c.random_prompts or c.n, c.n) if c.n_random else c.n
    if drawn < c.n:
        flops, reads = flops + ctx.fwd(2 * drawn, t.tokens), reads + ctx.reads(2 * math.ceil(drawn / b))
    for group, (layer, pos) in starts.items():
        runs, passes = (
            c.n + (c.n_random * drawn if group else 0),
            batches + (c.n_random * math.ceil(drawn / b) if group else 0),
        )
        for part in c.parts:
            flops += ctx.fwd(runs, part_tokens(ctx, part, pos), t.tokens, dims.n_layers - layer)
            reads += ctx.reads(passes, dims.n_layers - layer)
    rows = ctx.rows(c.n)
    captured = 4 * dims.n_layers * rows * t.longest * dims.d_model * dtype_bytes(ctx.dtype)
    return StageCost(
        f"cmap:{finetune}",
        2,
        c.n,
        rows,
        flops,
        2 * ctx.weights,
        0,
        ctx.act(rows, t.longest) + captured,
        reads=reads,
    )
