"""``mechdiff dataset``: generate entity-tracking prompts and their counterfactual pairs, or import a user's
pairs from a JSONL file into a task directory (`mechdiff.tasks.jsonl`)."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from ..common.metrics import TASK_METRICS, metric_name
from ..models.loading import load_tokenizer
from ..models.resolve import resolve_spec
from ..tasks.entity_tracking import PAIR_KINDS
from ..tasks.entity_tracking.export import write_dataset
from ..tasks.entity_tracking.pairs import parse_pair_kinds
from ..tasks.jsonl import import_pairs
from ..tasks.task_directory import load_task_meta, read_task_directory


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("dataset", help="generate a task dataset, or import your own counterfactual pairs")
    kinds = p.add_subparsers(dest="dataset", required=True, metavar="{entity-tracking,import}")
    et = kinds.add_parser("entity-tracking", help="entity-tracking prompts (JSONL, and a datasets.Dataset on disk)")
    et.add_argument("--model", default="smollm2-135m", help="whose tokenizer decides single-token words and positions")
    et.add_argument("--n-boxes", type=int, default=7)
    et.add_argument("--n", type=int, default=1000)
    et.add_argument("--seed", type=int, default=0)
    et.add_argument("--pairs", default="", help=f"comma-separated counterfactual kinds: {','.join(PAIR_KINDS)}")
    et.add_argument("--vocabulary", default=None, help="a file of objects, one per line (default: packaged list)")
    et.add_argument("--out", required=True, help="output directory")
    et.add_argument("--hf", action="store_true", help="also save datasets.Dataset folders (save_to_disk)")
    et.set_defaults(func=main)
    imp = kinds.add_parser(
        "import",
        help="check a JSONL file of counterfactual pairs against a model's tokenizer and "
        "write a task directory for --task DIR",
    )
    imp.add_argument(
        "pairs",
        help='one JSON object a line: {"clean", "counterfactual", "answer", '
        '"counterfactual_answer" (optional), "positions": {name: [start, end]}, '
        '"counterfactual_positions" (optional)}; character offsets into the prompt',
    )
    imp.add_argument("--model", required=True, help="whose tokenizer the positions and answers are checked against")
    imp.add_argument("--out", required=True, help="the task directory to write (refused if it exists, see --force)")
    imp.add_argument("--name", default=None, help="the task's name (default: the directory's name)")
    imp.add_argument("--plan", default=None, help="a discovery plan TOML to ship with the task")
    imp.add_argument(
        "--metric",
        default="prob",
        type=metric_name,
        choices=list(TASK_METRICS),
        help="prob (answer probability) or logit_diff (answer - counterfactual answer)",
    )
    imp.add_argument(
        "--desideratum",
        action="append",
        default=[],
        metavar="NAME=COLUMN|NAME=FILE.jsonl",
        help="a DCM desideratum: each row's COLUMN holds its target, or FILE.jsonl holds one "
        '{"target": ..., "counterfactual": ... (optional)} a row; repeat for several (default: '
        "counterfactual, where every row gives a counterfactual_answer)",
    )
    imp.add_argument(
        "--item",
        default=None,
        metavar="FIELD",
        help="the row key whose value is a row's item (e.g. country: all of one country's rows form one item); a "
        "study's prompt sets never split an item (default: a row's clean prompt)",
    )
    imp.add_argument("--force", action="store_true", help="replace an existing --out directory")
    imp.set_defaults(func=main_import)


def main_import(args: argparse.Namespace) -> int:
    if not Path(args.pairs).is_file():
        raise FileNotFoundError(f"pairs file {args.pairs} does not exist")
    tokenizer = load_tokenizer(resolve_spec(args.model))
    out = import_pairs(
        args.pairs,
        tokenizer,
        args.out,
        model=args.model,
        name=args.name,
        plan=args.plan,
        metric=args.metric,
        force=args.force,
        desiderata=args.desideratum,
        item=args.item,
        warn=lambda line: print(f"warning: {line}", file=sys.stderr),
    )
    meta = load_task_meta(out)
    items = len(set(read_task_directory(out).item_keys))
    unit = f"values of {meta['item']!r}" if meta.get("item") else "distinct clean prompts"
    declared = meta.get("desiderata") or {}
    desiderata = ", ".join(f"{n} ({d['target']}, {d['moved']} rows move)" for n, d in declared.items())
    print(
        f"imported {meta['n_pairs']} rows over {items} items ({unit}; {', '.join(map(str, meta['n_tokens']))} "
        "tokens; positions "
        f"{', '.join(meta['positions'])}; DCM desiderata: {desiderata or 'none'}) -> {out}; use it with --task {out}"
    )
    return 0


def main(args: argparse.Namespace) -> int:
    kinds = parse_pair_kinds(args.pairs)  # checked before the tokenizer loads
    write_dataset(
        load_tokenizer(resolve_spec(args.model)),
        args.out,
        args.n,
        args.n_boxes,
        args.seed,
        kinds,
        args.vocabulary,
        args.hf,
    )  # prints the vocabulary report, then each set as it is written
    return 0
