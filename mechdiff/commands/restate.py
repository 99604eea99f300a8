"""``mechdiff restate RUN_DIR``: a circuits study's claims as families of tests from its committed files, no model
loaded (:mod:`mechdiff.report.families`)."""

from __future__ import annotations

import argparse


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "restate",
        help="write RUN_DIR/inference.md and tables/families.* (every claim a test in a named family, Holm-adjusted; "
        "intervals over items) from a circuits study's outcomes.json and run.json; loads no model",
    )
    p.add_argument("run_dir", help="a circuits study's results directory (e.g. results/capitals-smollm2)")
    p.add_argument("--root", default=".", help="the project root its task directories are under (default: .)")
    p.set_defaults(func=main)


def main(args: argparse.Namespace) -> int:
    from ..report.families import restate

    path = restate(args.run_dir, args.root)
    print(f"restated: {path}")
    return 0
