"""The trajectory study's tables, figures, ``report.md`` and ``README.md`` (findings), from its stage records."""

from __future__ import annotations

from pathlib import Path
from typing import Any, Optional, Sequence

import numpy as np

from ...circuits.circuit import Circuit
from ...common.io import write_text
from ...methods.trajectory import against_first, jaccard, membership
from ...report.figures import band_figure  # noqa: F401  (the trajectory report draws its bands with it)
from ...report.formation import formation, trajectory_components, write_formation
from ...report.tables import estimate_columns, to_markdown, write_table


def _cols(name: str, d: Optional[dict]) -> dict:
    return estimate_columns(name, d) if d else {name: None, f"{name}_low": None, f"{name}_high": None}


def _row_est(row: dict, name: str) -> dict:
    """``{value, low, high}`` of a matrix row's ``name`` columns."""
    return {"value": row[name], "low": row[f"{name}_low"], "high": row[f"{name}_high"], "n": row.get("n_prompts", 0)}


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


def _record(values: Sequence[float]) -> dict:
    """The compact record of per-prompt outcomes: 0/1, or (a random scope's share of right draws) ``share``."""
    from ...common.outcomes import outcome_record, rounded

    if set(values) <= {0, 1}:
        return outcome_record(values)
    return {"share": rounded(values)}


def verdict(d: dict, margin: Optional[float]) -> str:
    """A structural difference's verdict: "changed" (its interval over prompts above 0), "same within M" (its 90%
    interval inside the equivalence margin M), else "not shown"; a record made before the margin: "changed" or
    "-" (no equivalence was tested)."""
    if d["changed"]:
        return "changed"
    if margin is None or "same" not in d:
        return "-"
    return f"same within {margin:g}" if d["same"] else "not shown"


def _spread(name: str, est: Optional[dict]) -> dict:
    """The splits' own spread beside an interval over prompts (``name_split_spread``; none in a record made before
    the intervals resampled prompts, whose low/high are that spread)."""
    if not est or "spread_low" not in est:
        return {}
    return {f"{name}_split_spread": f"{est['spread_low']:.3f} to {est['spread_high']:.3f}"}


def _beyond_cols(change: dict, runs: bool, margin: Optional[float] = None) -> dict:
    """The between-run columns of a structural change where the study read other runs (``runs``; empty where no
    other run was read at its step)."""
    b = change.get("beyond_runs")
    if not runs:
        return {}
    return {**_cols("runs_minus_cross", b and b["runs_minus_cross"]), "beyond_runs": verdict(b, margin) if b else None}


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


def edge_rows(record: dict, steps: dict[str, int]) -> list[dict]:
    """The edge stage's comparisons as rows, node overlap beside edge overlap on each: consecutive steps, then each
    step against the final one; each overlap with its interval over prompts, (null - cross) with its `verdict`,
    and the `reading` (``nodes stable, edges move`` only where both intervals carry it)."""
    margin = record["margin"]
    pairs = [(c["from"], c["to"], c) for c in record["consecutive"]]
    pairs += [(c["checkpoint"], None, c) for c in record["against_final"]]
    rows = []
    for s, t, c in pairs:
        row: dict = {"against": "final" if t is None else "next", "from_step": steps[s]}
        row["to_step"] = steps[t if t is not None else list(record["null"])[-1]]
        for kind in ("nodes", "edges"):
            d = c[kind]
            row.update(
                {
                    **_cols(f"{kind}_cross", d["cross"]),
                    **_cols(f"{kind}_null_minus_cross", d["null_minus_cross"]),
                    f"{kind}_change": verdict(d, margin),
                }
            )
        rows.append({**row, "reading": c["reading"]})
    return rows


def edge_sentence(rows: list[dict]) -> str:
    """Where "nodes stable, edges move" is shown, and that it is not shown elsewhere."""
    from ...methods.edge_structure import STABLE_MOVE

    where = [f"{r['from_step']}-{r['to_step']}" for r in rows if r["reading"] == STABLE_MOVE]
    if not where:
        return f'"{STABLE_MOVE}" (Wang et al. 2025) is not shown at any of the {len(rows)} comparisons.'
    return (
        f'"{STABLE_MOVE}" (Wang et al. 2025) is shown at {", ".join(where)} (the node difference the same within the '
        "margin, the edge difference above 0, both on intervals over prompts); not shown at the other "
        f"{len(rows) - len(where)} comparisons."
    )


