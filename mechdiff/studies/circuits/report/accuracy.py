"""The circuits report's accuracy section: each model's accuracy (over items where rows share one) and by answer
length."""

from __future__ import annotations

from typing import Optional

import numpy as np

from ....common.inference import Interval
from ....report.tables import estimate_columns
from ....runs.stages import StageRecord
from .kit import Study, _held_out, shared_items, study_table


def _accuracy_over_items(result: dict, items: Optional[np.ndarray]) -> dict:
    """The accuracy stage's figures, their intervals over ``items`` where rows share items (`inf.proportion`,
    `inf.mean`: the cluster bootstrap over items, a proportion hulled with the exact interval of as many items);
    else the stage's own (exact over rows, one row an item)."""
    from ....common import inference as inf
    from ....common.outcomes import read_record

    outcomes = result.get("outcomes")
    if items is None or outcomes is None or len(outcomes["correct"]) != items.size:
        return {k: result[k] for k in ("accuracy", "answer_prob", "logit_diff") if k in result}
    correct, prob = read_record(outcomes)
    out = {"accuracy": inf.proportion(correct, items).to_dict(detail=True)}
    if prob is not None:
        out["answer_prob"] = inf.mean(prob, items).to_dict(detail=True)
    if "logit_diff" in result and outcomes.get("logit_diff") is not None:
        out["logit_diff"] = inf.mean(np.asarray(outcomes["logit_diff"], dtype=float), items).to_dict(detail=True)
    return {**{k: result[k] for k in ("answer_prob", "logit_diff") if k in result}, **out}


def accuracy_section(study: "Study", accuracy: dict[str, "StageRecord"]) -> tuple[str, list[dict]]:
    rows, clustered = [], False
    for name, rec in accuracy.items():
        r = rec.result
        items = shared_items(study, "eval", len((r.get("outcomes") or {}).get("correct", "")))
        figures = _accuracy_over_items(r, items)
        clustered = clustered or items is not None
        rows.append(
            {
                "model": name,
                **estimate_columns("accuracy", figures["accuracy"]),
                **estimate_columns("answer_prob", figures["answer_prob"]),
                **(estimate_columns("logit_diff", figures["logit_diff"]) if "logit_diff" in figures else {}),
                **({"items": figures["accuracy"].get("items")} if items is not None else {}),
                "fingerprint": r["fingerprint"],
            }
        )
    n = study.spec.eval.n
    what = (
        f"{n} held-out {study.spec.task.n_boxes}-box prompts (objects disjoint from fine-tuning objects; "
        if _held_out(study)
        else f"{n} held-out {study.task.name} prompts ("
    )
    text = study_table(
        study,
        rows,
        "accuracy",
        f"Accuracy on {what}"
        + (
            "intervals over items, since rows of one item share a clean prompt: for accuracy the cluster bootstrap "
            "over items hulled with the exact interval of as many items; the cluster bootstrap over items for "
            "probability"
            if clustered
            else "exact binomial CI for accuracy, bootstrap for probability"
        )
        + (" and the logit difference, answer minus the mean alternative)" if "logit_diff" in rows[0] else ")"),
    )
    floor, how = study.floor_is()
    text += (
        f"\nThe floor: {floor:.3g} ({how}). A model whose accuracy's lower bound is not above it has no behaviour "
        "to explain and gets no circuit.\n"
    )
    return text + _by_answer_length(study, accuracy), rows


def _by_answer_length(study: "Study", accuracy: dict[str, "StageRecord"]) -> str:
    """Each model's accuracy (and the task's metric) per answer length on the accuracy prompts, from the stage's
    per-prompt outcomes; empty where every answer has one length."""
    from ....common.metrics import CONTINUOUS_LABELS
    from ....common.outcomes import read_first_and_rest, read_record
    from ....patching.evaluate import EvalResult

    if study.task.answer_tokens < 2 or not all("outcomes" in rec.result for rec in accuracy.values()):
        return ""
    records, rows = study.eval_records(), []
    for name, rec in accuracy.items():
        correct, prob = read_record(rec.result["outcomes"])
        diff = rec.result["outcomes"].get("logit_diff")
        first, rest = read_first_and_rest(rec.result["outcomes"])
        res = EvalResult(
            correct.astype(bool),
            prob,
            None if diff is None else np.asarray(diff, dtype=float),
            None if first is None else first.astype(bool),
            None if rest is None else rest.astype(bool),
        )
        for row in res.by_answer_length(
            records, study.task.metric, np.asarray(study.set_items("eval"))[: len(records)]
        ):
            cells = [estimate_columns(k, v) if isinstance(v, Interval) else {k: v} for k, v in row.items()]
            rows.append({"model": name, **{k: v for cell in cells for k, v in cell.items()}})
    if not rows:
        return ""
    metric = "logit_diff" if "logit_diff" in rows[0] else "answer_prob"
    named = CONTINUOUS_LABELS["logit_diff" if metric == "logit_diff" else "prob"]
    return "\n" + study_table(
        study,
        rows,
        "accuracy_by_answer_length",
        f"Accuracy and {named} by the answer's length in tokens on the same prompts (exact binomial CI; bootstrap "
        "for the metric). An answer of several tokens is scored by teacher forcing: accuracy is greedy decoding "
        "giving the whole answer, split (where the stage kept it) into `first_token` (the first answer token the "
        "top-1 after the prompt) and `rest` (every later token the top-1 given the answer's tokens before it); the "
        "circuits cover the prompt's positions only (no head at an answer token's own position is ablated or "
        "patched)",
    )
