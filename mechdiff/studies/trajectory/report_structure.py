"""The trajectory report's structure section: the within-checkpoint null, consecutive changes and changes against
the final checkpoint, the overlap matrix, the between-run null and the steps it reads on their own prompts."""

from __future__ import annotations

from pathlib import Path
from typing import Optional, Sequence

import numpy as np

from ...circuits.circuit import Circuit
from ...methods.structure import jaccard
from ...report.figures import band_figure
from ...report.tables import to_markdown
from .report_parts import ReportPart, beyond_cols, cols, interval_text, spread_cols, verdict


def structure_sentence(rows: list[dict], margin: Optional[float], what: str = "consecutive checkpoints") -> str:
    """What the structure rows (``from_step``, ``to_step``, ``change``: `verdict`) show, in one sentence: the
    changes, the pairs shown the same within the margin, and those neither (not shown: no claim either way)."""

    def at(v: str) -> list[str]:
        return [f"{r['from_step']}-{r['to_step']}" for r in rows if r["change"] == v]

    if not rows:
        return f"No {what} to compare."
    changed = at("changed")
    head = f"Of {len(rows)} {what}: " + (
        f"changed beyond the within-checkpoint null at {', '.join(changed)}" if changed else "no change shown"
    )
    if margin is None:
        return head + " (no equivalence margin in this record, so no sameness is claimed)."
    same = at(f"same within {margin:g}")
    rest = at("not shown")
    parts = [
        f"the same within {margin:g} (Jaccard; 90% interval over prompts inside the margin) at {', '.join(same)}"
        if same
        else f"none shown the same within {margin:g}",
    ]
    if rest:
        parts.append(f"neither a change nor sameness shown at {', '.join(rest)}")
    return head + "; " + "; ".join(parts) + "."


