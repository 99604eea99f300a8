"""``mechdiff score``: faithfulness (with a random baseline) and completeness of a circuit on one model."""

from __future__ import annotations

import argparse
from pathlib import Path

from ..common.io import check_writable
from ..common.metrics import metric_name
from ..studies.circuits.scoring import score_circuit
from ._options import METRIC_HELP, add_dataset_options, add_model_options, load_from_args
from ._scoring import add_scoring_options, load_circuit, model_shape, scoring_prompts, settings


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("score", help="faithfulness and completeness of a circuit by mean ablation")
    p.add_argument("--model", default="smollm2-135m", help="registry name or path")
    p.add_argument("--circuit", required=True, help="circuit JSON file")
    p.add_argument("--n-random", type=int, default=3, help="random circuits of the same group sizes (baseline)")
    p.add_argument("--completeness-draws", type=int, default=5, help="random subsets K (0: groups only)")
    p.add_argument("--no-completeness", action="store_true", help="skip completeness")
    p.add_argument(
        "--metric",
        default="accuracy",
        type=metric_name,
        choices=["accuracy", "prob"],
        help=f"completeness metric: {METRIC_HELP}",
    )
    p.add_argument("--out", default="results/score", help="output directory")
    add_dataset_options(p, n=100)
    add_scoring_options(p)
    add_model_options(p)
    p.set_defaults(func=main)


def main(args: argparse.Namespace) -> int:
    check_writable(args.out)  # inputs and output are checked before the weights load
    circuit = load_circuit(args.circuit, model_shape(args.model, args))
    model = load_from_args(args.model, args)
    score_circuit(
        model,
        circuit,
        args.circuit,
        scoring_prompts(args),
        Path(args.out),
        args.n_random,
        args.completeness_draws,
        args.metric,
        not args.no_completeness,
        settings(args),
    )  # prints each table
    return 0