class _Report:
    def __init__(self, study: Any, results: dict):
        self.s, self.r = study, results
        self.names, self.steps = study.names, study.steps
        self.dir = study.dir
        self.sections: list[str] = []

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

    # -- sections -----------------------------------------------------------------------
    def accuracy(self) -> None:
        acc = [self.r["accuracy"][n].result for n in self.names]
        diff = against_first([a["correct"] for a in acc])
        rows = [
            {"step": s, "checkpoint": n, **_cols("accuracy", a["accuracy"]), **_cols("minus_first", d)}
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
                    **_cols("faithfulness_curve", o["faithfulness"]),
                    **_cols("final_circuit", _row_est(sc["rows"]["final"], "faithfulness")),
                    **_cols("first_trained_circuit", _row_est(sc["rows"]["first trained"], "faithfulness")),
                    **_cols("own_circuit", _row_est(sc["rows"]["own"], "faithfulness")),
                }
            )
        series = {
            label: [_row_est(sc["rows"][key], "faithfulness") for sc in scores]
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
                row.update(_cols(f"gain {k}", r["gain"][k] if r else None))
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
                        **_cols("accuracy", x["accuracy"]),
                        **_cols("floor", x["floor"]),
                        **_cols("minus_first", d),
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

    def roles(self) -> None:
        """Role membership over the steps, where the study ran the roles stage (``[roles]``)."""
        from ...common.outcomes import read_record
        from .roles import membership_rows, roles_of, score_rows, transition_rows

        got = self.r.get("roles") or {}
        if not got:
            return
        names = [n for n in self.names if n in got]  # the steps scored ([roles] steps)
        steps = [s for s, n in zip(self.steps, self.names) if n in got]
        records = [got[n].result for n in names]
        if records[0].get("method") == "dcm":
            self.dcm_roles(records, steps)
            return
        roles, t = roles_of(records), self.s.st.roles.threshold
        if not roles:
            self.sections.append("## Roles over the steps\n\nno head in the groups scored")
            return
        floor = [
            {"desideratum": d, "step": s, "floor": float(read_record(rec["floor"][d]["outcomes"])[0].mean())}
            for d in records[0]["floor"]
            for s, rec in zip(steps, records)
        ]
        write_table(score_rows(roles, steps, t), self.dir / "tables" / "role_scores", caption="role scores")
        moves = transition_rows(roles, steps, t)
        self.sections.append(
            "## Roles over the steps\n\n"
            f"Each head of the groups scored alone: its output at the group's position patched from each pair's "
            f"counterfactual prompt into the base run, the share of {self.s.st.roles.n} pairs per desideratum whose "
            f"patched run gives the desideratum's target (exact binomial 95% CI; every head and step in "
            f"`tables/role_scores.md`). A head holds a role where that share's lower bound exceeds {t}. Single heads, "
            "not DCM's jointly trained masks: a role only several heads together carry shows in none.\n\n"
            + self.table(membership_rows(roles, steps, t), "roles", "Heads holding each role at each step")
            + "\n"
            + self.transitions(moves)
            + "\n"
            + self.table(floor, "role_floor", "Share of pairs whose unpatched base run already gives the target")
        )

    def transitions(self, moves: list[dict]) -> str:
        """The table of heads that join, leave or take over a role (``tables/role_transitions``), or a line saying
        none does."""
        self.drop("role_takeovers")  # what runs wrote before joins, leaves and takeovers were named
        if not moves:
            self.drop("role_transitions")
            return "No head joins, leaves or takes over a role between the steps scored.\n"
        return self.table(
            moves,
            "role_transitions",
            "Heads that join a role (hold it at a step and not at the step before), leave it, or take it over (join "
            "where another head leaves the same role at the same step; others: the heads it takes over from, or "
            "that take over from it). A head that joins with nothing held before it joins; it takes nothing over",
        )

    def dcm_roles(self, records: list[dict], steps: list[int]) -> None:
        """Roles from DCM over seeds in each scored checkpoint (``[roles] method = "dcm"``,
        `dcm_seeds`): the "roles" family, each step's selection and tests, the heads'
        selection frequencies, membership, and what joins, leaves or takes over, in a table and in sentences."""
        from ...report.claims import family_rows
        from .roles import (
            frequency_rows,
            membership_rows,
            role_sentences,
            roles_family,
            seeded_roles,
            seeded_rows,
            seeded_step_rows,
            transition_rows,
        )

        rows = seeded_rows(records, steps)
        tests = roles_family(rows)
        roles, per_step = seeded_roles(rows, steps, tests), seeded_step_rows(rows, tests)
        moves = transition_rows(roles, steps, 0.5)
        self.drop("role_tests", "role_frequency")
        if tests:
            write_table(family_rows(tests), self.dir / "tables" / "role_tests", caption="the roles family")
        freq = frequency_rows(rows, steps)
        series = {
            f"{g} {ds}": [
                next(
                    (
                        {"value": x["test_accuracy"], "low": x["test_accuracy_low"], "high": x["test_accuracy_high"]}
                        for x in per_step
                        if (x["group"], x["desideratum"], x["step"]) == (g, ds, s)
                    ),
                    None,
                )
                for s in self.steps
            ]
            for g, ds in dict.fromkeys((x["group"], x["desideratum"]) for x in per_step)
        }
        fig = band_figure(
            self.steps,
            series,
            self.dir / "figures" / "role_dcm.png",
            "DCM over seeds in each checkpoint: target accuracy with its selection patched (exact binomial 95% CI)",
            "target accuracy",
        )
        r, d = self.s.st.roles, self.s.st.dcm
        self.sections.append(
            "## Roles over the steps (DCM over seeds in each checkpoint)\n\n"
            f"DCM trained in each of steps {', '.join(map(str, steps))} over every head any checkpoint's own circuit "
            f"has in each group ({d.n_train} training, {d.n_val} validation and {d.n_test} test pairs a "
            f"desideratum, {d.epochs} epochs), with one absolute sparsity weight at every step (lambda = {r.lam}), "
            f"{r.seeds} times (seed 0 on DCM's own split, each other seed on the training and validation pairs "
            "redrawn; the test pairs the same). A head is in the step's selection where at least "
            f"{r.votes} of the {r.seeds} masks select it. The group **holds** the role at the step where its "
            "selection, patched on the test pairs, beats both the unpatched floor (exact McNemar) and "
            f"{r.n_random} random head sets of the selection's layers (on each pair's share of draws giving the "
            "target: the sign-flip test over pairs, exact McNemar where every share is 0 or 1), each paired and "
            'Holm-adjusted in the "roles" family (`tables/role_tests.md`, per-pair outcomes in `outcomes.json`); '
            "the heads holding it are then the selection.\n\n"
            + "\n".join(role_sentences(steps, per_step, moves))
            + "\n\n"
            + self.table(
                per_step,
                "role_dcm",
                "Each role and step: the selection (seeds selecting each head), "
                "test accuracy and floor (exact binomial 95% CI), the random heads' mean, the paired "
                "differences with their Holm p, and whether the group holds the role",
            )
            + "\n"
            + self.table(membership_rows(roles, steps, 0.5), "roles", "Heads holding each role at each step (DCM)")
            + "\n"
            + self.transitions(moves)
            + "\n"
            + (
                self.table(
                    freq,
                    "role_frequency",
                    "Selection frequency: of the seeds' masks, how many select each head at each step (heads some "
                    "seed selects)",
                )
                if freq
                else "No seed's mask selects a head at any step.\n"
            )
            + "\n"
            + self.figure(fig, "the selections' target accuracy against the step")
        )

    def change_rows(self, st: dict, steps: dict[str, int], entered: bool = True) -> list[dict]:
        """One row per consecutive change of the structure record ``st`` (``steps``: checkpoint -> step)."""
        margin, runs = st.get("margin"), bool(st.get("between_runs"))
        rows = []
        for c in st["consecutive"]:
            row = {
                "from_step": steps[c["from"]],
                "to_step": steps[c["to"]],
                **_cols("cross_overlap", c["cross"]),
                **_cols("null_minus_cross", c["null_minus_cross"]),
                **_spread("null_minus_cross", c["null_minus_cross"]),
                "change": verdict(c, margin),
                **_beyond_cols(c, runs, margin),
            }
            if entered:
                row.update(pairs_entered=" ".join(c["entered"]) or "-", pairs_left=" ".join(c["left"]) or "-")
            rows.append(row)
        return rows

    def interval_text(self, st: dict) -> str:
        """How the structure record's intervals were made (or, for a record made before, that they are spreads)."""
        if "resamples" not in st:
            return f"95% range of {st['draws']} splits of one sample of prompts: a spread, not an interval over prompts"
        return (
            f"95% interval over prompts: {st['resamples']} resamples of the {st['prompts']} ranking prompts, each "
            f"split {st['resample_splits']} times into halves (a prompt's copies in one half), re-centred on the "
            "estimate"
        )

    def structure(self) -> None:
        st = self.r["structure"].result
        steps = dict(zip(self.names, self.steps))
        null_rows = [
            {"step": s, "checkpoint": n, **_cols("null_overlap", st["null"][n]), **_spread("null", st["null"][n])}
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
        how = self.interval_text(st)
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

    def edges(self) -> None:
        """Edges beside nodes (``[edges]``): each checkpoint's top-n edges of the EAP graph and their nodes, compared
        across the scored steps; nothing where the study did not run the edge stages."""
        rec = self.r.get("edges")
        if rec is None:
            self.drop("edges_null", "edges_nodes")
            return
        st, steps = rec.result, dict(zip(self.names, self.steps))
        null_rows = [
            {
                "step": steps[c],
                "nodes_in_top": len(st["top"][c]["nodes"]),
                **_cols("nodes_null", st["null"][c]["nodes"]),
                **_cols("edges_null", st["null"][c]["edges"]),
            }
            for c in st["null"]
        ]
        rows = edge_rows(st, steps)
        e, how = self.s.st.edges, self.interval_text(st)
        g = st["graph"]
        self.edge_readme = edge_sentence(rows)
        self.sections.append(
            "## Edges beside nodes\n\n"
            f"The EAP edge graph ({g['n_edges']} edges among the embeddings, {g['n_layers']} x {g['n_heads']} heads, "
            f"{g['n_layers']} MLPs and the logits; position-free) scored per prompt by {e.method} on the "
            f"{st['prompts']} ranking prompts the node circuits rank on, with their metric and their mean ablation "
            "(each sender's position-wise mean over the reference prompts of the prompt's template and length). On "
            f"any set of prompts a checkpoint's discovery is its top {st['top_n']} edges by |mean attribution| and "
            "their nodes (the heads and MLPs they leave or enter). Edges and nodes are compared exactly as the node "
            f"structure compares pairs: the null from disjoint halves ({st['draws']} splits), the cross overlap on "
            f"opposite halves, (null - cross) paired by split; intervals: {how}; 'changed' and 'same within "
            f"{st['margin']:g}' as above.\n\n"
            + edge_sentence(rows)
            + "\n\n"
            + self.table(
                null_rows,
                "edges_null",
                "Within-checkpoint null of the top-n edges and of their nodes, and how many nodes the top-n edges "
                f"of all the prompts touch ({how})",
            )
            + "\n"
            + self.table(
                rows,
                "edges_nodes",
                "Node overlap beside edge overlap: consecutive steps, then each step against the final one; cross "
                f"overlap and (null - cross) of each ({how}), their verdicts, and the reading",
            )
        )

    def dense_section(self, dense: Optional[dict]) -> str:
        """The structure at the steps the between-run null reads, on their own (more) ranking prompts ('' where
        the record has none)."""
        if not dense:
            return ""
        steps = dict(zip(self.names, self.steps))
        how = self.interval_text(dense)
        between = {b["checkpoint"]: b for b in dense.get("between_runs", [])}
        rows = [
            {
                "step": steps[n],
                **_cols("null_overlap", dense["null"][n]),
                **_cols("between_runs_overlap", between[n]["overlap"] if n in between else None),
                **_cols("runs_null", between[n]["null"] if n in between else None),
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
                    **_cols("between_runs_overlap", b["overlap"]),
                    **_spread("between_runs", b["overlap"]),
                    **_cols("within_run_null", b["null"]),
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

    def edge_findings(self) -> str:
        """The README's edges section ('' where the study did not run the edge stages)."""
        if self.r.get("edges") is None:
            return ""
        return (
            "## Findings: edges beside nodes\n\n"
            + self.edge_readme
            + " Node overlap beside edge overlap on each comparison: `tables/edges_nodes.md`.\n\n"
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
                "step beside the runs' mean within-checkpoint null ("
                + self.interval_text(self.r["structure"].result)
                + ")",
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
                    **_cols("cross_overlap", c["cross"]),
                    **_cols("null_minus_cross", c["null_minus_cross"]),
                    **_spread("null_minus_cross", c["null_minus_cross"]),
                    "against_final": verdict(c, margin),
                    **_beyond_cols(c, bool(self.r["structure"].result.get("between_runs")), margin),
                }
            )
        return rows

    def formation(self) -> tuple[list[dict], list[dict]]:
        """The formation section on the change scale (`formation`) from the stages'
        per-prompt outcomes; its rows: formation per component, order per pair."""
        floors: dict[str, list[float]] = {}
        heads: dict[str, str] = {}
        for i, n in enumerate(self.names):
            for x in self.r["semantic"][n].result["rows"]:
                label = f"{x['group']}/{x['desideratum']}"
                floors.setdefault(label, [0.0] * len(self.names))[i] = x["floor"]["value"]
                heads.setdefault(label, " ".join(x["heads"]))
        got = formation(trajectory_components(self.outcomes(), self.names, floors, heads), self.steps)
        report, self.formation_readme, rows, orders = write_formation(got, self.dir)
        self.sections.insert(0, report)
        return rows, orders

    def outcomes(self) -> dict[str, dict]:
        """Every stage's per-prompt outcomes in the compact format (`mechdiff.common.outcomes`), by stage and
        label, so each interval the report states can be recomputed from ``outcomes.json``: accuracy (every
        checkpoint, the other runs' too), ``scores:<ckpt>`` (the whole model and each circuit kept alone),
        ``cmap:<ckpt>`` (the first checkpoint, the checkpoint, and the first with each group patched) and
        ``semantic:<ckpt>`` (each DCM selection patched, ``group/desideratum``) and ``roles:<ckpt>`` (roles by DCM:
        each step's selection, its floor and each random head set on the test pairs, `role_outcomes`)."""
        from ...common.outcomes import outcome_record

        runs = self.r.get("runs", {}).get("accuracy", {})
        out: dict[str, dict] = {
            "accuracy": {n: rec.result["outcomes"] for n, rec in {**self.r["accuracy"], **runs}.items()}
        }
        for n in self.names:
            sc = self.r["scores"][n].result
            out[f"scores:{n}"] = {
                "full": outcome_record(sc["full"]),
                **{k: outcome_record(v) for k, v in sc["outcomes"].items()},
            }
            cmap = self.r["cmap"].get(n)
            if cmap is not None and "outcomes" in cmap.result:
                out[f"cmap:{n}"] = {k: _record(v) for k, v in cmap.result["outcomes"].items()}
            rows = self.r["semantic"][n].result["rows"]
            if rows:
                out[f"semantic:{n}"] = {f"{x['group']}/{x['desideratum']}": outcome_record(x["outcomes"]) for x in rows}
            role = self.r.get("roles", {}).get(n)
            if role is not None and role.result.get("method") == "dcm":
                from .roles import role_outcomes

                out[f"roles:{n}"] = role_outcomes(role.result["rows"])
        return out

    def write(self) -> Path:
        from ...common.outcomes import write_outcomes

        write_outcomes(self.dir, self.outcomes())
        self.accuracy()
        self.circuits()
        self.cmap()
        self.semantic()
        self.roles()
        self.structure()
        self.edges()
        formation, ordered = self.formation()
        s = self.s
        head = (
            f"# Trajectory study: {s.task.name} over {len(self.names)} checkpoints\n\n"
            f"Checkpoints (step: name): {', '.join(f'{st}: `{n}`' for st, n in zip(self.steps, self.names))}. "
            f"The first is the reference; the first trained is `{self.names[1]}`; the final `{self.names[-1]}`. "
            "The base loaded once and the adapters swapped.\n\n"
        )
        path = write_text(self.dir / "report.md", head + "\n".join(self.sections))
        self.readme(formation, ordered)
        return path

    def missed(self) -> str:
        """The checkpoints whose own circuit missed the target at every size scored, as a sentence ('' for none)."""
        missed = [st for st, n in zip(self.steps, self.names) if not self.r["circuits"][n].result["reached_target"]]
        if not missed:
            return ""
        return (
            f"The own circuit of step{'s' if len(missed) > 1 else ''} {', '.join(map(str, missed))} did not reach "
            "the target at any size scored (the largest size stands in; `tables/circuits.md`)."
        )

    def readme(self, formation: list[dict], ordered: list[dict]) -> None:
        st = self.r["structure"].result
        changed = [
            {
                **{k: v for k, v in r.items() if k not in ("pairs_entered", "pairs_left") and "cross_overlap" not in k},
                "pairs_entered": len(c["entered"]),
                "pairs_left": len(c["left"]),
            }
            for r, c in zip(self.change_rows(st, dict(zip(self.names, self.steps))), st["consecutive"])
        ]
        self.structure_readme = structure_sentence(changed, st.get("margin"))
        final = [
            {k: v for k, v in r.items() if k not in ("cross_overlap", "cross_overlap_low", "cross_overlap_high")}
            for r in self.against_final_rows()
        ]
        stages = self.s.cache.summary()
        cost = [{"stage": k, "seconds": round(v["seconds"], 1)} for k, v in stages.items()]
        st = self.s.st
        settings = [
            {"what": w, "setting": v}
            for w, v in (
                ("checkpoints (step: name)", ", ".join(f"{s}: {n}" for s, n in zip(self.steps, self.names))),
                ("accuracy prompts", st.eval.n),
                (
                    "ranking prompts (halved for the null); at the [runs] steps",
                    f"{st.discovery.n}; {st.discovery.runs_n}",
                ),
                ("curve prompts; sizes", f"{st.discovery.curve_n}; {st.discovery.sizes}"),
                ("target faithfulness; select", f"{st.discovery.target}; {st.discovery.select}"),
                ("scoring prompts; reference prompts", f"{st.scoring.n}; {st.scoring.reference_n}"),
                ("CMAP prompts; parts; groups", f"{st.cmap.n}; {' '.join(st.cmap.parts)}; {' '.join(st.cmap.groups)}"),
                (
                    "DCM labels; semantic test pairs",
                    f"{st.dcm.labels or 'trained on the final circuit'}; {st.dcm.n_test}",
                ),
                (
                    "structure splits; prompt resamples x their splits; stable frequency; equivalence margin",
                    f"{st.structure.draws}; {st.structure.resamples} x {st.structure.resample_splits}; "
                    f"{st.structure.stable}; {st.structure.margin}",
                ),
            )
        ]
        if st.roles and st.roles.method == "dcm":
            steps = ", ".join(map(str, st.roles.steps)) or "every step"
            settings.append({"what": "roles: DCM trained in each checkpoint at steps", "setting": steps})
            r = st.roles
            settings.append(
                {
                    "what": "roles: sparsity weight (absolute, every step); seeds; votes; random head sets",
                    "setting": f"{r.lam}; {r.seeds}; {r.votes} of {r.seeds}; {r.n_random} (layer-matched)",
                }
            )
        elif st.roles:
            settings.append(
                {"what": "role pairs per desideratum; threshold", "setting": f"{st.roles.n}; {st.roles.threshold}"}
            )
        if st.edges.on:
            e = self.r["edges"].result
            steps = ", ".join(str(dict(zip(self.names, self.steps))[c]) for c in e["null"])
            what = "edges: steps; top-n edges; method; prompts"
            settings.append({"what": what, "setting": f"{steps}; {e['top_n']}; {st.edges.method}; {e['prompts']}"})
        if st.runs.dirs:
            runs = f"{', '.join(st.runs.dirs)} at steps {', '.join(map(str, st.runs.steps))}"
            settings.append({"what": "other runs of the recipe (between-run null)", "setting": runs})
        text = (
            f"# {self.dir.name}\n\nWritten by `mechdiff run {self.s.st.source}`; the full report is "
            "[report.md](report.md). Every finding is a row carried by its interval.\n\n"
            "## Findings: accuracy against the first checkpoint\n\n"
            + accuracy_sentence(self.accuracy_rows)
            + "\n\n"
            + self.formation_readme
            + "\n"
            "## Findings: structure beyond the within-checkpoint null\n\n"
            "Consecutive checkpoints, and each checkpoint against the final one (`tables/structure_final.md`; the "
            "overlap matrix of every two is `figures/overlap_matrix.png`). "
            + self.missed()
            + "\n\n"
            + self.structure_readme
            + " Intervals: "
            + self.interval_text(self.r["structure"].result)
            + ".\n\n"
            + to_markdown(changed)
            + "\n\n"
            + to_markdown(final)
            + "\n\n"
            + self.runs_findings()
            + self.edge_findings()
            + "## Settings\n\n"
            + to_markdown(settings)
            + "\n\n"
            "## Stage costs\n\nSeconds each stage took when it was computed (from `run.json`; "
            f"{sum(v['seconds'] for v in stages.values()):.0f} s in all).\n\n" + to_markdown(cost) + "\n"
        )
        write_text(self.dir / "README.md", text)


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


def write_trajectory_report(study: Any, results: dict) -> Path:
    """``report.md``, ``README.md``, ``tables/`` and ``figures/`` of a trajectory study."""
    return _Report(study, results).write()
