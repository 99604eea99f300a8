"""``mechdiff knowledge-edit``: the knowledge circuit of an edit's prompts before and after it.

Compares two single-model ``mechdiff knowledge`` studies of the same prompts (see
`mechdiff.methods.knowledge.editing`): the unedited model with ``--relation EDIT --unedited`` and the edited model
with ``--relation EDIT``.
"""

from __future__ import annotations

import argparse
from pathlib import Path

from ..studies.knowledge.editing import edit_comparison
from ..tasks.relation_data import Relation
from ._options import add_model_options, load_from_args


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("knowledge-edit", help="knowledge circuits of an edit's prompts before vs after the edit")
    p.add_argument("--edit", required=True, help='edit file (edits/capital_swap, or an LRE JSON with "edits_of")')
    p.add_argument("--before", required=True, help="study directory of the unedited model (--unedited)")
    p.add_argument("--after", required=True, help="study directory of the edited model")
    p.add_argument("--out", required=True, help="output directory")
    add_model_options(p)
    p.set_defaults(func=main)


def main(args: argparse.Namespace) -> int:
    relation = Relation.load(args.edit)
    if relation.edits_of is None:
        raise SystemExit(f'error: {args.edit} is not an edit file (no "edits_of"); give e.g. edits/capital_swap')
    print(
        edit_comparison(
            relation,
            args.edit,
            Path(args.before),
            Path(args.after),
            lambda name: load_from_args(name, args),
            Path(args.out),
        )
    )
    return 0
