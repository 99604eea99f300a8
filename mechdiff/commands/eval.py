"""``mechdiff eval``: task accuracy of one or more models on generated prompts."""

from __future__ import annotations

import argparse

from tabulate import tabulate

from ..evaluate import evaluate
from ..models.modelset import ModelSet
from ..tasks.entity_tracking import generate
from ..tasks.splits import SPLITS, split_objects
from ._options import add_dataset_options, add_model_options, model_kwargs, resolve_batch_size, write_json


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("eval", help="accuracy of models on entity-tracking prompts")
    p.add_argument("--model", "--models", dest="models", default="smollm2-135m",
                   help="comma-separated registry names or paths")
    p.add_argument("--task", default="entity-tracking", choices=["entity-tracking"])
    p.add_argument("--split", default="eval", choices=SPLITS,
                   help="objects in the prompts: eval (held out from every zoo fine-tune; default), train or all")
    p.add_argument("--out", default=None, help="write the results as JSON here")
    add_dataset_options(p)
    add_model_options(p)
    p.set_defaults(func=main)


def main(args: argparse.Namespace) -> int:
    models = ModelSet(args.models.split(","), **model_kwargs(args))
    rows, results = [], {}
    for lm in models:
        resolve_batch_size(args, lm)
        records = generate(lm.tokenizer, n=args.n, n_boxes=args.n_boxes, seed=args.seed,
                           vocabulary=split_objects(args.split))
        res = evaluate(lm, records, batch_size=args.batch_size, desc=f"eval {lm.name}")
        results[lm.name] = {**res.to_dict(), "fingerprint": lm.fingerprint, "n_boxes": args.n_boxes,
                            "n": args.n, "seed": args.seed, "split": args.split,
                            "correct": res.correct.astype(int).tolist()}
        rows.append([lm.name, str(res.accuracy), str(res.answer_prob), lm.fingerprint])
    print(tabulate(rows, headers=["model", "accuracy [95% CI]", "answer prob [95% CI]", "fingerprint"]))
    if args.out:
        write_json(args.out, results)
    return 0
