"""``mechdiff curve``: faithfulness against size of circuits over (head, position class) pairs."""

from __future__ import annotations

import argparse
from pathlib import Path

from ..circuits.curve import SIZES, TARGET
from ..studies.circuits.scoring import size_curve
from ..tasks.base import SPLITS
from ._options import add_dataset_options, add_model_options, load_from_args, task_from_args
from ._scoring import add_scoring_options, scoring_prompts, settings


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("curve", help="faithfulness vs size of nested circuits over (head, position class) pairs")
    p.add_argument("--model", default="smollm2-135m", help="registry name or path")
    p.add_argument("--sizes", default=",".join(str(s) for s in SIZES), help="fractions of all (head, class) pairs")
    p.add_argument("--target", type=float, default=TARGET, help="pick the smallest circuit reaching this faithfulness")
    p.add_argument(
        "--rank-n",
        type=int,
        default=80,
        help="prompts that rank the pairs (prompt set command-ranking, --seed + 2: disjoint from the scored prompts)",
    )
    p.add_argument(
        "--split",
        default="eval",
        choices=SPLITS,
        help="entity tracking: objects of the scored and ranking prompts (eval: held out from fine-tuning)",
    )
    p.add_argument("--out", default="results/curve", help="output directory")
    add_dataset_options(p, n=80)
    add_scoring_options(p)
    add_model_options(p)
    p.set_defaults(func=main)


def main(args: argparse.Namespace) -> int:
    sizes = tuple(float(x) for x in args.sizes.split(","))
    if not sizes or min(sizes) <= 0 or max(sizes) > 1:
        raise ValueError(f"--sizes must be fractions in (0, 1], got {args.sizes!r}")
    model = load_from_args(args.model, args)
    print(
        size_curve(
            model,
            scoring_prompts(args),
            Path(args.out),
            sizes,
            args.target,
            args.rank_n,
            settings(args),
            task_from_args(args).split_options(args.split),
        )
    )
    return 0
