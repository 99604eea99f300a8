"""Task accuracy of models, as ``mechdiff eval`` runs it: each model's prompts,
`mechdiff.patching.evaluate.evaluate`, the printed table and the JSON results."""

from __future__ import annotations

from pathlib import Path
from typing import Any, Iterable, Mapping, Optional

from tabulate import tabulate

from ...common.io import write_json
from ...models.loading import LoadedModel
from ...models.memory import auto_batch_size
from ...patching.evaluate import evaluate
from ...tasks.base import Task


def eval_models(
    models: Iterable[LoadedModel],
    task: Task,
    n: int,
    seed: int,
    options: Mapping[str, Any],
    split: str,
    batch_size: int | str,
    out: Optional[Path] = None,
) -> str:
    """Accuracy, answer probability (and logit difference, where the task has one) of each model on ``n`` prompts
    of ``task`` (seed ``seed``, generator ``options``, the objects of ``split`` where the task splits them);
    ``batch_size`` ``auto``: chosen from the first model's free memory. Writes the results as JSON to ``out``
    (if given); returns the table."""
    split_options = task.split_options(split)
    rows, results, lengths = [], {}, []
    for lm in models:
        if batch_size == "auto":
            batch_size = auto_batch_size(lm)
        records = task.records(lm.tokenizer, n, seed, **options, **split_options)
        res = evaluate(lm, records, batch_size=batch_size, desc=f"eval {lm.name}")
        results[lm.name] = {
            **res.to_dict(),
            "task": task.name,
            "fingerprint": lm.fingerprint,
            **task.kwargs(**options),
            "n": len(records),
            "seed": seed,
            **({"split": split} if split_options else {}),
            "correct": res.correct.astype(int).tolist(),
        }
        by_length = res.by_answer_length(records, task.metric)
        if by_length:  # answers of several lengths: accuracy (and the metric) of each
            results[lm.name]["by_answer_length"] = [{k: _json(v) for k, v in r.items()} for r in by_length]
            lengths += [[lm.name, *("" if v is None else str(v) for v in r.values())] for r in by_length]
        diff = [str(res.mean_logit_diff)] if res.logit_diff is not None else []
        rows.append([lm.name, str(res.accuracy), str(res.answer_prob), *diff, lm.fingerprint])
    diff_header = ["logit diff [95% CI]"] if any(len(r) == 5 for r in rows) else []
    table = tabulate(rows, headers=["model", "accuracy [95% CI]", "answer prob [95% CI]", *diff_header, "fingerprint"])
    if lengths:
        column = "logit diff [95% CI]" if task.metric == "logit_diff" else "answer prob [95% CI]"
        heads = ["model", "answer tokens", "prompts", "accuracy [95% CI]", column]
        if any(len(r) > len(heads) for r in lengths):  # accuracy split by first token against the rest
            heads += ["first token [95% CI]", "rest given the first [95% CI]"]
        table += "\n\nby answer length (the answer's own tokens):\n" + tabulate(lengths, headers=heads)
    if out is not None:
        write_json(out, results)
    return table


def _json(value: Any) -> Any:
    """An estimate as its dict, anything else as it is."""
    return value.to_dict() if hasattr(value, "to_dict") else value
