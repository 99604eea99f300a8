"""``mechdiff eval``: task accuracy (and the task's logit difference, where it has one) of models."""

from __future__ import annotations

import argparse
from pathlib import Path

from ..models.modelset import ModelSet
from ..studies.circuits.evaluation import eval_models
from ..tasks.base import SPLITS
from ._options import add_dataset_options, add_model_options, model_kwargs, task_from_args, task_options


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("eval", help="accuracy of models on a task's prompts")
    p.add_argument(
        "--model", "--models", dest="models", default="smollm2-135m", help="comma-separated registry names or paths"
    )
    p.add_argument(
        "--split",
        default="eval",
        choices=SPLITS,
        help="entity tracking's objects: eval (held out from every zoo fine-tune; default), train or all",
    )
    p.add_argument("--out", default=None, help="write the results as JSON here")
    add_dataset_options(p)
    add_model_options(p)
    p.set_defaults(func=main)


def main(args: argparse.Namespace) -> int:
    task = task_from_args(args)
    models = ModelSet(args.models.split(","), **model_kwargs(args))
    print(
        eval_models(
            models,
            task,
            args.n,
            args.seed,
            task_options(args),
            args.split,
            args.batch_size,
            Path(args.out) if args.out else None,
        )
    )
    return 0
