"""What every stage unit of the trajectory study shares: `Stage` (a record of the one stage cache, keyed by its
inputs) and `PlanCounts` (the resource plan's counts of a stage: passes of ``[eval] batch_size`` prompts; each
checkpoint's reference means are computed by its first scorer, its circuit stage or an other run's ranking, and
read from the activation store by the later ones)."""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

from ....runs.stages import StageRecord
from ..settings import TrajectorySettings, other_runs


class Stage:
    """One stage: `inputs` (its key), `compute` (its record's result) and, as a static method ``costs``, its
    count for the plan. ``kind`` names the record, ``<kind>:<checkpoint>`` where the first argument is one."""

    kind = ""
    per_checkpoint = True

    def __init__(self, study: Any):
        self.s = study

    def name(self, *args: Any) -> str:
        return f"{self.kind}:{args[0]}" if self.per_checkpoint else self.kind

    def inputs(self, *args: Any) -> dict:
        raise NotImplementedError

    def compute(self, *args: Any) -> dict:
        raise NotImplementedError

    def run(self, *args: Any) -> StageRecord:
        """The stage's record: read from the cache where its key is there, else computed and written."""
        return self.s.cache.run(self.name(*args), self.inputs(*args), lambda: self.compute(*args))


@dataclass
class PlanCounts:
    """What the plan of a trajectory counts with: the settings, the checkpoints ``names`` and the other runs'
    ``others``, ``labels`` (the DCM table of ``[dcm] labels``; empty: DCM trained here) and ``circuits`` (each
    checkpoint's circuit where a run found it, `trajectory_found`; else each checkpoint's own is assumed
    distinct)."""

    meter: Any
    st: TrajectorySettings
    names: list[str]
    others: list[str]
    labels: list
    circuits: dict[str, Any] = field(default_factory=dict)

    def batches(self, n: int) -> int:
        return math.ceil(n / self.st.eval.batch_size)

    def ranking_n(self, name: str) -> int:
        """``[discovery] runs_n`` for the other runs' checkpoints and this run's at their steps, ``n`` elsewhere."""
        d = self.st.discovery
        runs = {*self.others, *other_runs(self.st.runs, self.names)}
        return d.runs_n if name in runs else d.n

    def reference(self) -> tuple[int, int, int]:
        """The reference means' passes (computed by a checkpoint's first scorer)."""
        n = self.st.scoring.reference_n
        return n, self.batches(n), 1

    def cost(self, stage: str, n: int, passes: list, note: str = "", models: int = 1) -> Any:
        """A stage of ``n`` prompts whose passes are ``passes``: (rows of one sweep, passes, FLOP factor: 2 for a
        forward and a backward to the activations), each pass a batch of a sweep (a sweep of ``rows`` runs in
        ``batches(rows)`` passes, so ``passes`` of them are ``passes / batches(rows)`` sweeps); its largest batch's
        activations and mean-ablation writes."""
        from ....models.footprint import backward_bytes, dtype_bytes
        from ...planner import StageCost

        meter, st = self.meter, self.st
        t, d = meter.lengths, meter.dims
        rows = meter.rows(n, st.eval.batch_size)
        flops = sum(
            factor * meter.fwd(run_rows, t.tokens) * count / max(self.batches(run_rows), 1)
            for run_rows, count, factor in passes
        )
        count = sum(p for _, p, _ in passes)
        backward = any(f > 1 for _, _, f in passes)
        act = (
            backward_bytes(d, rows, t.longest, d.n_layers, meter.dtype) if backward else meter.act(rows, t.longest)
        ) + d.n_layers * rows * t.longest * d.d_model * dtype_bytes(meter.dtype)
        return StageCost(
            stage, models, n, rows, flops, models * meter.weights, 0, act, note=note,
            batch_option="[eval] batch_size", reads=meter.reads(count),
        )  # fmt: skip
