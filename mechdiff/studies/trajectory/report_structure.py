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
        return [f"{r['from_step']}-{r['to_step']}" for r in rows if r["change"].split(",")[0] == v]

    if not rows:
        return f"No {what} to compare."
    changed = at("changed")
    head = f"Of {len(rows)} {what}: " + (
        f"changed beyond the within-checkpoint null at {', '.join(changed)}" if changed else "no change shown"
    )
    sizes = [
        (r.get("null_minus_cross"), r.get("null_minus_cross_high")) for r in rows if r["change"].startswith("changed")
    ]
    if sizes and margin is not None and all(v is not None and h is not None and h < margin for v, h in sizes):
        head += (
            f" (by {min(v for v, _ in sizes):.3f} to {max(v for v, _ in sizes):.3f} Jaccard, each 95% interval "
            f"below the {margin:g} margin: changes shown, and smaller than the margin)"
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


def between_cols(b: dict, margin: Optional[float]) -> dict:
    """ "Within a run minus between runs" of a between-run row: over prompts (the runs fixed) with its verdict,
    and over seeds (the jackknife over runs, t on runs - 1 df, with its p)."""
    if "null_minus_between" not in b:  # a record made before the paired test
        return {}
    seeds = b["over_runs"]["null_minus_between"]
    return {
        **cols("within_minus_between", b["null_minus_between"]),
        "runs_differ": verdict(b, margin).replace("changed", "differ", 1),
        **cols("over_seeds", seeds if seeds["low"] is not None else None),
        "p_over_seeds": seeds["p"],
    }


def runs_sentence(same: list[dict], matched: list[dict], margin: Optional[float], tests: list[dict]) -> str:
    """What the between-run comparisons show: over prompts (the runs fixed), where the runs differ beyond one
    run's halves, are the same within the margin, or neither; over seeds, where the Holm-adjusted t test rejects."""

    def name(r: dict) -> str:
        return f"step {r['step']}" if "step" in r else r["level"]

    def where(rows: list[dict], v: str) -> list[str]:
        return [name(r) for r in rows if str(r.get("runs_differ")).split(",")[0] == v]

    rows = same + matched
    if not rows or "runs_differ" not in rows[0]:
        return ""
    verdicts = [("differ", "the runs differ by more than one run's two halves do (within minus between above 0)")]
    if margin is not None:  # sameness only against a stated margin
        verdicts.append((f"same within {margin:g}", f"they are the same within {margin:g}"))
    parts = []
    for v, text in [*verdicts, ("not shown", "neither is shown")]:
        at = where(rows, v)
        if at:
            parts.append(f"{text} at {', '.join(at)}")
    small = [name(r) for r in rows if str(r.get("runs_differ")).startswith("differ, within")]
    if small:  # a difference shown whose 90% interval also lies inside the margin
        parts.append(f"at {', '.join(small)} by less than the margin (90% interval inside it)")
    head = "Over prompts, with these runs fixed (95% interval, each comparison on its own): " + "; ".join(parts) + "."
    if not tests:
        return head + " Over seeds: no interval (fewer than three runs)."
    shown = [name(r) for r in tests if r["p_holm_over_seeds"] < 0.05]
    return (
        head + f" Over seeds (the {tests[0]['runs']} runs a sample of seeds: jackknife over runs, t on "
        f"{tests[0]['runs'] - 1} df; family 'between runs (over seeds)', Holm over {len(tests)}): "
        + (f"within minus between lies above 0 at {', '.join(shown)}." if shown else "no difference is shown.")
    )


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
            + self.runs_section()
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

    def accuracy_of(self, c: str) -> float:
        """Held-out accuracy of a checkpoint of this run or of another run."""
        rec = self.r["accuracy"].get(c) or self.r["runs"]["accuracy"][c]
        return rec.result["accuracy"]["value"]

    def runs_rows(self, between: dict) -> list[dict]:
        """The between-run null at each step read: the runs' accuracy, the overlap of their circuits, and "within a
        run minus between runs" over prompts and over seeds."""
        margin = self.between_record().get("margin")
        rows = []
        for s, n in zip(self.steps, self.names):
            if n not in between:
                continue
            b = between[n]
            rows.append(
                {
                    "step": s,
                    "runs": len(b["runs"]),
                    "accuracy_this_run": self.accuracy_of(n),
                    "accuracy_other_runs": " ".join(f"{self.accuracy_of(o):.3f}" for o in b["runs"][1:]),
                    **cols("between_runs_overlap", b["overlap"]),
                    **spread_cols("between_runs", b["overlap"]),
                    **cols("within_run_null", b["null"]),
                    **between_cols(b, margin),
                }
            )
        return rows

    def matched_rows(self, rec: dict) -> list[dict]:
        """The runs compared at matched accuracy: per level, each run's first step read at or above it."""
        margin = rec.get("margin")
        rows = []
        for m in rec.get("matched_runs", []):
            rows.append(
                {
                    "level": m["level"],
                    "runs": len(m["runs"]),
                    "steps": " ".join(c.rsplit("@", 1)[1] for c in m["runs"]),
                    "accuracies": " ".join(f"{self.accuracy_of(c):.3f}" for c in m["runs"]),
                    **cols("between_runs_overlap", m["overlap"]),
                    **cols("within_run_null", m["null"]),
                    **between_cols(m, margin),
                }
            )
        return rows

    def between_record(self) -> dict:
        """The structure record the between-run comparisons are read from: the steps read on their own (more)
        ranking prompts where the record has them (`dense`), else the prompts every checkpoint shares."""
        st = self.r["structure"].result
        return st.get("dense") or st

    def runs_findings(self) -> str:
        """The README's between-run section ('' where the study read no other run)."""
        rec = self.between_record()
        same, matched, tests = self.between_tables()
        if not same:
            return ""
        return (
            "## Findings: the between-run null\n\n"
            f"Other runs of the recipe ({len(self.s.st.runs.dirs)} more seeds), on the {rec['prompts']} ranking "
            "prompts of the steps read (`tables/structure_runs.md`, `tables/structure_matched.md`); `beyond_runs` "
            "above: a change larger than the runs of the recipe differ by at that step. "
            + runs_sentence(same, matched, rec.get("margin"), tests)
            + "\n\n"
            + to_markdown(same)
            + "\n\n"
            + (to_markdown(matched) + "\n\n" if matched else "")
        )

    def between_tables(self) -> tuple[list[dict], list[dict], list[dict]]:
        """The between-run rows at the same step and at matched accuracy (`between_record`), and those of them
        with an over-seeds test, its p Holm-adjusted across both (`seeds_tests`)."""
        rec = self.between_record()
        between = {b["checkpoint"]: b for b in rec.get("between_runs", [])}
        same, matched = self.runs_rows(between), self.matched_rows(rec)
        return same, matched, self.seeds_tests(same + matched)

    @staticmethod
    def seeds_tests(rows: list[dict]) -> list[dict]:
        """The over-seeds t tests of "within a run minus between runs" (jackknife over runs), one per row that
        has one, Holm-adjusted together: the family 'between runs (over seeds)'."""
        from ...common.inference import holm

        tested = [r for r in rows if r.get("p_over_seeds") is not None]
        for r, p in zip(tested, holm([r["p_over_seeds"] for r in tested]) if tested else []):
            r["p_holm_over_seeds"] = float(p)
        return tested

    def runs_section(self) -> str:
        """The between-run null's tables and what they say ('' where the study read no other run)."""
        same, matched, tests = self.between_tables()
        if not same:
            return ""
        rec = self.between_record()
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
            "step). Within a run minus between runs (the runs' mean null less their mean overlap, paired by "
            "split) is read two ways: over prompts with these runs fixed (`runs_differ`: 'differ' where its 95% "
            "interval lies above 0, 'same within' the margin where its 90% interval lies inside it), and over "
            "seeds, the runs a sample of the recipe's seeds (`over_seeds`: the leave-one-run-out jackknife, t on "
            "runs - 1 degrees of freedom, its p Holm-adjusted across the rows of both tables, family 'between "
            "runs (over seeds)'). Runs that learn at other speeds are compared at matched accuracy too: each "
            "run's first step read at or above an accuracy (`[runs] levels`). "
            + runs_sentence(same, matched, rec.get("margin"), tests)
            + "\n\n"
            + self.table(
                same,
                "structure_runs",
                "Between-run null at the same step: held-out accuracy of this run and of the others (their "
                "intervals: `tables/accuracy.md`, `outcomes.json`), the overlap of top-n pair sets between runs "
                "beside the runs' mean within-checkpoint null, and within minus between over prompts and over "
                f"seeds (on the {rec['prompts']} ranking prompts of the steps read; " + interval_text(rec) + ")",
            )
            + "\n"
            + (
                self.table(
                    matched,
                    "structure_matched",
                    "Between-run null at matched accuracy: each run at its first step read at or above the level "
                    "(steps and accuracies in run order: this run, then `[runs] dirs`), as at the same step",
                )
                + "\n"
                if matched
                else ""
            )
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
