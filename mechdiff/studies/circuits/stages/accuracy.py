"""The accuracy stage (``accuracy:<model>``): each model's accuracy on the ``eval`` prompts, and the floor a
model's lower bound must exceed for the later stages to explain its behaviour. Its records make the report's
accuracy table (`report.accuracy_section`)."""

from __future__ import annotations

import math
from dataclasses import asdict
from typing import Any

from ....runs.stages import Pending, StageRecord
from ...planner import StageCost
from .counting import Context


def inputs(study: Any, name: str) -> dict:
    """The stage's key inputs: the model, the task, ``[eval]`` (its floor aside) and the split."""
    return {"model": study.digests[name], "task": study.task_inputs(), "eval": eval_inputs(study), "split": "eval"}


def eval_inputs(study: Any) -> dict:
    """``[eval]`` as the accuracy stage's key reads it: the floor decides which stages run, not what it measures."""
    return {k: v for k, v in asdict(study.spec.eval).items() if k != "floor"}


def run(study: Any, name: str) -> StageRecord:
    """Model ``name``'s accuracy on ``[eval] n`` prompts of the ``eval`` set, with its fingerprint and provenance."""
    from ....patching.evaluate import evaluate

    def compute() -> dict:
        lm = study.model(name)
        res = evaluate(
            lm, study.eval_records(), study.spec.eval.batch_size, desc=f"accuracy {name}", progress=study.progress
        )
        return {**res.to_dict(), "fingerprint": lm.fingerprint, "provenance": lm.provenance}

    return study.cache.run(f"accuracy:{name}", inputs(study, name), compute)


def cost(ctx: Context, name: str) -> StageCost:
    """One forward a prompt of ``[eval] n``, in passes of ``[eval] batch_size``."""
    e, t = ctx.spec.eval, ctx.lengths
    return StageCost(
        f"accuracy:{name}",
        1,
        e.n,
        ctx.rows(e.n),
        ctx.fwd(e.n, t.tokens),
        ctx.weights,
        0,
        ctx.act(ctx.rows(e.n), t.longest),
        reads=ctx.reads(math.ceil(e.n / e.batch_size)),
    )


def floor_is(study: Any) -> tuple[float, str]:
    """The floor and how it was set, in words: ``[eval] floor``, else the task's chance level, else chance
    derived from the accuracy prompts (one over their distinct answers, `answer_chance`)."""
    from ....tasks.base import answer_chance

    spec = study.spec
    if spec.eval.floor is not None:
        return spec.eval.floor, "set by the task file's [eval] floor"
    chance = study.task.chance
    if chance:
        return chance(**study.task.kwargs(n_boxes=spec.task.n_boxes)), "the task's chance level"
    drawn = (spec.task.name, spec.eval.n, spec.task.seed)
    if getattr(study, "_chance", (None,))[0] != drawn:  # the accuracy prompts read once
        study._chance = (drawn, answer_chance(study.eval_records()))
    return study._chance[1]


def has_behaviour(study: Any, accuracy: StageRecord) -> bool:
    """Whether a model's accuracy (exact binomial lower bound) is above the floor; in a plan, before the
    accuracy is computed, every model is taken to have it (the plan lists every stage that may run)."""
    try:
        return accuracy.result["accuracy"]["low"] > study.floor()
    except Pending:
        return True


def without_behaviour(study: Any, accuracy: dict[str, StageRecord]) -> dict[str, str]:
    """Model -> why the stages that explain a behaviour are not run for it (its accuracy is not above the
    floor); empty where every model has the behaviour."""
    (floor, how), source = study.floor_is(), "[eval] floor" if study.spec.eval.floor is not None else "the floor"
    out = {}
    for name, rec in accuracy.items():
        if not study.has_behaviour(rec):
            a = rec.result["accuracy"]
            out[name] = (
                f"it answers {a['value']:.3f} [{a['low']:.3f}, {a['high']:.3f}] of the {a['n']} accuracy prompts, "
                f"not above {source} {floor:.3f} ({how}): there is no behaviour to explain, so its "
                "position scan, circuit, pruning, matrix row, DCM and CMAP into it were not run"
            )
    return out
