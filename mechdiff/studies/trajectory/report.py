"""The trajectory study's tables, figures, ``report.md`` and ``README.md`` (findings), from its stage records: each
section written by its part (`report_function`, `report_roles`, `report_structure`, `report_edges`), the
formation section, ``outcomes.json`` and the README here."""

from __future__ import annotations

from datetime import datetime, timezone
from pathlib import Path
from typing import Any, Sequence

from ...common.io import write_text
from ...report.formation import formation, trajectory_components, write_formation
from ...report.tables import to_markdown
from .report_edges import EdgesReport
from .report_function import FunctionReport, accuracy_sentence
from .report_parts import interval_text
from .report_roles import RolesReport
from .report_structure import StructureReport, structure_sentence


def _record(values: Sequence[float]) -> dict:
    """The compact record of per-prompt outcomes: 0/1, or (a random scope's share of right draws) ``share``."""
    from ...common.outcomes import outcome_record, rounded

    if set(values) <= {0, 1}:
        return outcome_record(values)
    return {"share": rounded(values)}


class TrajectoryReport:
    """Every part's sections in order, the formation section first, then ``report.md`` and ``README.md``."""

    def __init__(self, study: Any, results: dict):
        self.s, self.r = study, results
        self.names, self.steps = study.names, study.steps
        self.dir = study.dir
        self.sections: list[str] = []
        self.function_part = FunctionReport(study, results, self.sections)
        self.roles_part = RolesReport(study, results, self.sections)
        self.structure_part = StructureReport(study, results, self.sections)
        self.edges_part = EdgesReport(study, results, self.sections)

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
        self.function_part.accuracy()
        self.function_part.circuits()
        self.function_part.cmap()
        self.function_part.semantic()
        self.roles_part.roles()
        self.structure_part.structure()
        self.edges_part.edges()
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
            for r, c in zip(self.structure_part.change_rows(st, dict(zip(self.names, self.steps))), st["consecutive"])
        ]
        self.structure_readme = structure_sentence(changed, st.get("margin"))
        final = [
            {k: v for k, v in r.items() if k not in ("cross_overlap", "cross_overlap_low", "cross_overlap_high")}
            for r in self.structure_part.against_final_rows()
        ]
        stages = self.s.cache.summary()
        cost = [
            {"stage": k, "wall_s": round(v["seconds"], 1), "cpu_s": _round(v.get("cpu_seconds"))}
            for k, v in stages.items()
        ]
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
            + accuracy_sentence(self.function_part.accuracy_rows)
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
            + interval_text(self.r["structure"].result)
            + ".\n\n"
            + to_markdown(changed)
            + "\n\n"
            + to_markdown(final)
            + "\n\n"
            + self.structure_part.runs_findings()
            + self.roles_part.readme
            + self.edges_part.edge_findings()
            + "## Settings\n\n"
            + to_markdown(settings)
            + "\n\n"
            "## Stage costs\n\n" + cost_sentence(stages) + "\n\n" + to_markdown(cost) + "\n"
        )
        write_text(self.dir / "README.md", text)


def _round(x: float | None) -> float | None:
    return None if x is None else round(x, 1)


def cost_sentence(stages: dict[str, dict]) -> str:
    """What each stage cost when it was computed: wall seconds (which grow with whatever else shared the cores)
    and the computing process's CPU seconds (every thread's; what the stage itself needs), with their sums."""
    wall = sum(v["seconds"] for v in stages.values())
    cpu = [v.get("cpu_seconds") for v in stages.values()]
    known = [c for c in cpu if c is not None]
    text = (
        f"Wall seconds each stage took when it was computed, and the CPU seconds of the process that computed it "
        f"(from `run.json`; {wall:.0f} s of wall time"
    )
    if known:
        text += f" and {sum(known):.0f} s of CPU time in all"
        if len(known) < len(cpu):
            text += f" over the {len(known)} of {len(cpu)} stages whose records keep it"
    text += (
        "). Stages computed side by side in several processes add their wall seconds here, so the sum exceeds "
        "the run's elapsed time; CPU seconds do not depend on what else ran."
    )
    ends = [(v.get("finished"), v["seconds"]) for v in stages.values()]
    if ends and all(f is not None for f, _ in ends):
        first = min(f - s for f, s in ends)
        last = max(f for f, _ in ends)
        when = [datetime.fromtimestamp(t, timezone.utc).strftime("%Y-%m-%d %H:%M") for t in (first, last)]
        text += f" The stages were computed from {when[0]} to {when[1]} UTC: {(last - first) / 60:.1f} min elapsed."
    return text


def write_trajectory_report(study: Any, results: dict) -> Path:
    """``report.md``, ``README.md``, ``tables/`` and ``figures/`` of a trajectory study."""
    return TrajectoryReport(study, results).write()
