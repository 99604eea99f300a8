"""``mechdiff eval``: task accuracy (and the task's logit difference, where it has one) of models."""

from __future__ import annotations

import argparse

from tabulate import tabulate

from ..evaluate import evaluate
from ..models.modelset import ModelSet
from ..tasks.entity_tracking.splits import SPLITS, split_objects
from ._options import (add_dataset_options, add_model_options, model_kwargs, resolve_batch_size, task_from_args,
                       task_options, write_json)


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("eval", help="accuracy of models on a task's prompts")
    p.add_argument("--model", "--models", dest="models", default="smollm2-135m",
                   help="comma-separated registry names or paths")
    p.add_argument("--split", default="eval", choices=SPLITS,
                   help="entity tracking's objects: eval (held out from every zoo fine-tune; default), train or all")
    p.add_argument("--out", default=None, help="write the results as JSON here")
    add_dataset_options(p)
    add_model_options(p)
    p.set_defaults(func=main)


def main(args: argparse.Namespace) -> int:
    task = task_from_args(args)
    models = ModelSet(args.models.split(","), **model_kwargs(args))
    rows, results = [], {}
    for lm in models:
        resolve_batch_size(args, lm)
        records = task.records(lm.tokenizer, args.n, args.seed, **task_options(args),
                               vocabulary=split_objects(args.split))
        res = evaluate(lm, records, batch_size=args.batch_size, desc=f"eval {lm.name}")
        results[lm.name] = {**res.to_dict(), "task": task.name, "fingerprint": lm.fingerprint,
                            **task.kwargs(n_boxes=args.n_boxes), "n": len(records), "seed": args.seed,
                            **({"split": args.split} if "vocabulary" in task.options else {}),
                            "correct": res.correct.astype(int).tolist()}
        diff = [str(res.mean_logit_diff)] if res.logit_diff is not None else []
        rows.append([lm.name, str(res.accuracy), str(res.answer_prob), *diff, lm.fingerprint])
    diff_header = ["logit diff [95% CI]"] if any(len(r) == 5 for r in rows) else []
    print(tabulate(rows, headers=["model", "accuracy [95% CI]", "answer prob [95% CI]", *diff_header, "fingerprint"]))
    if args.out:
        write_json(args.out, results)
    return 0
