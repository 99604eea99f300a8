"""Where the computation lives: a greedy scan over a task's position classes.

Each step keeps every head at the classes chosen so far (mean-ablating every head at every other
position) and adds the class that raises the metric most. The curve says how much of the model's
behaviour a circuit that names only those positions can explain: the ceiling of any circuit
drawn over them. Task-agnostic: the classes are whatever the batches carry (``positions`` or
``position_classes``).
"""

from __future__ import annotations

from typing import Optional, Sequence

import numpy as np

from ..common.components import Head, all_heads
from ..common.inference import proportion
from ..common.progress import progress_bar
from ..common.stats import bootstrap_ratio
from .scoring import Metric, Pair, Scorer, faithfulness_key, per_prompt


def task_classes(scorer: Scorer) -> list[str]:
    """The position classes the scorer's prompts carry: the task's ``position_classes`` masks (which
    partition each prompt) where it defines them, else its named positions."""
    _, batch = next(iter(scorer.batches()))
    return list(batch.get("position_classes") or batch["positions"])


def every_head_at(n_layers: int, n_heads: int, classes: Sequence[str]) -> list[Pair]:
    """Every head of the model at each of ``classes``."""
    heads: list[Head] = all_heads(n_layers, n_heads)
    return [(h, c) for c in classes for h in heads]


def position_scan(
    scorer: Scorer,
    classes: Sequence[str],
    metric: Metric = "accuracy",
    stop_at: Optional[float] = None,
    max_steps: Optional[int] = None,
) -> dict:
    """Greedy forward selection over ``classes`` (see the module docstring).

    ``stop_at``: stop once the faithfulness F(kept)/F(M) of ``metric`` reaches it; ``max_steps``: at
    most this many classes. Each step records every candidate's value, and the chosen set's accuracy
    (exact binomial CI) and faithfulness for accuracy and the scorer's continuous metric (bootstrap CIs of the
    ratio).
    """
    if not classes:
        raise ValueError("give at least one position class to scan")
    shape = scorer.model.shape
    full, m = scorer.full(), scorer.metric
    f_full = per_prompt(full, metric)
    chosen: list[str] = []
    steps: list[dict] = []
    remaining = list(classes)
    bar = progress_bar(total=max_steps or len(remaining), desc="position scan", disable=not scorer.progress)
    while remaining and (max_steps is None or len(chosen) < max_steps):
        values = {
            c: float(per_prompt(scorer.keep(every_head_at(shape.n_layers, shape.n_heads, chosen + [c])), metric).mean())
            for c in remaining
        }
        best = max(remaining, key=lambda c: (values[c], -remaining.index(c)))
        chosen.append(best)
        remaining.remove(best)
        kept = scorer.keep(every_head_at(shape.n_layers, shape.n_heads, chosen))
        steps.append(
            {
                "added": best,
                "classes": list(chosen),
                "candidates": values,
                "accuracy": proportion(per_prompt(kept, "accuracy")).to_dict(),
                "faithfulness": bootstrap_ratio(per_prompt(kept, "accuracy"), per_prompt(full, "accuracy")).to_dict(),
                faithfulness_key(m): bootstrap_ratio(per_prompt(kept, m), per_prompt(full, m)).to_dict(),
            }
        )
        bar.update(1)
        if stop_at is not None and f_full.mean() and values[best] / f_full.mean() >= stop_at:
            break
    bar.close()
    return {
        "metric": metric,
        "classes": list(classes),
        "n_prompts": len(scorer.records),
        "full_accuracy": proportion(per_prompt(full, "accuracy")).to_dict(),
        "stop_at": stop_at,
        "steps": steps,
    }


def leave_one_out(scorer: Scorer, classes: Sequence[str], metric: Metric = "accuracy") -> dict:
    """Faithfulness with every head kept at every class but one, for each class (what each class adds
    that the others cannot replace); ``classes`` should cover every position."""
    shape = scorer.model.shape
    full = scorer.full()
    out = {}
    for c in progress_bar(classes, desc="leave one class out", disable=not scorer.progress):
        kept = scorer.keep(every_head_at(shape.n_layers, shape.n_heads, [x for x in classes if x != c]))
        out[c] = {
            "accuracy": proportion(per_prompt(kept, "accuracy")).to_dict(),
            "faithfulness": bootstrap_ratio(per_prompt(kept, metric), per_prompt(full, metric)).to_dict(),
        }
    return {
        "metric": metric,
        "n_prompts": len(scorer.records),
        "classes": out,
        "full_accuracy": float(np.mean(per_prompt(full, "accuracy"))),
    }