class StructureReport(ReportPart):
    """The structure section, and the rows the README's structure findings read."""

    def change_rows(self, st: dict, steps: dict[str, int], entered: bool = True) -> list[dict]:
        """One row per consecutive change of the structure record ``st`` (``steps``: checkpoint -> step)."""
        margin, runs = st.get("margin"), bool(st.get("between_runs"))
        rows = []
        for c in st["consecutive"]:
            row = {
                "from_step": steps[c["from"]],
                "to_step": steps[c["to"]],
                **cols("cross_overlap", c["cross"]),
                **cols("null_minus_cross", c["null_minus_cross"]),
                **spread_cols("null_minus_cross", c["null_minus_cross"]),
                "change": verdict(c, margin),
                **beyond_cols(c, runs, margin),
            }
            if entered:
                row.update(pairs_entered=" ".join(c["entered"]) or "-", pairs_left=" ".join(c["left"]) or "-")
            rows.append(row)
        return rows

    def structure(self) -> None:
        st = self.r["structure"].result
        steps = dict(zip(self.names, self.steps))
        null_rows = [
            {"step": s, "checkpoint": n, **cols("null_overlap", st["null"][n]), **spread_cols("null", st["null"][n])}
            for s, n in zip(self.steps, self.names)
        ]
        change_rows = self.change_rows(st, steps)
        series = {
            "within-checkpoint null (disjoint halves)": [st["null"][n] for n in self.names],
            "cross overlap with the previous checkpoint": [None] + [c["cross"] for c in st["consecutive"]],
            "cross overlap with the final checkpoint": [c["cross"] for c in st["against_final"]] + [None],
        }
        between = {b["checkpoint"]: b for b in st.get("between_runs", [])}
        if between:
            series["between runs of the recipe (same step)"] = [
                between[n]["overlap"] if n in between else None for n in self.names
            ]
        how = interval_text(st)
        fig = band_figure(
            self.steps,
            series,
            self.dir / "figures" / "structure.png",
            f"overlap (Jaccard) of top-{st['n_pairs']} pair sets on disjoint prompt halves (mean over "
            f"{st['draws']} splits; {how.split(':')[0]})",
            "overlap",
        )
        matrix = overlap_figure(
            self.steps,
            st["matrix"]["overlap"],
            self.dir / "figures" / "overlap_matrix.png",
            f"mean overlap (Jaccard) of top-{st['n_pairs']} pair sets on opposite halves; diagonal: the null",
        )
        margin = st.get("margin")
        self.sections.append(
            "## Structure against the within-checkpoint null\n\n"
            f"Each of {st['draws']} draws splits the {st.get('prompts', self.s.st.discovery.n)} ranking prompts (those "
            f"every checkpoint shares) into two disjoint random halves; the top {st['n_pairs']} pairs of each half are "
            "two discoveries of one checkpoint, and their overlap is the null below (the mean over splits). Two "
            "checkpoints are compared on the same halves (one's half A against the other's half B, both ways). Each "
            f"overlap's interval: {how}; the splits' own 95% range is given beside it as a spread. Two circuits "
            "'changed' where (mean null - cross) has its interval above 0"
            + (
                f"; they are 'the same within {margin:g}' only where its 90% interval lies inside (-{margin:g}, "
                f"{margin:g}) (two one-sided tests at 0.05); otherwise neither is shown"
                if margin is not None
                else "; no sameness is claimed (no equivalence margin in this record)"
            )
            + ". A pair 'entered' or 'left' only where its bootstrap selection frequency goes from "
            f"<= {1 - st['stable']:.2f} to >= {st['stable']:.2f} or back.\n\n"
            + structure_sentence(change_rows, margin)
            + "\n\n"
            + self.table(
                null_rows,
                "structure_null",
                f"Within-checkpoint null: overlap of two discoveries on disjoint prompts (mean over splits; {how})",
            )
            + "\n"
            + self.table(
                change_rows,
                "structure_changes",
                f"Consecutive checkpoints: cross overlap and (null - cross), paired by split ({how}), the verdict, "
                "and the pairs that changed beyond the spread of their selection frequency",
            )
            + "\n"
            + self.table(
                self.against_final_rows(),
                "structure_final",
                "Each checkpoint's circuit against the final one: Jaccard of the own circuits' pairs (each at its "
                "own size, as found; no interval) and, on disjoint halves, the cross overlap of the top-n sets and "
                f"(null - cross) ({how})",
            )
            + "\n"
            + self.table(
                matrix_rows(self.steps, st["matrix"]["overlap"]),
                "structure_matrix",
                f"Overlap matrix: mean overlap (Jaccard) of top-{st['n_pairs']} pair sets on opposite halves of every "
                "two checkpoints (row step against column step; diagonal: the within-checkpoint null; no interval)",
            )
            + "\n"
            + self.runs_section(between)
            + self.dense_section(st.get("dense"))
            + self.figure(fig, "structural null and cross overlaps against the step")
            + "\n"
            + self.figure(matrix, "overlap matrix of every two checkpoints")
        )

    def dense_section(self, dense: Optional[dict]) -> str:
        """The structure at the steps the between-run null reads, on their own (more) ranking prompts ('' where
        the record has none)."""
        if not dense:
            return ""
        steps = dict(zip(self.names, self.steps))
        how = interval_text(dense)
        between = {b["checkpoint"]: b for b in dense.get("between_runs", [])}
        rows = [
            {
                "step": steps[n],
                **cols("null_overlap", dense["null"][n]),
                **cols("between_runs_overlap", between[n]["overlap"] if n in between else None),
                **cols("runs_null", between[n]["null"] if n in between else None),
            }
            for n in dense["null"]
        ]
        changes = self.change_rows(dense, steps, entered=False)
        return (
            f"\n### At the steps the between-run null reads, on {dense['prompts']} ranking prompts\n\n"
            "The same statistics on the ranking prompts these steps (and the other runs there) share: halves of "
            f"{dense['prompts'] // 2}, so the null is the overlap of two discoveries on that many prompts. "
            + structure_sentence(changes, dense.get("margin"), "consecutive steps read")
            + "\n\n"
            + self.table(rows, "structure_dense_null", f"Null and between-run overlap at the steps read ({how})")
            + "\n"
            + (
                self.table(
                    changes,
                    "structure_dense_changes",
                    f"Consecutive steps read: (null - cross) and the between-run comparison ({how})",
                )
                + "\n"
                if changes
                else ""
            )
        )

    def runs_rows(self, between: dict) -> list[dict]:
        """The between-run null at each step read: the runs' accuracy and the overlap of their circuits."""
        rows = []
        for s, n in zip(self.steps, self.names):
            if n not in between:
                continue
            b = between[n]
            acc = {o: self.r["runs"]["accuracy"][o].result["accuracy"] for o in b["runs"][1:]}
            rows.append(
                {
                    "step": s,
                    "runs": len(b["runs"]),
                    "accuracy_this_run": self.r["accuracy"][n].result["accuracy"]["value"],
                    "accuracy_other_runs": " ".join(f"{a['value']:.3f}" for a in acc.values()),
                    **cols("between_runs_overlap", b["overlap"]),
                    **spread_cols("between_runs", b["overlap"]),
                    **cols("within_run_null", b["null"]),
                }
            )
        return rows

    def runs_findings(self) -> str:
        """The README's between-run section ('' where the study read no other run)."""
        between = {b["checkpoint"]: b for b in self.r["structure"].result.get("between_runs", [])}
        if not between:
            return ""
        return (
            "## Findings: the between-run null\n\n"
            "Other runs of the recipe at the same step (`tables/structure_runs.md`); `beyond_runs` above: a change "
            "larger than two runs of the recipe differ by at that step.\n\n"
            + to_markdown(self.runs_rows(between))
            + "\n\n"
        )

    def runs_section(self, between: dict) -> str:
        """The between-run null's table and what it says ('' where the study read no other run)."""
        if not between:
            return ""
        dirs = ", ".join(f"`{d}`" for d in self.s.st.runs.dirs)
        return (
            "\n### Between-run null\n\n"
            f"Other runs of the same recipe ({dirs}: another seed for the adapters' initialisation and the data "
            "order) read at the steps below, ranked on the same prompts. Their overlap with this run at the same step, "
            "on opposite halves as above (the mean over every two runs), is what another run of the recipe gives: "
            "a change 'beyond the runs' (tables above, `beyond_runs`) is a cross overlap whose (between-run "
            "overlap - cross), paired by split, has its interval above 0, and 'same within' the margin where its 90% "
            "interval lies inside it (a consecutive change is held against the runs at its later step, or its "
            "earlier where only that was read; a checkpoint against the final one, against the runs at the final "
            "step).\n\n"
            + self.table(
                self.runs_rows(between),
                "structure_runs",
                "Between-run null: held-out accuracy of this run and of the others (their intervals: "
                "`tables/accuracy.md`, `outcomes.json`), and the overlap of top-n pair sets between runs at the same "
                "step beside the runs' mean within-checkpoint null (" + interval_text(self.r["structure"].result) + ")",
            )
            + "\n"
        )

    def against_final_rows(self) -> list[dict]:
        """Each checkpoint but the last against the final one: the own circuits' Jaccard, and the top-n cross
        overlap beyond the null."""
        final = frozenset(Circuit.from_dict(self.r["circuits"][self.names[-1]].result["circuit"]).pairs())
        margin = self.r["structure"].result.get("margin")
        rows = []
        for s, n, c in zip(self.steps, self.names, self.r["structure"].result["against_final"]):
            own = frozenset(Circuit.from_dict(self.r["circuits"][n].result["circuit"]).pairs())
            rows.append(
                {
                    "step": s,
                    "checkpoint": n,
                    "own_circuit_jaccard": jaccard(own, final),
                    **cols("cross_overlap", c["cross"]),
                    **cols("null_minus_cross", c["null_minus_cross"]),
                    **spread_cols("null_minus_cross", c["null_minus_cross"]),
                    "against_final": verdict(c, margin),
                    **beyond_cols(c, bool(self.r["structure"].result.get("between_runs")), margin),
                }
            )
        return rows


