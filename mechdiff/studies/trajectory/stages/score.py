"""``score:<ckpt>``: the final checkpoint's circuit, the first trained checkpoint's (the second in the list) and the
checkpoint's own, scored in the checkpoint (faithfulness with bootstrap intervals)."""

from __future__ import annotations

from dataclasses import asdict

from ....circuits.circuit import Circuit
from ....runs.stages import StageRecord
from .base import PlanCounts, Stage


class ScoreStage(Stage):
    kind = "score"

    def scored(self, name: str, circuits: dict[str, StageRecord]) -> dict[str, StageRecord]:
        s = self.s
        return {"final": circuits[s.final], "first trained": circuits[s.first_trained], "own": circuits[name]}

    def inputs(self, name: str, circuits: dict[str, StageRecord]) -> dict:
        return {
            "model": self.s.digests[name],
            "task": self.s.task_inputs(),
            "scoring": asdict(self.s.st.scoring),
            "circuits": {k: r.key for k, r in self.scored(name, circuits).items()},
        }

    def compute(self, name: str, circuits: dict[str, StageRecord]) -> dict:
        from ....methods.trajectory import circuits_scored

        loaded = {k: Circuit.from_dict(rec.result["circuit"]) for k, rec in self.scored(name, circuits).items()}
        return circuits_scored(self.s.scorer(name, "matrix", self.s.st.scoring.n), loaded)

    @staticmethod
    def costs(p: PlanCounts) -> list:
        """The full model, the empty circuit and each distinct one of the three circuits (a set of pairs runs once)
        on ``[scoring] n`` prompts, in every checkpoint."""
        n, names = p.st.scoring.n, p.names

        def scored(c: str) -> int:
            return 2 + len({p.circuits.get(k, k) for k in (names[-1], names[1], c)})

        return [p.cost(f"score:{c}", n, [(n, scored(c) * p.batches(n), 1)]) for c in names]
