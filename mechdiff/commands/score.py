"""``mechdiff score``: faithfulness (with a random baseline) and completeness of a circuit on one model."""

from __future__ import annotations

import argparse
from pathlib import Path

from ..metrics import metric_name
from ..circuits.scoring import completeness, faithfulness
from ..report.tables import estimate_columns, to_markdown, write_table
from ._options import add_dataset_options, add_model_options, load_from_args, write_json
from ..io import check_writable
from ._scoring import add_scoring_options, build_scorer, load_circuit, model_shape, settings


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("score", help="faithfulness and completeness of a circuit by mean ablation")
    p.add_argument("--model", default="smollm2-135m", help="registry name or path")
    p.add_argument("--circuit", required=True, help="circuit JSON file")
    p.add_argument("--n-random", type=int, default=3, help="random circuits of the same group sizes (baseline)")
    p.add_argument("--completeness-draws", type=int, default=5, help="random subsets K (0: groups only)")
    p.add_argument("--no-completeness", action="store_true", help="skip completeness")
    p.add_argument("--metric", default="accuracy", type=metric_name, choices=["accuracy", "prob"], help="completeness metric")
    p.add_argument("--out", default="results/score", help="output directory")
    add_dataset_options(p, n=100)
    add_scoring_options(p)
    add_model_options(p)
    p.set_defaults(func=main)


def faithfulness_rows(res: dict) -> list[dict]:
    """Rows ``full``, ``circuit`` (and ``random``) with accuracy, answer probability and faithfulness."""
    rows = []
    for what in ("full", "circuit", "random"):
        if what in res:
            row = {"run": what}
            for metric in ("accuracy", "answer_prob", "faithfulness", "faithfulness_prob"):
                row.update(estimate_columns(metric, res[what][metric]))
            rows.append(row)
    return rows


def completeness_rows(res: dict) -> list[dict]:
    """One row per K: random subsets (mean +- std over draws, CI over draws) and each group."""
    rows = []
    if "random" in res:
        r = res["random"]
        rows.append({"K": f"random (p={res['p']}, {len(r['draws'])} draws)", "size": None,
                     **estimate_columns("completeness", {**r["ci"], "value": r["mean"]}), "std": r["std"]})
    for g, r in res["groups"].items():
        d = r["difference"]
        if d is None:  # an empty group: completeness is undefined
            rows.append({"K": f"group {g}", "size": 0, "completeness": "n/a", "std": None})
            continue
        lo, hi = sorted((abs(d["low"]), abs(d["high"])))
        if d["low"] <= 0 <= d["high"]:
            lo = 0.0
        rows.append({"K": f"group {g}", "size": r["size"],
                     **estimate_columns("completeness", {"value": r["completeness"], "low": lo, "high": hi}),
                     "std": None})
    return rows


def main(args: argparse.Namespace) -> int:
    check_writable(args.out)  # inputs and output are checked before the weights load
    circuit = load_circuit(args.circuit, model_shape(args.model, args))
    model = load_from_args(args.model, args)
    scorer = build_scorer(model, args)
    out = Path(args.out)
    result = {"model": model.name, "fingerprint": model.fingerprint, "circuit": args.circuit,
              "settings": settings(args),
              "faithfulness": faithfulness(scorer, circuit, n_random=args.n_random, seed=args.seed)}
    rows = faithfulness_rows(result["faithfulness"])
    write_table(rows, out / "faithfulness", caption=f"Mean-ablation faithfulness of {args.circuit} on {model.name}")
    print(to_markdown(rows))
    if not args.no_completeness:
        result["completeness"] = completeness(scorer, circuit, n_draws=args.completeness_draws, seed=args.seed,
                                              metric=args.metric)
        rows = completeness_rows(result["completeness"])
        write_table(rows, out / "completeness", caption=f"Completeness ({args.metric}) of {args.circuit} on {model.name}")
        print()
        print(to_markdown(rows))
    write_json(out / "score.json", result)
    return 0
