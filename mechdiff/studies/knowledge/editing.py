"""The knowledge circuit of an edit's prompts before and after it, as ``mechdiff knowledge-edit`` runs it: two
single-model ``mechdiff knowledge`` studies read, both models' facts,
`mechdiff.methods.knowledge.editing.compare_edit`, and the tables, figure, JSON and markdown report it writes."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Callable

from ...common.io import write_json, write_text
from ...methods.knowledge import figures
from ...methods.knowledge.editing import compare_edit, load_study
from ...models.loading import LoadedModel
from ...report.tables import write_table
from ...tasks.relation_data import Relation, build_facts
from .report import edit_report


def edit_comparison(
    edit: Relation, name: str, before: Path, after: Path, load_model: Callable[[str], LoadedModel], out: Path
) -> str:
    """Compare the study of the unedited model (``before``) with that of the edited one (``after``) on the facts of
    ``edit`` (named ``name`` in captions; the after study's template and k); both studies are read before
    ``load_model(model)`` loads each study's model. Writes ``out/comparison.json``, ``overlap``/``moved``/``heads``
    tables, ``heads_lens.png`` and ``comparison.md``; returns the overlap (JSON) and the line the command prints."""
    (first, _), (second, _) = load_study(before), load_study(after)  # before loading models
    k, template = second["settings"]["k"], second["settings"]["template"]
    models = {"before": load_model(first["model"]), "after": load_model(second["model"])}
    tok = models["after"].tokenizer
    edited, original = build_facts(tok, edit, template), build_facts(tok, edit.unedited(), template)
    cmp = compare_edit(before, after, models, original, edited)
    write_json(out / "comparison.json", cmp)
    for table in ("overlap", "moved", "heads"):
        write_table(cmp[table], out / table, caption=f"{name}: {table}")
    figures.edit_lens_figure(
        cmp["heads"], cmp["models"], out / "heads_lens.png", title=f"{name}: what the circuits' heads carry"
    )
    write_text(out / "comparison.md", edit_report(cmp, name, k))
    return f"{json.dumps(cmp['overlap'], indent=1)}\nwrote {out}"
