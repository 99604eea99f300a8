"""``structure``: the within-checkpoint null (two discoveries on two disjoint random halves of the ranking prompts, a
fresh split each draw), the structural change between consecutive checkpoints and of each checkpoint against the
final one beyond it, and the overlap matrix of every two checkpoints."""

from __future__ import annotations

from dataclasses import asdict
from typing import Any, Optional

from ....runs.stages import StageRecord
from .base import PlanCounts, Stage

#: What the structure stage computes, in its key: a record of the first null (the halves resampled with
#: replacement, consecutive checkpoints only) or of the split spread alone (no interval over prompts) is not reused.
NULL = (
    "disjoint random halves per split; consecutive, against the final, matrix; intervals resampling the prompts "
    "outside the split; float16 attributions; the [runs] steps on their own ranking prompts"
)

Records = dict[str, StageRecord]


class StructureStage(Stage):
    """The structural null and changes (`structure_record`) on the float16 attributions the study commits
    (`attributions`), every checkpoint on the ranking prompts all share (``[discovery] n``), with the between-run
    null where ``rankings`` holds other runs' checkpoints (``[runs]``); and, where those steps have more ranking
    prompts (``runs_n``), the same at those steps alone on them (``dense``)."""

    kind = "structure"
    per_checkpoint = False

    def inputs(self, circuits: Records, rankings: Optional[Records] = None) -> dict:
        inputs = {"circuits": {c: r.key for c, r in circuits.items()}, "structure": asdict(self.s.st.structure)}
        inputs["null"] = NULL
        if rankings:  # a study without other runs keeps its key
            inputs["runs"] = {o: r.key for o, r in rankings.items()}
            matched = self.matched()
            if matched:  # as do runs compared at the same step only
                inputs["matched"] = matched
        return inputs

    def matched(self) -> dict[str, list[str]]:
        """Each ``[runs] levels`` accuracy (``"accuracy 0.5"``) -> each run's first step read (``[runs] steps``)
        whose held-out accuracy is at or above it: this run's checkpoint, then each other run's in ``[runs] dirs``
        order; a run that reaches it at no step read is left out (a level fewer than two runs reach: no row)."""
        s = self.s
        step = dict(zip(s.names, s.steps))
        read = sorted(s.runs, key=step.__getitem__)
        per_run = [read] + [[s.runs[c][i] for c in read] for i in range(len(s.st.runs.dirs))]
        acc = {c: s.accuracy(c).result["accuracy"]["value"] for run in per_run for c in run}
        out = {}
        for level in s.st.runs.levels:
            first = [next((c for c in run if acc[c] >= level), None) for run in per_run]
            if sum(c is not None for c in first) >= 2:
                out[f"accuracy {level:g}"] = [c for c in first if c is not None]
        return out

    def compute(self, circuits: Records, rankings: Optional[Records] = None) -> dict:
        from ....methods.structure import structure_record

        s, st = self.s, self.s.st.structure
        n_pairs = st.n_pairs or circuits[s.final].result["n_pairs"]
        classes = circuits[s.final].result["classes"]
        attribution = self.attributions(circuits, rankings or {})
        matched = self.matched() if rankings else {}
        return structure_record(
            attribution,
            s.names,
            s.runs,
            classes,
            n_pairs,
            s.st.discovery.n,
            asdict(st),
            s.seed("ranking"),
            matched=matched,
        )

    def attributions(self, circuits: Records, rankings: Optional[Records] = None) -> dict[str, Any]:
        """Every checkpoint's per-prompt ranking attribution (the other runs' after the trajectory's) as the study
        commits it, float16 (`to_half`); a ranking of other classes than the final circuit's is refused."""
        from ....methods.structure import to_half
        from ....methods.trajectory import decode_array

        rankings, final = rankings or {}, self.s.final
        classes = circuits[final].result["classes"]
        odd = [o for o, rec in rankings.items() if rec.result["classes"] != classes]
        if odd:
            raise ValueError(f"{odd} rank other position classes than {final}: {classes}")
        every = {**circuits, **rankings}
        return {c: to_half(decode_array(rec.result["attribution"])) for c, rec in every.items()}

    @staticmethod
    def costs(p: PlanCounts) -> list:
        """No pass: computed from the circuits' attributions."""
        return [p.cost("structure", 0, [], "from the circuits' attributions: no pass", models=0)]
