"""``mechdiff knowledge-edit``: the knowledge circuit of an edit's prompts before and after it.

Compares two single-model ``mechdiff knowledge`` studies of the same prompts (see
:mod:`mechdiff.knowledge.editing`): the unedited model with ``--relation EDIT --unedited`` and the edited model
with ``--relation EDIT``.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from ..io import write_json, write_text
from ..knowledge import figures
from ..knowledge.data import Relation, build_facts
from ..knowledge.editing import compare_edit, edit_report, load_study
from ..report.tables import write_table
from ._options import add_model_options, load_from_args


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("knowledge-edit", help="knowledge circuits of an edit's prompts before vs after the edit")
    p.add_argument("--edit", required=True, help="edit file (edits/capital_swap, or an LRE JSON with \"edits_of\")")
    p.add_argument("--before", required=True, help="study directory of the unedited model (--unedited)")
    p.add_argument("--after", required=True, help="study directory of the edited model")
    p.add_argument("--out", required=True, help="output directory")
    add_model_options(p)
    p.set_defaults(func=main)


def main(args: argparse.Namespace) -> int:
    relation = Relation.load(args.edit)
    if relation.edits_of is None:
        raise SystemExit(f"error: {args.edit} is not an edit file (no \"edits_of\"); give e.g. edits/capital_swap")
    (before, _), (after, _) = load_study(Path(args.before)), load_study(Path(args.after))  # before loading models
    k, template = after["settings"]["k"], after["settings"]["template"]
    models = {"before": load_from_args(before["model"], args), "after": load_from_args(after["model"], args)}
    tok = models["after"].tokenizer
    edited, original = build_facts(tok, relation, template), build_facts(tok, relation.unedited(), template)
    cmp = compare_edit(Path(args.before), Path(args.after), models, original, edited)
    out = Path(args.out)
    write_json(out / "comparison.json", cmp)
    for name in ("overlap", "moved", "heads"):
        write_table(cmp[name], out / name, caption=f"{args.edit}: {name}")
    figures.edit_lens_figure(cmp["heads"], cmp["models"], out / "heads_lens.png",
                             title=f"{args.edit}: what the circuits' heads carry")
    write_text(out / "comparison.md", edit_report(cmp, args.edit, k))
    print(json.dumps(cmp["overlap"], indent=1))
    print(f"wrote {out}")
    return 0
