"""What the circuits study's stage costs share: the `Context` every count reads (the spec, the base's dims, the
task's token lengths, the dtype, the device, what a run found), a scorer stage's passes (`scored`), the reference
prompts a scorer stage computes its means on, the task plan's steps and the groups and their lowest layers that
DCM, CMAP and completeness look at. Each stage's own count sits beside its computation, in its module."""

from __future__ import annotations

import math
from dataclasses import dataclass, field, replace
from functools import cached_property
from typing import Any, Optional

from ....models.devices import Device
from ....models.footprint import Dims, dtype_bytes
from ...machine import gpu_device
from ...planner import Counting, Lengths, StageCost, task_lengths
from ..spec import RunSpec


@dataclass
class Context(Counting):
    """What every stage's count reads: the spec, the models' dims, the task's lengths, the dtype, the device."""

    spec: RunSpec
    dims: Dims
    lengths: Lengths
    dtype: str
    device: Device
    #: What a run found that a plan cannot know before it (`mechdiff.studies.circuits.stages.plan.found_in`);
    #: empty: assumed.
    known: dict = field(default_factory=dict)

    @cached_property
    def desiderata(self) -> list[str]:
        """The desiderata DCM trains, as the study picks them: those of ``[dcm] desiderata`` the task declares, else
        every one the task declares; read once per context (it reads the task's whole directory, and a plan counts
        DCM a dozen times: each model, each pair-cache mode)."""
        from ....tasks.base import get_task
        from ....tasks.desiderata import chosen_desiderata

        return chosen_desiderata(self.spec.dcm.desiderata, get_task(self.spec.task.name).desiderata)

    def rows(self, n: float) -> int:
        """Prompts a pass holds where a stage runs ``n`` prompts in batches of ``[eval] batch_size``: fewer prompts
        than a batch make a smaller one."""
        return max(1, min(self.spec.eval.batch_size, math.ceil(n)))

    def resumed_runs(self, prompts: int) -> int:
        """F(C)'s run that pruning resumes from (`keep_without`), kept for
        every prompt: the residual stream after every block and every layer's keys and values (grows with
        ``prompts``)."""
        per_token = self.dims.n_layers * (self.dims.d_model + self.dims.kv_width())
        return prompts * self.lengths.longest * per_token * dtype_bytes(self.dtype)

    def ablation_patches(self, rows: int) -> int:
        """Mean-ablation writes of one batch: every layer's ``z`` at every position."""
        return self.dims.n_layers * rows * self.lengths.longest * self.dims.d_model * dtype_bytes(self.dtype)


def scored(ctx: Context, stage: str, n: int, runs: float, note: str = "") -> StageCost:
    """A scorer stage on ``n`` prompts: reference means (`reference_runs`), the full model and ``runs``
    mean-ablated runs a prompt."""
    b, t = ctx.spec.eval.batch_size, ctx.lengths
    reference = reference_runs(ctx, stage)
    flops = ctx.fwd(reference + n * (1 + runs), t.tokens)
    rows = ctx.rows(max(n, reference))
    transient = ctx.act(rows, t.longest) + ctx.ablation_patches(rows)
    passes = math.ceil(reference / b) + math.ceil(n / b) * (1 + runs)
    return StageCost(stage, 1, n, rows, flops, ctx.weights, 0, transient, note=note, reads=ctx.reads(passes))


def reference_runs(ctx: Context, stage: str) -> int:
    """Reference prompts whose means a scorer stage computes: the activation store (``[output] store``) keeps a
    model's means of one reference set, so the model's first scorer stage that ablates with the study's set computes
    them (the position scan, curve discovery, pruning, the matrix row: the first that runs) and the later ones read
    them; pruning with a seed of its own (``[scoring.models.NAME] seed``) draws a set of its own, and so does the
    reproduction (its ``n`` prompts); a matrix cell alone (``"matrix-cell"``, benchmarks/gpu.py) meets a cold store."""
    s, (kind, _, name) = ctx.spec, stage.partition(":")  # a stage of no model ("matrix-cell"): name ""
    if kind == "reproduction":
        return s.reproduce.n
    own_seed = s.scoring.models.get(name, {}).get("seed") is not None
    if kind == "matrix-cell" or (kind == "prune" and own_seed):
        return s.scoring.reference_n
    runs = {
        "positions": s.positions.n >= 1,
        "circuit": s.discovery.method == "curve",
        "prune": s.scoring.prune and not own_seed,
        "matrix": True,
    }
    first = next(k for k, on in runs.items() if on)
    return s.scoring.reference_n if kind == first else 0


def plan_steps(ctx: Context) -> list[Any]:
    """The steps of the task's path-patching plan (`task_plan`)."""
    from ....tasks.base import get_task
    from ....tasks.plan import task_plan

    return list(task_plan(get_task(ctx.spec.task.name)).steps)


def circuit_groups(ctx: Context, name: str, wanted: list[str]) -> list[str]:
    """The groups of ``name``'s circuit a stage looks at, as the study picks them
    (`group_choice`): ``wanted`` where they name groups of the circuit the run
    found (those with heads), else its every non-empty group; before a run, ``wanted``, else a path plan's steps
    or the task's named positions (a curve circuit's groups are position classes)."""
    found = ctx.known.get("circuit", {}).get(name)
    if found is not None:
        present = [g for g in wanted if found["groups"].get(g)]
        return present if set(wanted) & set(found["groups"]) else [g for g, hs in found["groups"].items() if hs]
    if wanted:
        return list(wanted)
    if ctx.spec.discovery.method == "path":
        return [step.name for step in plan_steps(ctx)]
    return list(ctx.lengths.suffix)


def group_starts(ctx: Context, name: str, groups: list[str]) -> dict[str, tuple[float, str]]:
    """Each of ``groups``' lowest layer and position in ``name``'s circuit: the run's where known, else assumed
    (a path circuit's group at the middle layer; a curve circuit's, spread over every layer, from the first)."""
    from ....common.components import parse_heads

    found = ctx.known.get("circuit", {}).get(name)
    if found is not None:
        heads = {g: parse_heads(found["groups"].get(g, [])) for g in groups}
        return {g: (min(h.layer for h in hs), found["positions"][g]) for g, hs in heads.items() if hs}
    path = ctx.spec.discovery.method == "path"
    senders = {step.name: step.sender for step in plan_steps(ctx)} if path else {}
    return {g: (ctx.dims.n_layers / 2 if path else 0, senders.get(g, g)) for g in groups}


def run_device(spec: RunSpec, dims: Dims, lengths: Optional[Lengths] = None) -> Optional[Device]:
    """The machine a run of ``spec`` computes on, as a plan's device: this CPU measured (throughput, weight and
    scratch-file bandwidth), or the first CUDA GPU as the named device of its kind (`gpu_device`) with this
    machine's host memory and disk; None on NDIF."""
    from ....models.devices import available_memory, scratch_disk, this_machine
    from ...machine import scratch_bandwidth  # at call time: measured once a test process (tests/conftest.py)

    m = spec.models
    if m.remote:
        return None
    if m.device_map or m.device not in (None, "cpu"):
        return gpu_device().with_disk(scratch_disk()).with_host(available_memory()).with_baseline()
    rows = min(2048, spec.eval.batch_size * (lengths or task_lengths(spec)).longest)
    return replace(this_machine(dims, (m.dtype,), rows), disk_read=scratch_bandwidth())
