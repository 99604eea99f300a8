"""What the trajectory report's parts share: `ReportPart` (the study, its stage records, the report's sections and
how a part writes a table or a figure into them) and the columns of an estimate, a verdict and a spread."""

from __future__ import annotations

from pathlib import Path
from typing import Any, Optional

from ...report.tables import estimate_columns, to_markdown, write_table


def cols(name: str, d: Optional[dict]) -> dict:
    return estimate_columns(name, d) if d else {name: None, f"{name}_low": None, f"{name}_high": None}


def row_est(row: dict, name: str) -> dict:
    """``{value, low, high}`` of a matrix row's ``name`` columns."""
    return {"value": row[name], "low": row[f"{name}_low"], "high": row[f"{name}_high"], "n": row.get("n_prompts", 0)}


def verdict(d: dict, margin: Optional[float]) -> str:
    """A structural difference's verdict: "changed" (its interval over prompts above 0; "changed, within M" where
    its 90% interval also lies inside the margin: a change shown, smaller than M), "same within M" (its 90%
    interval inside the equivalence margin M), else "not shown"; a record made before the margin: "changed" or
    "-" (no equivalence was tested)."""
    if d["changed"]:  # shown above 0, and where also inside the margin, said: a change smaller than the margin
        return f"changed, within {margin:g}" if margin is not None and d.get("same") else "changed"
    if margin is None or "same" not in d:
        return "-"
    return f"same within {margin:g}" if d["same"] else "not shown"


def spread_cols(name: str, est: Optional[dict]) -> dict:
    """The splits' own spread beside an interval over prompts (``name_split_spread``; none in a record made before
    the intervals resampled prompts, whose low/high are that spread)."""
    if not est or "spread_low" not in est:
        return {}
    return {f"{name}_split_spread": f"{est['spread_low']:.3f} to {est['spread_high']:.3f}"}


def beyond_cols(change: dict, runs: bool, margin: Optional[float] = None) -> dict:
    """The between-run columns of a structural change where the study read other runs (``runs``; empty where no
    other run was read at its step)."""
    b = change.get("beyond_runs")
    if not runs:
        return {}
    return {**cols("runs_minus_cross", b and b["runs_minus_cross"]), "beyond_runs": verdict(b, margin) if b else None}


def interval_text(st: dict) -> str:
    """How the structure record's intervals were made (or, for a record made before, that they are spreads)."""
    if "resamples" not in st:
        return f"95% range of {st['draws']} splits of one sample of prompts: a spread, not an interval over prompts"
    return (
        f"95% interval over prompts: {st['resamples']} resamples of the {st['prompts']} ranking prompts, each "
        f"split {st['resample_splits']} times into halves (a prompt's copies in one half), re-centred on the "
        "estimate"
    )


class ReportPart:
    """One part of the trajectory report: it appends its sections to ``sections`` (shared by every part) and writes
    its tables under ``tables/`` and figures under ``figures/`` of the study's directory."""

    def __init__(self, study: Any, results: dict, sections: list[str]):
        self.s, self.r = study, results
        self.names, self.steps = study.names, study.steps
        self.dir = study.dir
        self.sections = sections

    def table(self, rows: list[dict], stem: str, caption: str) -> str:
        write_table(rows, self.dir / "tables" / stem, caption=caption)
        return f"**{caption}** (`tables/{stem}.md`)\n\n" + to_markdown(rows) + "\n"

    def drop(self, *stems: str) -> None:
        """Remove tables an earlier run wrote that this one does not (so the page never shows a stale one)."""
        for stem in stems:
            for path in (self.dir / "tables").glob(f"{stem}.*"):
                if path.suffix in (".md", ".csv", ".tex", ".json"):
                    path.unlink()

    def figure(self, path: Path, caption: str) -> str:
        return f"![{caption}]({path.relative_to(self.dir)})\n\n*{caption}*\n"
