"""``mechdiff curve``: faithfulness against size of circuits over (head, position class) pairs."""

from __future__ import annotations

import argparse
from pathlib import Path

from ..circuits.positions import task_classes
from ..circuits.curve import SIZES, TARGET, ablation_attribution, faithfulness_curve, ranking
from ..circuits.scoring import Scorer, pair_name
from ..report.positions import curve_figure
from ..tasks.entity_tracking.splits import SPLITS, split_objects
from ..report.tables import estimate_columns, to_markdown, write_table
from ..studies.seeds import prompt_seed
from ._options import add_dataset_options, add_model_options, load_from_args, task_from_args, task_options, write_json
from ._scoring import add_scoring_options, build_scorer, settings


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("curve", help="faithfulness vs size of nested circuits over (head, position class) pairs")
    p.add_argument("--model", default="smollm2-135m", help="registry name or path")
    p.add_argument("--sizes", default=",".join(str(s) for s in SIZES), help="fractions of all (head, class) pairs")
    p.add_argument("--target", type=float, default=TARGET, help="pick the smallest circuit reaching this faithfulness")
    p.add_argument("--rank-n", type=int, default=80,
                   help="prompts that rank the pairs (prompt set command-ranking, --seed + 2: disjoint from the scored "
                        "prompts)")
    p.add_argument("--split", default="eval", choices=SPLITS,
                   help="entity tracking: objects of the scored and ranking prompts (eval: held out from fine-tuning)")
    p.add_argument("--out", default="results/curve", help="output directory")
    add_dataset_options(p, n=80)
    add_scoring_options(p)
    add_model_options(p)
    p.set_defaults(func=main)


def curve_rows(curve: dict) -> list[dict]:
    """One row per size: pairs kept, accuracy, faithfulness (accuracy and probability), MIB-normalised."""
    return [{"fraction": r["fraction"], "pairs": r["n_pairs"], **estimate_columns("accuracy", r["accuracy"]),
             **estimate_columns("faithfulness", r["faithfulness"]),
             **estimate_columns("faithfulness_prob", r["faithfulness_prob"]),
             "normalised_accuracy": r["normalised_accuracy"], "normalised_prob": r["normalised_prob"]}
            for r in curve["rows"]]


def main(args: argparse.Namespace) -> int:
    sizes = tuple(float(x) for x in args.sizes.split(","))
    if not sizes or min(sizes) <= 0 or max(sizes) > 1:
        raise ValueError(f"--sizes must be fractions in (0, 1], got {args.sizes!r}")
    model = load_from_args(args.model, args)
    held_out = {"vocabulary": split_objects(args.split)} if task_from_args(args).name == "entity-tracking" else {}
    scorer = build_scorer(model, args, **held_out)
    classes = task_classes(scorer)
    # rank on other prompts than those scored, so the curve measures the circuits on fresh prompts
    ranking_records = task_from_args(args).records(model.tokenizer, args.rank_n,
                                                   prompt_seed(args.seed, "command-ranking"), **task_options(args),
                                                   **held_out)
    scores = ablation_attribution(Scorer(model, ranking_records, scorer.means, scorer.batch_size, scorer.progress),
                                  classes)
    ranked = ranking(scores)
    curve = faithfulness_curve(scorer, ranked, sizes, args.target)
    out = Path(args.out)
    rows = curve_rows(curve)
    write_table(rows, out / "curve", caption=f"Faithfulness of nested circuits over (head, position class) pairs on "
                f"{model.name} (ranked by mean-ablation attribution; CPR {curve['cpr_prob']}, CMD {curve['cmd_prob']})")
    print(to_markdown(rows))
    chosen = curve["chosen"]
    n = chosen["n_pairs"] if chosen else 0
    print(f"\nsmallest circuit reaching faithfulness {args.target}: "
          + (f"{n} pairs ({chosen['fraction']:.0%} of {len(ranked)})" if chosen else "none of the sizes scored"))
    curve_figure(curve, out / "curve.png", title=f"{model.name}: faithfulness vs circuit size")
    write_json(out / "curve.json", {"model": model.name, "fingerprint": model.fingerprint, "settings": settings(args),
                                    "curve": curve, "classes": list(classes),
                                    "ranking": [[pair_name(p), scores[p]] for p in ranked],
                                    "circuit": [pair_name(p) for p in ranked[:n]]})
    return 0
