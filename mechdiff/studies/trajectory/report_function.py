"""The trajectory report's function sections: accuracy, each checkpoint's circuits scored in every checkpoint,
CMAP into the first checkpoint and semantic patching of the DCM-labelled heads."""

from __future__ import annotations

from pathlib import Path
from typing import Sequence

import numpy as np

from ...circuits.circuit import Circuit
from ...methods.trajectory import against_first, membership
from ...report.figures import band_figure
from .report_parts import ReportPart, cols, row_est


def accuracy_sentence(rows: list[dict]) -> str:
    """Where accuracy differs from the first checkpoint's (paired 95% interval of the difference off 0), and the
    step from which every later checkpoint stays above (or below) it, from the accuracy table's rows."""

    def side(r: dict) -> int:
        if r["minus_first"] is None:
            return 0
        return 1 if r["minus_first_low"] > 0 else -1 if r["minus_first_high"] < 0 else 0

    sides = [side(r) for r in rows[1:]]
    first = rows[0]
    ci = f"[{first['accuracy_low']:.3f}, {first['accuracy_high']:.3f}]"
    text = f"Step {first['step']} answers {first['accuracy']:.3f} {ci}. "
    off = [r["step"] for r, x in zip(rows[1:], sides) if x]
    if not off:
        return text + "No later checkpoint's accuracy differs from it (every paired 95% interval contains 0)."
    above, below = ([str(r["step"]) for r, x in zip(rows[1:], sides) if x == sign] for sign in (1, -1))
    last = sides[-1]
    k = len(sides)
    while k > 0 and sides[k - 1] == last:
        k -= 1
    r = rows[-1]
    parts = [
        f"{word} it at step{'s' if len(at) > 1 else ''} {', '.join(at)}"
        for word, at in (("above", above), ("below", below))
        if at
    ]
    where = "Accuracy lies " + " and ".join(parts) + " (paired 95% interval of the difference off 0)"
    if not last:
        return text + where + "; the last checkpoint's difference contains 0."
    return (
        text + where + f"; it stays {'above' if last > 0 else 'below'} step {first['step']}'s from step "
        f"{rows[k + 1]['step']} on (the last: {r['minus_first']:+.3f} [{r['minus_first_low']:+.3f}, "
        f"{r['minus_first_high']:+.3f}])."
    )


