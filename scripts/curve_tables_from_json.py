"""Rewrite the ``curve.{csv,md,tex}`` tables of committed ``mechdiff curve`` runs from their ``curve.json``,
through the one writer of the curve table (:func:`mechdiff.report.rows.curve_rows`), without recomputing.

    python scripts/curve_tables_from_json.py results/curve-smollm2/smollm2-et results/curve-smollm2/smollm2-et-early

The caption is the one ``mechdiff curve`` writes (:func:`mechdiff.report.rows.curve_caption`); ``curve.json`` (the
run's record, which ``mechdiff curve`` writes after the table's JSON) is read, never written.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

from mechdiff.report.rows import curve_caption, curve_rows
from mechdiff.report.tables import write_table


def rewrite(out: Path) -> None:
    """The curve tables of run directory ``out`` from its ``curve.json``."""
    record = json.loads((out / "curve.json").read_text())
    curve = record["curve"]
    write_table(
        curve_rows(curve),
        out / "curve",
        formats=("md", "csv", "tex"),
        caption=curve_caption(record["model"], curve),
    )


if __name__ == "__main__":
    for arg in sys.argv[1:]:
        rewrite(Path(arg))
