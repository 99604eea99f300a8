"""The trajectory report's roles section (where the study ran the roles stage, ``[roles]``): role membership over
the steps from single-head scores, or from DCM over seeds in each checkpoint."""

from __future__ import annotations

from ...report.figures import band_figure
from ...report.tables import write_table
from .report_parts import ReportPart


class RolesReport(ReportPart):
    #: The README's roles section (roles by DCM only: '' until `dcm_roles` writes it).
    readme = ""

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
        self.readme = (
            "## Findings: roles over the steps\n\n"
            f"DCM trained {r.seeds} times in each of steps {', '.join(map(str, steps))} at one absolute sparsity "
            f"weight ({r.lam}); a head is selected where {r.votes} of the {r.seeds} masks select it, and a group holds "
            f"a role where its selection beats the unpatched floor and {r.n_random} layer-matched random head sets, "
            "both paired and Holm-adjusted in the family 'roles' (`tables/role_dcm.md`, `tables/role_tests.md`).\n\n"
            + "\n".join(role_sentences(steps, per_step, moves))
            + "\n\n"
        )
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
