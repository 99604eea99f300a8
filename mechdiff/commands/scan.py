"""``mechdiff scan``: activation-patching scan of every head (or residual position) on the task's pairs."""

from __future__ import annotations

import argparse
from pathlib import Path

from ..common.metrics import metric_name
from ..patching.scan import DEFAULT_PER_PASS, METRICS, SITES
from ..studies.circuits.scan import scan_task
from ._options import (
    add_model_options,
    add_task_option,
    load_from_args,
    task_from_args,
    task_options,
    tokenizer_from_args,
)


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("scan", help="activation-patching scan: effect of each head (or residual position) alone")
    p.add_argument("--model", default="smollm2-135m", help="registry name or path")
    p.add_argument("--site", default="z", choices=SITES, help="z/q/k/v: [layer, head]; resid: [layer, position]")
    p.add_argument(
        "--position",
        default="last",
        help="where heads are patched: a position the task records (entity tracking: last, query_label, "
        "query_label_context; IOI: last, S2, ...) or all (every position at once; resid scans every "
        "position)",
    )
    p.add_argument(
        "--metric",
        default=None,
        type=metric_name,
        choices=sorted(METRICS),
        help="what a patch's effect is measured on (default: the task's metric, prob or logit_diff; prob: the "
        "answer's probability; answer_prob is read as prob)",
    )
    p.add_argument("--n", type=int, default=16, help="number of clean/counterfactual pairs")
    p.add_argument("--n-boxes", type=int, default=7, help="entity tracking: boxes per prompt")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--per-pass", type=int, default=DEFAULT_PER_PASS, help="components stacked in one forward pass")
    p.add_argument("--out", default=None, help="output directory (default results/scan/<model>/)")
    add_task_option(p)
    add_model_options(p)
    p.set_defaults(func=main)


def main(args: argparse.Namespace) -> int:
    task = task_from_args(args)
    print(
        scan_task(
            task,
            args.site,
            args.position,
            args.metric or task.metric,
            args.n,
            args.seed,
            task_options(args),
            args.per_pass,
            Path(args.out or f"results/scan/{Path(args.model).name}"),
            lambda: tokenizer_from_args(args.model, args),
            lambda tokenizer: load_from_args(args.model, args, tokenizer),
        )
    )
    return 0
