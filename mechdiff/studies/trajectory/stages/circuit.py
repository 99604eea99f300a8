"""``circuit:<ckpt>``: the checkpoint's own circuit at the target (attribution ranking, faithfulness curve) with its
size, per-prompt attribution and selection frequencies; ``ranking:<ckpt>``: an other run's checkpoint (``[runs]``)
ranked alone, for the structure stage."""

from __future__ import annotations

import json
from dataclasses import asdict
from pathlib import Path

from ....circuits.circuit import Circuit
from ....runs.stages import label
from .base import PlanCounts, Stage


class CircuitStage(Stage):
    kind = "circuit"

    def inputs(self, name: str) -> dict:
        # the key names the checkpoint's own ranking count as n (runs_n left out), so a step ranked on n keeps its key
        discovery = {k: v for k, v in asdict(self.s.st.discovery).items() if k != "runs_n"}
        return {
            "model": self.s.digests[name],
            "task": self.s.task_inputs(),
            "discovery": {**discovery, "n": self.s.ranking_n(name)},
            "scoring": self.s.reference_inputs(),
        }

    def compute(self, name: str) -> dict:
        from ....circuits.positions import task_classes
        from ....methods.trajectory import own_circuit

        s, d = self.s, self.s.st.discovery
        ranker = s.scorer(name, "ranking", s.ranking_n(name))
        res = own_circuit(
            ranker,
            s.scorer(name, "curve", d.curve_n),
            task_classes(ranker),
            d.sizes,
            d.target,
            d.select,
            d.stability_draws,
            s.seed("ranking"),
            s.task.name,
        )
        Circuit.from_dict(res["circuit"]).save(s.dir / "circuits" / f"{label(name)}.json")
        return res

    @staticmethod
    def costs(p: PlanCounts) -> list:
        """The final checkpoint first, then the others in order: the reference means, attribution (`attribution`)
        on its ranking prompts and the curve's full model, empty circuit and sizes on ``curve_n``."""
        d, out = p.st.discovery, []
        for n in [p.names[-1], *p.names[:-1]]:
            r, c = p.ranking_n(n), d.curve_n
            passes = [p.reference(), *attribution(p, r), (c, p.batches(c) * (2 + len(d.sizes)), 1)]
            out.append(p.cost(f"circuit:{n}", r, passes))
        return out


class RankingStage(Stage):
    """A checkpoint of another run (``[runs]``): its per-prompt attribution on the ranking prompts only (what the
    structure stage compares), as the circuit stage ranks."""

    kind = "ranking"

    def inputs(self, name: str) -> dict:
        return {
            "model": self.s.digests[name],
            "task": self.s.task_inputs(),
            "ranking_n": self.s.ranking_n(name),
            "scoring": self.s.reference_inputs(),
        }

    def compute(self, name: str) -> dict:
        from ....circuits.curve import prompt_attribution
        from ....circuits.positions import task_classes
        from ....methods.trajectory import encode_array

        ranker = self.s.scorer(name, "ranking", self.s.ranking_n(name))
        classes = task_classes(ranker)
        return {
            "classes": list(classes),
            "attribution": encode_array(prompt_attribution(ranker, classes).float().numpy()),
        }

    @staticmethod
    def costs(p: PlanCounts) -> list:
        """The reference means and attribution on ``runs_n`` ranking prompts, in each other run's checkpoint."""
        n = p.st.discovery.runs_n
        return [p.cost(f"ranking:{o}", n, [p.reference(), *attribution(p, n)]) for o in p.others]


def attribution(p: PlanCounts, n: int) -> list:
    """`prompt_attribution`'s passes on ``n`` prompts: a batch's run to the embedding (stopped there: its reads,
    no FLOPs counted), then its forward and backward to the activations."""
    return [(n, p.batches(n), 2), (0, p.batches(n), 1)]


def trajectory_found(run_dir: str | Path) -> dict[str, frozenset]:
    """Each checkpoint's circuit (its (head, position) pairs) that a run's ``circuit`` stage records hold: what
    the plan of the ``score`` stages otherwise assumes distinct."""
    out = {}
    for path in sorted((Path(run_dir) / "stages").glob("circuit*.json")):
        rec = json.loads(path.read_text())
        kind, _, name = rec["name"].partition(":")
        if kind == "circuit":
            c = Circuit.from_dict(rec["result"]["circuit"])
            out[name] = frozenset((str(h), c.positions[g]) for g, hs in c.groups.items() for h in hs)
    return out
