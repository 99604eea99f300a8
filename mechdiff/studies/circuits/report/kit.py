"""What every section of the circuits report shares: the table writer, the item ids of a prompt set, the
interval's words and the prompt sets' wording."""

from __future__ import annotations

from typing import Any, Optional

import numpy as np

from ....common.inference import Interval
from ....common.metrics import metric_label, scored_metric
from ....report.tables import to_markdown, write_table

#: The circuits study whose records are written (`mechdiff.studies.circuits.study.CircuitsStudy`).
Study = Any


def _fmt(d: dict) -> str:
    return str(Interval.from_dict(d))


def _interval(row: dict, key: str) -> str:
    return f"{row[key]:.2f} [{row[f'{key}_low']:.2f}, {row[f'{key}_high']:.2f}]"


def study_table(study: "Study", rows: list[dict], stem: str, caption: str) -> str:
    """Write a table in four formats under ``tables/`` and return its Markdown for the report."""
    if not rows:
        return f"**{caption}**\n\n_No rows: the stage had nothing to measure (e.g. every group was pruned empty)._\n"
    write_table(rows, study.dir / "tables" / stem, caption=caption)
    return f"**{caption}** (`tables/{stem}.csv`)\n\n{to_markdown(rows)}\n"


def shared_items(study: Any, name: str, n: int) -> Optional[np.ndarray]:
    """The item ids of the first ``n`` rows of the prompt set ``name`` (`set_items`), where some of them share an
    item; None where each is an item of its own, or the study records no items for the set (or fewer rows): the
    stage's own row-level figures then hold."""
    try:
        ids = np.asarray(study.set_items(name))
    except (KeyError, TypeError, ValueError, AttributeError):
        return None
    return ids[:n] if 0 < n <= ids.size and len(set(ids[:n].tolist())) < n else None


def left_out_sentence(result: dict, stage: str) -> str:
    """`` Groups left out of STAGE: `g` (why); ...`` where a stage left groups of the circuit out, else ``""``."""
    left_out = result.get("left_out") or {}
    if not left_out:
        return ""
    return f" Groups left out of {stage}: " + "; ".join(f"`{g}` ({why})" for g, why in left_out.items()) + ".\n"


def _group_label(group: str, position: str) -> str:
    """``position`` where a group is named by its position class (the curve method), else ``group (position)``."""
    return f"`{position}`" if group == position else f"{group} (`{position}`)"


def _pruned_on(study: "Study") -> str:
    """The caption words of the metric pruning decided on (``[scoring] prune_metric``; ``prob``: the task's own)."""
    return metric_label(scored_metric(study.spec.scoring.prune_metric, study.task.metric))


def _held_out(study: "Study") -> bool:
    """Whether the task's prompts draw on the vocabulary held out from fine-tuning (entity tracking)."""
    return "vocabulary" in study.task.options


def _fresh(study: "Study", name: str) -> str:
    """``fresh held-out`` for a generated set; for a set dealt from fixed rows, what its row list shows."""
    sets = getattr(study, "prompt_sets", None)
    if not sets:
        return "fresh held-out prompts"
    k = _shared(sets, name)
    return "prompts no other set holds" if k == 0 else f"prompts ({k} of them also in another set)"


def _disjoint(study: "Study", name: str, generated: str) -> str:
    """``generated`` (a generated task's sets, seeded apart) or, from the drawn rows, whether ``name`` shares any."""
    sets = getattr(study, "prompt_sets", None)
    if not sets:
        return generated
    k = _shared(sets, name)
    return "sharing no row with any other prompt set" if k == 0 else f"sharing {k} rows with other prompt sets"


def _shared(sets: dict, name: str) -> int:
    """Rows of the set ``name`` that another set also holds."""
    others = {r for other, rows in sets.items() if other != name for r in rows}
    return len(set(sets.get(name, [])) & others)