class FunctionReport(ReportPart):
    """Accuracy, circuits, CMAP and semantic patching: a section each."""

    def accuracy(self) -> None:
        acc = [self.r["accuracy"][n].result for n in self.names]
        diff = against_first([a["correct"] for a in acc])
        rows = [
            {"step": s, "checkpoint": n, **cols("accuracy", a["accuracy"]), **cols("minus_first", d)}
            for s, n, a, d in zip(self.steps, self.names, acc, diff)
        ]
        self.accuracy_rows = rows
        fig = band_figure(
            self.steps,
            {"accuracy": [a["accuracy"] for a in acc]},
            self.dir / "figures" / "accuracy.png",
            "held-out accuracy (exact binomial 95% CI)",
            "accuracy",
        )
        self.sections.append(
            "## Accuracy\n\n"
            + self.table(
                rows,
                "accuracy",
                "Held-out accuracy per checkpoint "
                "(exact binomial 95% CI) and its paired difference from the first checkpoint (bootstrap)",
            )
            + "\n"
            + self.figure(fig, "accuracy against the step")
        )

    def circuits(self) -> None:
        own = [self.r["circuits"][n].result for n in self.names]
        scores = [self.r["scores"][n].result for n in self.names]
        rows = []
        for s, n, o, sc in zip(self.steps, self.names, own, scores):
            rows.append(
                {
                    "step": s,
                    "checkpoint": n,
                    "n_pairs": o["n_pairs"],
                    "n_heads": o["n_heads"],
                    "reached_target": o["reached_target"],
                    **cols("faithfulness_curve", o["faithfulness"]),
                    **cols("final_circuit", row_est(sc["rows"]["final"], "faithfulness")),
                    **cols("first_trained_circuit", row_est(sc["rows"]["first trained"], "faithfulness")),
                    **cols("own_circuit", row_est(sc["rows"]["own"], "faithfulness")),
                }
            )
        series = {
            label: [row_est(sc["rows"][key], "faithfulness") for sc in scores]
            for label, key in (
                ("final circuit", "final"),
                ("first trained circuit", "first trained"),
                ("own circuit", "own"),
            )
        }
        fig = band_figure(
            self.steps,
            series,
            self.dir / "figures" / "circuits_faithfulness.png",
            "faithfulness F(C)/F(M) of each circuit in every checkpoint (bootstrap 95% CI)",
            "faithfulness",
            zero=True,
        )
        size = band_figure(
            self.steps,
            {"own circuit (faithfulness on the curve's prompts)": [o["faithfulness"] for o in own]},
            self.dir / "figures" / "own_circuit_faithfulness.png",
            "each checkpoint's own circuit at the target: faithfulness where it was chosen",
            "faithfulness",
        )
        mem = membership_figure(
            self.steps,
            [Circuit.from_dict(o["circuit"]) for o in own],
            self.dir / "figures" / "membership.png",
            "each checkpoint's own circuit: heads per (position class, layer)",
        )
        d = self.s.st.discovery
        self.sections.append(
            "## Circuits\n\n"
            + self.table(
                rows,
                "circuits",
                (
                    f"Each checkpoint's own circuit at the target (faithfulness >= {d.target}, '{d.select}' rule, on "
                    f"{d.curve_n} curve prompts) with its size; the final, first trained and own circuits scored in "
                    f"each checkpoint on {self.s.st.scoring.n} other prompts (faithfulness F(C)/F(M), bootstrap 95% CI)"
                ),
            )
            + "\n"
            + self.figure(fig, "faithfulness of the circuits against the step")
            + "\n"
            + self.figure(size, "own circuit's faithfulness at its chosen size")
            + "\n"
            + self.figure(mem, "membership: pairs of each own circuit by position class and layer")
        )

    def cmap(self) -> None:
        recs = [None] + [self.r["cmap"][n].result for n in self.names[1:]]
        keys = next((list(r["gain"]) for r in recs if r and "gain" in r), [])
        if not keys:
            self.sections.append("## CMAP\n\nskipped: " + next((r.get("skipped", "") for r in recs if r), ""))
            return
        rows = []
        for s, n, r in zip(self.steps, self.names, recs):
            row: dict = {"step": s, "checkpoint": n}
            for k in keys:
                row.update(cols(f"gain {k}", r["gain"][k] if r else None))
            rows.append(row)
        fig = band_figure(
            self.steps,
            {k: [r["gain"][k] if r else None for r in recs] for k in keys},
            self.dir / "figures" / "cmap_gain.png",
            "CMAP gain: each group's activations from the checkpoint patched into the first (paired bootstrap 95% CI)",
            "accuracy gain",
            zero=True,
        )
        self.sections.append(
            "## CMAP into the first checkpoint\n\n"
            + self.table(
                rows,
                "cmap",
                "CMAP of the final circuit's groups (group/part) from each checkpoint into the first: "
                "patched accuracy minus the first's own, paired over prompts (bootstrap 95% CI)",
            )
            + "\n"
            + self.figure(fig, "CMAP gain against the step")
        )

    def semantic(self) -> None:
        per = [self.r["semantic"][n].result["rows"] for n in self.names]
        keys = [(x["group"], x["desideratum"]) for x in per[0]]
        if not keys:
            self.sections.append("## Semantic patching\n\nno DCM selection to patch")
            return
        rows, series = [], {}
        for g, des in keys:
            got = [next(x for x in p if (x["group"], x["desideratum"]) == (g, des)) for p in per]
            diff = against_first([x["outcomes"] for x in got])
            series[f"{g} {des}"] = [x["accuracy"] for x in got]
            for s, _name, x, d in zip(self.steps, self.names, got, diff):
                rows.append(
                    {
                        "group": g,
                        "desideratum": des,
                        "step": s,
                        **cols("accuracy", x["accuracy"]),
                        **cols("floor", x["floor"]),
                        **cols("minus_first", d),
                    }
                )
        fig = band_figure(
            self.steps,
            series,
            self.dir / "figures" / "semantic.png",
            "semantic patching of the DCM-labelled heads (exact binomial 95% CI)",
            "target accuracy",
        )
        src = self.r["dcm"].result["source"]
        sel = [
            {
                "group": x["group"],
                "desideratum": x["desideratum"],
                "position": x["position"],
                "selected": " ".join(x["selected"]) or "-",
                "dropped (test accuracy not above the floor)": " ".join(x.get("dropped", [])) or "-",
            }
            for x in self.r["dcm"].result["dcm"]
        ]
        self.sections.append(
            "## Semantic patching of the DCM-labelled heads\n\n"
            + self.table(sel, "dcm_labels", f"DCM selections ({src})")
            + "\n"
            + self.table(
                rows,
                "semantic",
                "Target accuracy with each selection patched source -> base in every checkpoint (exact "
                "binomial 95% CI), the unpatched floor, and the paired difference from the first checkpoint",
            )
            + "\n"
            + self.figure(fig, "semantic patching against the step")
        )


def membership_figure(steps: Sequence[int], circuits: Sequence[Circuit], path: str | Path, title: str = "") -> Path:
    """One panel per step: position classes (rows) by layers (columns), how many of the layer's heads at that class
    the checkpoint's own circuit keeps (`membership`)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    from ...common.io import save_figure

    cells = membership(circuits)
    classes = list(dict.fromkeys(pos for pos, _ in cells))
    n_layers = 1 + max((layer for _, layer in cells), default=0)
    vmax = max((max(v) for v in cells.values()), default=1)
    fig, axes = plt.subplots(
        1, len(steps), figsize=(1.6 * len(steps) + 2.5, 0.25 * len(classes) + 1.6), sharey=True, squeeze=False
    )
    for i, (step, ax) in enumerate(zip(steps, axes[0])):
        grid = np.zeros((len(classes), n_layers))
        for (pos, layer), counts in cells.items():
            grid[classes.index(pos), layer] = counts[i]
        im = ax.imshow(grid, cmap="Greens", aspect="auto", interpolation="nearest", vmin=0, vmax=vmax)
        ax.set_title(f"step {step}: {int(grid.sum())} pairs", fontsize=7)
        ax.set_xlabel("layer", fontsize=7)
        ax.tick_params(labelsize=6)
        ax.set_yticks(range(len(classes)))
        ax.set_yticklabels(classes, fontsize=6)
    fig.suptitle(title, fontsize=9)
    fig.colorbar(im, ax=list(axes[0]), label="heads in the circuit")
    return save_figure(fig, path)
