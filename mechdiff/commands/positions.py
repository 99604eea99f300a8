"""``mechdiff positions``: where a model computes a task, by a greedy scan over its position classes."""

from __future__ import annotations

import argparse
from pathlib import Path

from ..metrics import metric_name
from ..circuits.positions import leave_one_out, position_scan, task_classes
from ..report.positions import position_scan_figure
from ..report.tables import estimate_columns, to_markdown, write_table
from ._options import add_dataset_options, add_model_options, load_from_args, write_json
from ._scoring import add_scoring_options, build_scorer, settings


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("positions", help="greedy scan of the position classes a model needs (every head kept there)")
    p.add_argument("--model", default="smollm2-135m", help="registry name or path")
    p.add_argument("--metric", default="accuracy", type=metric_name, choices=["accuracy", "prob"], help="what the greedy step maximises")
    p.add_argument("--stop-at", type=float, default=None, help="stop once faithfulness reaches this (default: scan all)")
    p.add_argument("--max-steps", type=int, default=None, help="at most this many classes")
    p.add_argument("--leave-one-out", action="store_true", help="also: every class kept but one, for each class")
    p.add_argument("--out", default="results/positions", help="output directory")
    add_dataset_options(p, n=80)
    add_scoring_options(p)
    add_model_options(p)
    p.set_defaults(func=main)


def scan_rows(res: dict) -> list[dict]:
    """One row per greedy step: the class added and the kept set's accuracy and faithfulness."""
    return [{"step": i + 1, "added": s["added"], **estimate_columns("accuracy", s["accuracy"]),
             **estimate_columns("faithfulness", s["faithfulness"]),
             **estimate_columns("faithfulness_prob", s["faithfulness_prob"])} for i, s in enumerate(res["steps"])]


def main(args: argparse.Namespace) -> int:
    model = load_from_args(args.model, args)
    scorer = build_scorer(model, args)
    classes = task_classes(scorer)
    out = Path(args.out)
    scan = position_scan(scorer, classes, args.metric, stop_at=args.stop_at, max_steps=args.max_steps)
    result = {"model": model.name, "fingerprint": model.fingerprint, "settings": settings(args), "scan": scan}
    rows = scan_rows(scan)
    write_table(rows, out / "position_scan", caption=f"Greedy position scan on {model.name} "
                f"(every head kept at the classes so far, every other (head, position) mean-ablated)")
    print(to_markdown(rows))
    if args.leave_one_out:
        result["leave_one_out"] = leave_one_out(scorer, classes, args.metric)
        loo = [{"left out": c, **estimate_columns("accuracy", r["accuracy"]),
                **estimate_columns("faithfulness", r["faithfulness"])}
               for c, r in result["leave_one_out"]["classes"].items()]
        write_table(loo, out / "leave_one_out", caption=f"Every class kept but one, on {model.name}")
        print()
        print(to_markdown(loo))
    position_scan_figure(scan, out / "position_scan.png", title=f"{model.name}: where the task is computed")
    write_json(out / "positions.json", result)
    return 0
