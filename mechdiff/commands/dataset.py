"""``mechdiff dataset``: generate entity-tracking prompts and their counterfactual pairs."""

from __future__ import annotations

import argparse
from pathlib import Path

from ..models.loading import load_tokenizer, resolve_spec
from ..tasks.entity_tracking import (PAIR_KINDS, counterfactual_pairs, dataset_hash, generate, to_hf_dataset,
                                     vocabulary_report, write_jsonl)


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("dataset", help="generate a task dataset (JSONL, and a datasets.Dataset on disk)")
    p.add_argument("task", choices=["entity-tracking"])
    p.add_argument("--model", default="smollm2-135m", help="whose tokenizer decides single-token words and positions")
    p.add_argument("--n-boxes", type=int, default=7)
    p.add_argument("--n", type=int, default=1000)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--pairs", default="", help=f"comma-separated counterfactual kinds: {','.join(PAIR_KINDS)}")
    p.add_argument("--vocabulary", default=None, help="a file of objects, one per line (default: packaged list)")
    p.add_argument("--out", required=True, help="output directory")
    p.add_argument("--hf", action="store_true", help="also save datasets.Dataset folders (save_to_disk)")
    p.set_defaults(func=main)


def main(args: argparse.Namespace) -> int:
    kinds = [k for k in args.pairs.split(",") if k]
    unknown = sorted(set(kinds) - set(PAIR_KINDS))
    if unknown:
        raise ValueError(f"unknown pair kinds {unknown}; choose from {', '.join(PAIR_KINDS)}")
    tokenizer = load_tokenizer(resolve_spec(args.model))
    report = vocabulary_report(tokenizer, args.vocabulary)
    print(report.summary())
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    sets = {"examples": generate(tokenizer, args.n, args.n_boxes, args.seed, args.vocabulary)}
    for kind in kinds:
        sets[kind] = counterfactual_pairs(kind, tokenizer, args.n, args.n_boxes, args.seed, args.vocabulary)
    for name, records in sets.items():
        write_jsonl(records, out / f"{name}.jsonl")
        if args.hf:
            to_hf_dataset(records).save_to_disk(str(out / name))
        print(f"{name}: {len(records)} records -> {out / (name + '.jsonl')} (hash {dataset_hash(records)[:12]})")
    return 0
