"""``mechdiff restate RUN_DIR``: a circuits study's claims as families of tests from its committed files, no model
loaded (`mechdiff.report.families`); for a trajectory study, its formation on the change scale with the order
tests as a Holm family (`mechdiff.report.formation.restate_formation`)."""

from __future__ import annotations

import argparse


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "restate",
        help="write RUN_DIR/inference.md and tables/families.* (every claim a test in a named family, Holm-adjusted; "
        "intervals over items) from a circuits study's outcomes.json and run.json; for a trajectory study, its "
        "formation tables and README/report sections on the change scale; loads no model",
    )
    p.add_argument("run_dir", help="a circuits or trajectory study's results directory (e.g. results/capitals-smollm2)")
    p.add_argument("--root", default=".", help="the project root its task directories are under (default: .)")
    p.add_argument(
        "--task-file",
        default=None,
        help="a task file whose [inference] margins state sameness (default: those run.json records, else the "
        "defaults: docs/inference.md)",
    )
    p.set_defaults(func=main)


def main(args: argparse.Namespace) -> int:
    import json
    from pathlib import Path

    from ..report.families import restate
    from ..report.formation import restate_formation

    manifest = Path(args.run_dir) / "run.json"
    if not manifest.exists():
        raise ValueError(f"{args.run_dir}: no run.json; give a study's results directory")
    kind = json.loads(manifest.read_text(encoding="utf-8")).get("kind")
    margins = None
    if args.task_file is not None:
        from ..studies.circuits.spec import load_spec

        margins = load_spec(args.task_file).inference.margins  # checked before anything is read or written
    path = restate_formation(args.run_dir) if kind == "trajectory" else restate(args.run_dir, args.root, margins)
    print(f"restated: {path}")
    return 0
