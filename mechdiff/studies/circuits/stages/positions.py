"""The position scan (``positions:<model>``): which position classes must keep every head, added greedily one
class a step. Its records make the report's position-scan section (`report.positions_section`)."""

from __future__ import annotations

from dataclasses import asdict
from typing import Any, Optional

from ....runs.stages import StageRecord, label
from ...planner import StageCost
from .counting import Context, scored


def inputs(study: Any, name: str) -> dict:
    """The stage's key inputs: the model, the task, ``[positions]``, the scorer's reference and the metric."""
    return {
        "model": study.digests[name],
        "task": study.task_inputs(),
        "positions": asdict(study.spec.positions),
        "scoring": study.reference_inputs(),
        **study.metric_inputs(),
    }


def run(study: Any, name: str) -> Optional[StageRecord]:
    """The position scan of ``name`` (None: ``[positions] n = 0``), and its figure."""
    from ....circuits.positions import position_scan, task_classes
    from ....report.positions import position_scan_figure

    p = study.spec.positions
    if p.n < 1:
        return None

    def compute() -> dict:
        scorer = study.scorer(name, "positions", p.n)
        scan = position_scan(scorer, task_classes(scorer), stop_at=p.stop_at, max_steps=p.max_steps)
        path = study.dir / "figures" / f"positions_{label(name)}.png"
        position_scan_figure(scan, path, title=f"{name}: every head kept at the classes chosen so far")
        return {"scan": scan, "figure": str(path.relative_to(study.dir))}

    return study.cache.run(f"positions:{name}", inputs(study, name), compute)


def cost(ctx: Context, name: str) -> Optional[StageCost]:
    """The greedy scan: at each step one run a prompt per remaining class; ``max_steps`` steps, or as many as the
    run took where known (``stop_at`` ends it sooner)."""
    p, c = ctx.spec.positions, ctx.lengths.classes
    if p.n < 1:
        return None
    steps = min(ctx.known.get("scan_steps", {}).get(name) or p.max_steps or c, c)
    note = "" if name in ctx.known.get("scan_steps", {}) else "every step tried (stop_at may end it sooner)"
    return scored(ctx, f"positions:{name}", p.n, sum(c - i for i in range(steps)), note)
