"""``mechdiff view RUN_DIR``: (re)write a run directory's ``report.html`` from its files, no model loaded."""

from __future__ import annotations

import argparse


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "view",
        help="write RUN_DIR/report.html (self-contained, opens from disk) from a results "
        "directory; reads only its files, loads no model",
    )
    p.add_argument("run_dir", help="a results directory (e.g. results/entity-tracking-smollm2)")
    p.add_argument("--out", default=None, help="where to write the page (default: RUN_DIR/report.html)")
    p.set_defaults(func=main)


def main(args: argparse.Namespace) -> int:
    from ..report.html import write_html

    path = write_html(args.run_dir, args.out)
    print(f"report: {path} ({path.stat().st_size / 1e6:.2f} MB)")
    return 0
