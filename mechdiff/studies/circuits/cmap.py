"""CMAP of one fine-tune into its base, as ``mechdiff cmap`` runs it: the task's prompts,
`mechdiff.methods.cmap.run_cmap` per circuit group, and the tables, bar chart and JSON it writes."""

from __future__ import annotations

from pathlib import Path
from typing import Any, Mapping, Optional, Sequence

from ...circuits.circuit import Circuit
from ...common.io import write_json
from ...methods.cmap import CMAPResult, run_cmap
from ...models.loading import LoadedModel
from ...report.bars import grouped_bars
from ...report.rows import cmap_caption, cmap_paired_caption, cmap_paired_rows, cmap_rows
from ...report.tables import to_markdown, write_table
from ...tasks.base import Task


def write_outputs(result: CMAPResult, out: Path) -> str:
    """The tables (md/csv/tex/json) ``cmap`` and, where any part was paired, ``cmap_paired``, as the circuits
    study writes them; the bar chart and the full JSON. Returns the tables in markdown with their captions."""
    record = result.to_dict()
    rows, caption = cmap_rows(record), cmap_caption(record, result.finetune)
    write_table(rows, out / "cmap", caption=caption)
    text = f"{to_markdown(rows)}\n\n{caption}"
    paired = cmap_paired_rows(record)
    if paired:
        paired_caption = cmap_paired_caption(record, result.finetune)
        write_table(paired, out / "cmap_paired", caption=paired_caption)
        text += f"\n\n{to_markdown(paired)}\n\n{paired_caption}"
    scopes = list(dict.fromkeys(r.scope for r in result.rows))
    kinds = list(dict.fromkeys(r.kind for r in result.rows))
    by = {(r.scope, r.kind): r.accuracy for r in result.rows}
    grouped_bars(
        out / "cmap.png",
        scopes,
        {k: [by.get((s, k)) for s in scopes] for k in kinds},
        title=f"CMAP: {result.finetune} -> {result.base} (z projected by the base's o_proj; "
        + (
            "the paper's rule)"
            if result.settings.get("rule") == "paper"
            else "Q/K/V isolated per head)"
            if result.settings.get("isolate", True)
            else "K/V patch whole KV groups)"
        ),
        references={
            f"base {result.base}": result.base_accuracy,
            f"fine-tune {result.finetune}": result.finetune_accuracy,
        },
    )
    write_json(out / "cmap.json", record)
    return text


def cmap_run(
    base: LoadedModel,
    finetune: LoadedModel,
    circuit: Circuit,
    task: Task,
    n: int,
    seed: int,
    options: Mapping[str, Any],
    kinds: Sequence[str],
    batch_size: int,
    groups: Optional[Sequence[str]],
    isolate: bool,
    n_random: int,
    rule: str,
    out: Path,
) -> str:
    """CMAP of ``finetune`` into ``base`` on ``n`` prompts of ``task`` (seed ``seed``, generator ``options``) per
    group of ``circuit`` (see `mechdiff.methods.cmap.run_cmap`); writes ``out/cmap.*`` (and
    ``out/cmap_paired.*``); returns the tables and captions."""
    records = task.records(base.tokenizer, n, seed, **options)
    result = run_cmap(
        base,
        finetune,
        circuit,
        records,
        kinds,
        batch_size,
        groups,
        isolate=isolate,
        n_random=n_random,
        seed=seed,
        rule=rule,
        metric=task.metric,
    )
    return write_outputs(result, out)
