"""``mechdiff prune``: drop the circuit pairs whose minimality contribution is below a threshold."""

from __future__ import annotations

import argparse
from pathlib import Path

from ..circuits.pruning import PAPER_SHARE, PRUNE_RULES
from ..common.io import check_writable
from ..common.metrics import metric_name
from ..studies.circuits.scoring import prune_circuit
from ._options import METRIC_HELP, add_dataset_options, add_model_options, load_from_args
from ._scoring import add_scoring_options, load_circuit, model_shape, scoring_prompts, settings


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "prune", help="minimality of each circuit head (greedy or the paper's pairwise rule) and the pruned circuit"
    )
    p.add_argument("--model", default="smollm2-135m", help="registry name or path")
    p.add_argument("--circuit", required=True, help="circuit JSON file")
    p.add_argument("--out", required=True, help="where to write the pruned circuit JSON")
    p.add_argument(
        "--rule",
        default=PRUNE_RULES[0],
        choices=list(PRUNE_RULES),
        help="greedy: keep a pair if its contribution / F(C) exceeds the threshold (mechdiff's); paper: per "
        "group, keep v iff F(C\\K) / F(C\\(K+v)) - 1 >= the threshold, K from pairwise removals",
    )
    p.add_argument(
        "--threshold", type=float, default=0.01, help="the rule's threshold (recorded in the circuit's meta)"
    )
    p.add_argument(
        "--share", type=float, default=PAPER_SHARE, help="paper rule: K is at most ceil(share |group|) heads"
    )
    p.add_argument("--max-steps", type=int, default=1, help="greedy steps growing K per head")
    p.add_argument("--candidates", type=int, default=4, help="pairs tried per greedy step (0: all)")
    p.add_argument("--metric", default="accuracy", type=metric_name, choices=["accuracy", "prob"], help=METRIC_HELP)
    add_dataset_options(p, n=32)
    add_scoring_options(p)
    add_model_options(p)
    p.set_defaults(func=main)


def main(args: argparse.Namespace) -> int:
    check_writable(Path(args.out).parent)  # inputs and output are checked before the weights load
    circuit = load_circuit(args.circuit, model_shape(args.model, args))
    model = load_from_args(args.model, args)
    print(
        prune_circuit(
            model,
            circuit,
            args.circuit,
            scoring_prompts(args),
            Path(args.out),
            args.rule,
            args.threshold,
            args.share,
            args.max_steps,
            args.candidates or None,
            args.metric,
            settings(args),
        )
    )
    return 0