def overlap_figure(steps: Sequence[int], overlap: Sequence[Sequence[float]], path: str | Path, title: str = "") -> Path:
    """The step-by-step overlap matrix (rows and columns: checkpoints by step), each cell written in it."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    from ...common.io import save_figure

    grid = np.asarray(overlap, dtype=float)
    size = 0.55 * len(steps) + 2
    fig, ax = plt.subplots(figsize=(size + 1, size))
    im = ax.imshow(grid, cmap="viridis", vmin=0, vmax=1, interpolation="nearest")
    for i, row in enumerate(grid):
        for j, v in enumerate(row):
            ax.text(j, i, f"{v:.2f}", ha="center", va="center", fontsize=6, color="white" if v < 0.6 else "black")
    labels = [str(s) for s in steps]
    ax.set_xticks(range(len(steps)), labels, fontsize=7)
    ax.set_yticks(range(len(steps)), labels, fontsize=7)
    ax.set_xlabel("training step")
    ax.set_ylabel("training step")
    ax.set_title(title, fontsize=8)
    fig.colorbar(im, ax=ax, label="overlap (Jaccard)")
    return save_figure(fig, path)


def matrix_rows(steps: Sequence[int], overlap: Sequence[Sequence[float]]) -> list[dict]:
    """The overlap matrix as a table: a row per step, a column per step (named by it)."""
    return [{"step": s, **{str(t): float(v) for t, v in zip(steps, row)}} for s, row in zip(steps, overlap)]
