"""The reproduction (``reproduction:<model>``, with ``[reproduce] circuit``): the released circuit scored on each
model, beside the published figures. Its records make ``reproduction.md``
(`mechdiff.studies.circuits.reproduce.write_reproduction`)."""

from __future__ import annotations

from dataclasses import asdict
from pathlib import Path
from typing import Any

from ....runs.stages import StageRecord
from ...planner import StageCost
from .counting import Context, scored


def inputs(study: Any, name: str, circuit_text: str, published: dict) -> dict:
    """The stage's key inputs: the model, the task, ``[reproduce]``, the released circuit's text and the
    published figures."""
    return {
        "model": study.digests[name],
        "task": study.task_inputs(),
        "reproduce": asdict(study.spec.reproduce),
        "circuit": circuit_text,
        "published": published.get("reported", {}),
    }


def run(study: Any) -> list[StageRecord]:
    """The reproduction as cached study stages, one per model (``reproduction:<model>``, so a stage's time
    is one model's load and scoring)."""
    from ..reproduce import published_figures, reproduction_rows

    r = study.spec.reproduce
    published = published_figures(r.published)
    circuit_text = Path(r.circuit).read_text()
    records = []
    for name in study.spec.model_names:

        def compute(name: str = name) -> dict:
            row = reproduction_rows(study, r.circuit, published, r.n, [name])[0]
            _release(study, name)
            return {"row": row}

        records.append(study.cache.run(f"reproduction:{name}", inputs(study, name, circuit_text, published), compute))
    return records


def _release(study: Any, name: str) -> None:
    """Drop a scored model so the next one fits (four 7B models in float32 do not fit one 80 GB GPU)."""
    import torch

    lm = study.models.release(name)
    if lm is not None and lm.device.type == "cuda":
        del lm
        torch.cuda.empty_cache()


def cost(ctx: Context, name: str) -> StageCost:
    """The released circuit scored on ``[reproduce] n`` prompts: their own reference means, the full model and
    one mean-ablated run a prompt."""
    return scored(ctx, f"reproduction:{name}", ctx.spec.reproduce.n, 1)
