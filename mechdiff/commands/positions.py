"""``mechdiff positions``: where a model computes a task, by a greedy scan over its position classes."""

from __future__ import annotations

import argparse
from pathlib import Path

from ..common.metrics import metric_name
from ..studies.circuits.scoring import scan_positions
from ._options import METRIC_HELP, add_dataset_options, add_model_options, load_from_args
from ._scoring import add_scoring_options, scoring_prompts, settings


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("positions", help="greedy scan of the position classes a model needs (every head kept there)")
    p.add_argument("--model", default="smollm2-135m", help="registry name or path")
    p.add_argument(
        "--metric",
        default="accuracy",
        type=metric_name,
        choices=["accuracy", "prob"],
        help=f"what the greedy step maximises: {METRIC_HELP}",
    )
    p.add_argument(
        "--stop-at", type=float, default=None, help="stop once faithfulness reaches this (default: scan all)"
    )
    p.add_argument("--max-steps", type=int, default=None, help="at most this many classes")
    p.add_argument("--leave-one-out", action="store_true", help="also: every class kept but one, for each class")
    p.add_argument("--out", default="results/positions", help="output directory")
    add_dataset_options(p, n=80)
    add_scoring_options(p)
    add_model_options(p)
    p.set_defaults(func=main)


def main(args: argparse.Namespace) -> int:
    model = load_from_args(args.model, args)
    scan_positions(
        model,
        scoring_prompts(args),
        Path(args.out),
        args.metric,
        args.stop_at,
        args.max_steps,
        args.leave_one_out,
        settings(args),
    )  # prints each table
    return 0
