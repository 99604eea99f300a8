"""The circuits study's resource plan, asked of its stages: every stage's cost in the order a run meets them
(`stage_costs`, each counted in its stage's module beside its computation), the plan's inputs from a task file
(`circuits_inputs`), what a finished run found that a plan otherwise assumes (`found_in`, `with_released`), and
what ``run.json`` records of the plan (`run_record`). The generic planner (`mechdiff.studies.planner`) places
them on a device and prints them."""

from __future__ import annotations

import json
from dataclasses import replace
from pathlib import Path
from statistics import mean
from typing import Optional

from ....models.devices import Device
from ....models.footprint import model_dims
from ...planner import Lengths, Placement, PlanInputs, StageCost, placements, task_lengths
from ..spec import RunSpec
from . import accuracy, circuit, cmap, dcm, matrix, positions, prune, reproduction
from .counting import Context


def stage_costs(ctx: Context) -> list[StageCost]:
    """Every stage of the study, in the order a run meets them; those the file does not run (``[reproduce] only``)
    marked so."""
    spec, names = ctx.spec, ctx.spec.model_names
    out: list[StageCost] = []
    if spec.reproduce.circuit:
        out += [reproduction.cost(ctx, n) for n in names]
    rest: list[Optional[StageCost]] = [accuracy.cost(ctx, n) for n in names]
    rest += [positions.cost(ctx, n) for n in names] + [circuit.cost(ctx, n) for n in names]
    rest += [prune.cost(ctx, n) for n in names]
    rest += [matrix.cost(ctx, n) for n in names] + [dcm.cost(ctx, spec.models.base, len(names))]
    rest += [cmap.cost(ctx, ft) for ft in spec.models.finetunes]
    if spec.cmap.scope == "paper":
        rest += [dcm.cost(ctx, ft, 0) for ft in spec.models.finetunes]
    skip = bool(spec.reproduce.circuit and spec.reproduce.only)
    return out + [replace(c, runs=not skip) for c in rest if c is not None]


def circuits_inputs(
    spec: RunSpec, lengths: Optional[Lengths] = None, dtype: Optional[str] = None, known: Optional[dict] = None
) -> PlanInputs:
    """A circuits study's `PlanInputs`: the base's dims, the task's lengths (`task_lengths`), ``dtype`` (default
    the spec's), ``known`` (what a run found, `found_in`)."""
    dims, source = model_dims(spec.models.base)
    lengths = lengths or task_lengths(spec)
    rows = min(2048, spec.eval.batch_size * lengths.longest)  # a batch's tokens: the stages' matrix multiplies
    names = tuple(spec.model_names)
    return PlanInputs(
        "circuits", spec, dims, source, lengths, dtype or spec.models.dtype, names, len(names), rows,
        spec.models.remote, known or {},
    )  # fmt: skip


def circuits_costs(inputs: PlanInputs, device: Device) -> list[StageCost]:
    """Every stage of a circuits study (`stage_costs`) on ``device``."""
    spec = inputs.settings
    ctx = Context(spec, inputs.dims, inputs.lengths, inputs.dtype, device, with_released(spec, inputs.known))
    return stage_costs(ctx)


def resource_plan(
    spec: RunSpec,
    device: Device,
    lengths: Optional[Lengths] = None,
    dtype: Optional[str] = None,
    known: Optional[dict] = None,
) -> list[Placement]:
    """Every stage of the circuits study ``spec`` placed on ``device`` in ``dtype`` (default the spec's);
    ``known``: what a run found that the plan otherwise assumes (`Context`)."""
    return placements(circuits_inputs(spec, lengths, dtype, known), device)


def with_batch(spec: RunSpec, cost: StageCost, batch: int) -> RunSpec:
    """``spec`` with ``cost``'s batch option at ``batch`` (the plan's remedies)."""
    if cost.batch_option == "[dcm] batch_size":
        return replace(spec, dcm=replace(spec.dcm, batch_size=batch))
    if cost.batch_option == "[eval] batch_size":
        return replace(spec, eval=replace(spec.eval, batch_size=batch))
    return spec  # senders a pass: sized from the memory left, not an option


def with_released(spec: RunSpec, known: dict) -> dict:
    """``known`` with the ``[reproduce] circuit`` (a released circuit of the base, e.g. the paper's pruned LLaMA-7B
    circuit) as the base's pruned circuit where the run has not found one: its groups' heads and lowest layers stand
    in for the middle layer the plan otherwise assumes (DCM and CMAP run from a group's lowest layer). Recorded under
    ``"released"``, so the notes say so."""
    base, path = spec.models.base, Path(spec.reproduce.circuit) if spec.reproduce.circuit else None
    pruned = f"{base} pruned"
    if path is None or not path.is_file() or pruned in known.get("circuit", {}):
        return known
    released = json.loads(path.read_text())
    if released.get("model") != base:
        return known
    return {**known, "circuit": {**known.get("circuit", {}), pruned: released}, "released": {pruned: str(path)}}


def found_in(run_dir: str | Path) -> dict:
    """What a plan assumes and a finished run's stage records know (``known`` of `resource_plan`): each
    circuit (``"NAME"``) and pruned circuit (``"NAME pruned"``), the position scan's steps, the share of pairs
    greedy pruning searched, the share of DCM's masks that selected a head, the mode of DCM's pair cache."""
    out: dict = {"circuit": {}, "scan_steps": {}, "searched": {}, "dcm_selected": {}, "dcm_cache": {}}
    for path in sorted((Path(run_dir) / "stages").glob("*.json")):
        rec = json.loads(path.read_text())
        kind, _, model = rec["name"].partition(":")
        result = rec["result"]
        if kind == "circuit":
            out["circuit"][model] = result["circuit"]
        elif kind == "positions":
            out["scan_steps"][model] = len(result["scan"]["steps"])
        elif kind == "prune":
            out["circuit"][f"{model} pruned"] = result["circuit"]
            pairs = result["minimality"]["pairs"].values()
            if result["minimality"].get("rule") == "greedy":
                out["searched"][model] = sum(p["searched"] for p in pairs) / max(len(pairs), 1)
        elif kind == "dcm" and result.get("dcm"):
            out["dcm_selected"][model or result["model"]] = mean(bool(r["selected"]) for r in result["dcm"])
            if result.get("cache"):  # the pair-cache mode the run used (absent from runs before the modes)
                out["dcm_cache"][model or result["model"]] = result["cache"]
    return out


def run_record(spec: RunSpec, lengths: Optional[Lengths] = None) -> Optional[dict]:
    """What ``run.json`` records of the plan, so the report's stage table reads it from committed files: this
    machine's matrix-multiply throughput and weight bandwidth measured now (FLOP and bytes per CPU second in the
    run's dtype, as ``--plan`` measures them) and each stage's planned FLOPs. None for a run on a GPU or NDIF (the
    CPU's throughput is not theirs)."""
    from ....models.devices import this_machine

    m = spec.models
    if m.remote or m.device_map or m.device not in (None, "cpu"):
        return None
    dims, _ = model_dims(m.base)
    lengths = lengths or task_lengths(spec)
    rows = min(2048, spec.eval.batch_size * lengths.longest)
    device = this_machine(dims, (m.dtype,), rows)  # no pass_overhead: it runs a model, and a cached run runs none
    plan = resource_plan(spec, device, lengths, m.dtype)
    return {
        "dtype": m.dtype,
        "throughput": device.throughput(m.dtype),
        "bandwidth": device.bandwidth[m.dtype],
        "stage_flops": {p.cost.stage: p.cost.flops for p in plan},
    }
