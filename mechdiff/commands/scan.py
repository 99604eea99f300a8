"""``mechdiff scan``: activation-patching scan of every head (or residual position) on the task's pairs."""

from __future__ import annotations

import argparse
from pathlib import Path

import torch

from ..components import Head
from ..metrics import metric_name
from ..patching.scan import DEFAULT_PER_PASS, METRICS, SITES, scan_pairs
from ..report.figures import grid_heatmap, head_heatmap
from ..tasks.base import pair_batch_tensors
from ._options import (add_model_options, add_task_option, load_from_args, task_from_args, task_options,
                       tokenizer_from_args, write_json)

EVERY = "all"  # patch every position at once


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("scan", help="activation-patching scan: effect of each head (or residual position) alone")
    p.add_argument("--model", default="smollm2-135m", help="registry name or path")
    p.add_argument("--site", default="z", choices=SITES, help="z/q/k/v: [layer, head]; resid: [layer, position]")
    p.add_argument("--position", default="last",
                   help="where heads are patched: a position the task records (entity tracking: last, query_label, "
                        "query_label_context; IOI: last, S2, ...) or all (every position at once; resid scans every "
                        "position)")
    p.add_argument("--metric", default="prob", type=metric_name, choices=sorted(METRICS),
                   help="what a patch's effect is measured on (prob: the answer's probability; answer_prob is read "
                        "as prob)")
    p.add_argument("--n", type=int, default=16, help="number of clean/counterfactual pairs")
    p.add_argument("--n-boxes", type=int, default=7, help="entity tracking: boxes per prompt")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--per-pass", type=int, default=DEFAULT_PER_PASS, help="components stacked in one forward pass")
    p.add_argument("--out", default=None, help="output directory (default results/scan/<model>/)")
    add_task_option(p)
    add_model_options(p)
    p.set_defaults(func=main)


def main(args: argparse.Namespace) -> int:
    out = Path(args.out or f"results/scan/{Path(args.model).name}")
    task = task_from_args(args)
    known = (*task.positions, EVERY)
    if args.position not in known:  # checked before the model loads
        raise ValueError(f"--position {args.position!r} is not a position of task {task.name}; choose one of "
                         f"{', '.join(known)}")
    tokenizer = tokenizer_from_args(args.model, args)
    # the pairs (and which positions are single tokens: one prompt shows it) are checked before the weights load
    pairs = task.discovery_pairs(tokenizer, args.n, args.seed, **task_options(args))
    tensors = pair_batch_tensors(pairs[:1])
    if args.position != EVERY and (args.position not in tensors["base"]["positions"]
                                   or tensors["base"]["positions"][args.position].ndim != 1):
        raise ValueError(f"--position {args.position!r} is not a single position of each prompt of task {task.name}")
    model = load_from_args(args.model, args, tokenizer)
    # prompts of several lengths and templates: each group scanned alone, effects averaged over every prompt
    result = scan_pairs(model, pairs, site=args.site, position=None if args.position == EVERY else args.position,
                        metric=args.metric, per_pass=args.per_pass)
    out.mkdir(parents=True, exist_ok=True)
    stem = out / f"scan_{args.site}_{args.position}"
    meta = {**{k: v for k, v in result.to_dict().items() if k != "effects"}, "model": model.name, "task": task.name,
            "n_pairs": len(pairs), **task.kwargs(n_boxes=args.n_boxes), "seed": args.seed,
            "position": args.position}
    torch.save({"effects": result.effects, **meta}, stem.with_suffix(".pt"))
    write_json(stem.with_suffix(".json"), {**meta, "effects": result.effects.tolist()})
    title = f"{model.name}: {args.site} patched at {args.position}"
    if result.axes == ("layer", "head"):
        scores = {Head(l, h): float(result.effects[l, h]) for l in range(result.effects.shape[0])
                  for h in range(result.effects.shape[1])}
        head_heatmap(scores, *result.effects.shape, stem.with_suffix(".png"), title=title, label=result.label)
    else:
        grid_heatmap(result.effects.numpy(), stem.with_suffix(".png"), title=title, label=result.label)
    top = result.effects.flatten().abs().argsort(descending=True)[:5]
    cells = [divmod(int(i), result.effects.shape[1]) for i in top]
    print(f"{result.label}: clean {result.clean:.4f}, source {result.source:.4f}; largest effects "
          + ", ".join(f"[{a}, {b}] {float(result.effects[a, b]):+.4f}" for a, b in cells))
    print(f"-> {stem}.pt, .json, .png")
    return 0
