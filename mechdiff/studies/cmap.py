"""CMAP of one fine-tune into its base, as ``mechdiff cmap`` runs it: the task's prompts, :func:`mechdiff.methods.cmap.run_cmap`
per circuit group, and the table, bar chart and JSON it writes."""

from __future__ import annotations

from pathlib import Path
from typing import Any, Mapping, Optional, Sequence

from ..circuits.circuit import Circuit
from ..methods.cmap import CMAPResult, run_cmap
from ..common.io import write_json
from ..models.loading import LoadedModel
from ..report.bars import grouped_bars
from ..report.tables import estimate_columns, to_markdown, write_table
from ..tasks.base import Task


def cmap_rows(result: CMAPResult) -> list[dict]:
    """The base and fine-tune rows, then one row per (scope, kind)."""
    rows = [{"scope": result.base, "position": "-", "kind": "base (unpatched)",
             **estimate_columns("accuracy", result.base_accuracy),
             **estimate_columns("answer_prob", result.base_answer_prob), "recovered": 0.0},
            {"scope": result.finetune, "position": "-", "kind": "fine-tune",
             **estimate_columns("accuracy", result.finetune_accuracy),
             **estimate_columns("answer_prob", result.finetune_answer_prob), "recovered": 1.0}]
    for r in [*result.rows, *result.random_rows]:
        scope = r.scope.removeprefix("random:")
        row = {"scope": r.scope, "position": result.positions.get(scope, "per group"), "kind": r.kind,
               **estimate_columns("accuracy", r.accuracy), **estimate_columns("answer_prob", r.answer_prob),
               "recovered": r.recovered}
        key = f"{r.scope}/{r.kind}"
        if key in result.outcomes:  # paired against the unpatched base on the same prompts
            row.update(estimate_columns("gain_vs_base", result.paired(key, "base")))
        rows.append(row)
    return rows


def write_outputs(result: CMAPResult, out: Path) -> list[dict]:
    """Tables (md/csv/tex/json), the bar chart and the full JSON."""
    rows = cmap_rows(result)
    caption = f"CMAP {result.finetune} -> {result.base}. {result.caption}"
    write_table(rows, out / "cmap", caption=caption)
    scopes = list(dict.fromkeys(r.scope for r in result.rows))
    kinds = list(dict.fromkeys(r.kind for r in result.rows))
    by = {(r.scope, r.kind): r.accuracy for r in result.rows}
    grouped_bars(out / "cmap.png", scopes, {k: [by.get((s, k)) for s in scopes] for k in kinds},
                 title=f"CMAP: {result.finetune} -> {result.base} (z projected by the base's o_proj; "
                       + ("the paper's rule)" if result.settings.get("rule") == "paper"
                          else "Q/K/V isolated per head)" if result.settings.get("isolate", True)
                          else "K/V patch whole KV groups)"),
                 references={f"base {result.base}": result.base_accuracy,
                             f"fine-tune {result.finetune}": result.finetune_accuracy})
    write_json(out / "cmap.json", result.to_dict())
    return rows


def cmap_run(base: LoadedModel, finetune: LoadedModel, circuit: Circuit, task: Task, n: int, seed: int,
             options: Mapping[str, Any], kinds: Sequence[str], batch_size: int, groups: Optional[Sequence[str]],
             isolate: bool, n_random: int, rule: str, out: Path) -> str:
    """CMAP of ``finetune`` into ``base`` on ``n`` prompts of ``task`` (seed ``seed``, generator ``options``) per
    group of ``circuit`` (see :func:`mechdiff.methods.cmap.run_cmap`); writes ``out/cmap.*``; returns the table and caption."""
    records = task.records(base.tokenizer, n, seed, **options)
    result = run_cmap(base, finetune, circuit, records, kinds, batch_size, groups,
                      isolate=isolate, n_random=n_random, seed=seed, rule=rule)
    rows = write_outputs(result, out)
    return f"{to_markdown(rows)}\n\n{result.caption}"
