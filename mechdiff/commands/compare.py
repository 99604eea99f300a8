"""``mechdiff compare``: circuits x models (accuracy, faithfulness with CIs), overlap tables, membership heatmap."""

from __future__ import annotations

import argparse

from ..circuits.circuit import CircuitFileError, load_circuits
from ..common.io import check_writable
from ..models.modelset import ModelSet
from ..studies.circuits.scoring import COMPARE_N, COMPARE_OUT, compare_circuits
from ._options import add_dataset_options, add_model_options, model_kwargs, resolve_batch_size
from ._scoring import add_scoring_options, scoring_prompts, settings


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("compare", help="score circuits on several models; overlap between circuits")
    p.add_argument("--models", required=True, help="comma-separated registry names or paths (same shape)")
    p.add_argument("--circuits", required=True, help="comma-separated circuit JSON files")
    p.add_argument("--labels", default=None, help="comma-separated circuit labels (default: file stems)")
    p.add_argument("--n-random", type=int, default=0, help="random circuits per cell (baseline; costs passes)")
    p.add_argument("--out", default=COMPARE_OUT, help="output directory")
    add_dataset_options(p, n=COMPARE_N)
    add_scoring_options(p)
    add_model_options(p)
    p.set_defaults(func=main)


def main(args: argparse.Namespace) -> int:
    out = check_writable(args.out)
    models = ModelSet(args.models.split(","), **model_kwargs(args))  # configs only: no weights yet
    try:
        circuits = load_circuits(
            args.circuits.split(","), args.labels.split(",") if args.labels else None, models.shape
        )
    except CircuitFileError:
        raise
    except ValueError as err:  # the labels: name the flag that sets them
        raise ValueError(f"{err}; set them with --labels") from None
    resolve_batch_size(args, models[models.names[0]])  # --batch-size auto: from the first model, for all
    print(compare_circuits(models, circuits, scoring_prompts(args), out, args.n_random, settings(args)))
    return 0
