"""The trajectory study: an ordered list of checkpoints of one run (``[models] checkpoints``), measured at every
checkpoint by function and by structure (`mechdiff.methods.trajectory`).

Stages, each a record of the one stage cache (``<out>/stages/``), keyed by its inputs, and each one unit of
`mechdiff.studies.trajectory.stages` (its inputs, computation and cost): ``accuracy:<ckpt>``
(`stages.accuracy`), ``circuit:<ckpt>`` and the other runs' ``ranking:<ckpt>`` (`stages.circuit`),
``structure`` (`stages.structure`), ``score:<ckpt>`` (`stages.score`), ``cmap:<ckpt>`` (`stages.cmap`), ``dcm``
and ``semantic:<ckpt>`` (`stages.dcm`), ``roles:<ckpt>`` (only where the task file has a ``[roles]`` section,
`stages.roles`), ``edges:<ckpt>`` and ``edges`` (only with ``[edges] on = true``, `stages.edges`). The task file
is read by `mechdiff.studies.trajectory.settings`; what every stage reads (checkpoints, prompt sets, seeds) is
`TrajectoryContext`.

The base loads once; the adapters are swapped (`Checkpoints`), and nothing loads
when every stage is cached. The report gives each quantity per step with its interval, its paired difference
against the first checkpoint, each component's normalised measure and formation steps with bootstrap intervals
(`formation`, computed from the stages' per-prompt outcomes, so no stage records more for
them), the pairs of components those intervals order, and the structural changes.
"""

from __future__ import annotations

import logging
import time
from dataclasses import asdict, replace
from pathlib import Path
from types import SimpleNamespace
from typing import Any, Optional

from ...common.io import WAIT_POLL, run_lock
from ...runs.stages import StageRecord, label
from .context import TrajectoryContext
from .settings import SECTIONS, TrajectorySettings, load_settings, other_runs, read_labels
from .stages.accuracy import AccuracyStage
from .stages.base import PlanCounts
from .stages.circuit import CircuitStage, RankingStage
from .stages.cmap import CmapStage
from .stages.dcm import DcmStage, SemanticStage
from .stages.edges import EdgeScoresStage, EdgesStage
from .stages.roles import RolesStage
from .stages.score import ScoreStage
from .stages.structure import StructureStage

log = logging.getLogger(__name__)

Records = dict[str, StageRecord]


def trajectory_costs(
    meter: Any,
    st: TrajectorySettings,
    names: list[str],
    others: list[str],
    labels: list,
    circuits: Optional[dict[str, Any]] = None,
) -> list:
    """Every stage's cost (each unit's ``costs``, `PlanCounts`) in the order `TrajectoryStudy.stages` meets them,
    on the checkpoints ``names`` and the other runs' ``others``; ``labels``: the DCM table of ``[dcm] labels``
    (empty: DCM trained here); ``circuits``: each checkpoint's circuit where a run found it (`trajectory_found`;
    else each checkpoint's own is assumed distinct)."""
    p = PlanCounts(meter, st, names, others, labels, circuits or {})
    return [
        *AccuracyStage.costs(p, names),
        *CircuitStage.costs(p),
        *AccuracyStage.costs(p, others),
        *RankingStage.costs(p),
        *StructureStage.costs(p),
        *ScoreStage.costs(p),
        *CmapStage.costs(p),
        *DcmStage.costs(p),
        *SemanticStage.costs(p),
        *RolesStage.costs(p),
        *EdgeScoresStage.costs(p),
        *EdgesStage.costs(p),
    ]


class TrajectoryStudy(TrajectoryContext):
    """The stages of one trajectory task file into ``out`` (see the module docstring)."""

    kind = "trajectory"

    @classmethod
    def plan_inputs(cls, path: Optional[str | Path], task: Optional[str] = None, dtype: Optional[str] = None) -> Any:
        """The settings, the base's dims and the task's token lengths (`task_lengths`), the DCM table where
        ``[dcm] labels`` names one; no checkpoint loads."""
        from ...models.footprint import model_dims
        from ..planner import PlanInputs, task_lengths

        st = load_settings(path)
        if task:
            st.task.name = task
        names = list(st.models.checkpoints)
        others = [o for o_names in other_runs(st.runs, names).values() for o in o_names]
        dims, source = model_dims(names[0])
        lengths = task_lengths(SimpleNamespace(models=SimpleNamespace(base=names[0]), task=st.task))  # type: ignore[arg-type]
        labels = read_labels(st.dcm.labels) if st.dcm.labels else []
        rows = min(2048, st.eval.batch_size * lengths.longest)
        known = {"names": names, "others": others, "labels": labels}
        return PlanInputs(
            "trajectory", st, dims, source, lengths, dtype or st.models.dtype, tuple([*names, *others]), 1, rows,
            known=known,
        )  # fmt: skip

    @classmethod
    def stage_costs(cls, inputs: Any, device: Any) -> list:
        """Every stage (`trajectory_costs`)."""
        k = inputs.known
        costs = trajectory_costs(
            inputs.meter(device), inputs.settings, k["names"], k["others"], k["labels"], k.get("circuits")
        )
        return costs

    @classmethod
    def with_batch(cls, settings: Any, cost: Any, batch: int) -> Any:
        if cost.batch_option == "[edges] batch_size":
            return replace(settings, edges=replace(settings.edges, batch_size=batch))
        return replace(settings, eval=replace(settings.eval, batch_size=batch))

    @classmethod
    def from_file(
        cls,
        path: str | Path,
        out: Optional[str] = None,
        progress: bool = True,
        models: Optional[dict] = None,
        task: Optional[str] = None,
    ) -> "TrajectoryStudy":
        settings = load_settings(path)
        for key, value in (models or {}).items():
            if key in ("dtype", "device") and value is not None:
                setattr(settings.models, key, value)
        if task:
            settings.task.name = task
        return cls(settings, out, progress)

    # -- stages: each one unit (`mechdiff.studies.trajectory.stages`) ------------------
    def accuracy(self, name: str) -> StageRecord:
        return AccuracyStage(self).run(name)

    def circuit(self, name: str) -> StageRecord:
        return CircuitStage(self).run(name)

    def ranking(self, name: str) -> StageRecord:
        return RankingStage(self).run(name)

    def structure(self, circuits: Records, rankings: Optional[Records] = None) -> StageRecord:
        return StructureStage(self).run(circuits, rankings)

    def score(self, name: str, circuits: Records) -> StageRecord:
        return ScoreStage(self).run(name, circuits)

    def cmap(self, name: str, final: StageRecord) -> StageRecord:
        return CmapStage(self).run(name, final)

    def dcm(self, final: StageRecord) -> StageRecord:
        return DcmStage(self).run(final)

    def semantic(self, name: str, dcm: StageRecord) -> StageRecord:
        return SemanticStage(self).run(name, dcm)

    def roles(self, name: str, circuits: Records) -> StageRecord:
        return RolesStage(self).run(name, circuits)

    def edge_scores(self, name: str) -> StageRecord:
        return EdgeScoresStage(self).run(name)

    def edges(self, scored: Records) -> StageRecord:
        return EdgesStage(self).run(scored)

    # -- the whole study ----------------------------------------------------------------
    def stages(self) -> dict[str, Any]:
        """Every stage in order: one checkpoint at a time where a stage needs one model (fewest swaps)."""
        accuracy = {n: self.accuracy(n) for n in self.names}
        circuits = {n: self.circuit(n) for n in [self.final, *self.names[:-1]]}
        circuits = {n: circuits[n] for n in self.names}
        others = {o: self.accuracy(o) for o in self.others}
        rankings = {o: self.ranking(o) for o in self.others}
        structure = self.structure(circuits, rankings)
        scores = {n: self.score(n, circuits) for n in self.names}
        cmap = {n: self.cmap(n, circuits[self.final]) for n in self.names[1:]}
        dcm = self.dcm(circuits[self.final])
        semantic = {n: self.semantic(n, dcm) for n in self.names}
        roles = {n: self.roles(n, circuits) for n in self.role_checkpoints()}
        scored = {n: self.edge_scores(n) for n in self.edge_checkpoints()}
        edges = {"edges": self.edges(scored)} if scored else {}  # [edges] off: no edge stage, no key
        return {
            **edges,
            "roles": roles,
            "runs": {"accuracy": others, "ranking": rankings},
            "accuracy": accuracy,
            "circuits": circuits,
            "structure": structure,
            "scores": scores,
            "cmap": cmap,
            "dcm": dcm,
            "semantic": semantic,
        }

    def run_checkpoints(self, names: list[str], poll: float = WAIT_POLL) -> None:
        """The stages of ``names`` only, so that several processes can share the cores (each with its own
        activation store): their accuracy and own circuit; once the final and first trained checkpoints'
        circuits are in the cache (written by whichever process has them), their scores, CMAP and semantic
        patching (and, in the process given the final checkpoint, the structure and DCM stages once every
        circuit is cached); with ``[edges]`` on, the edge scores of ``names`` and, in the final checkpoint's process
        once every edge score is cached, the edge comparison. A plain run afterwards finds every stage cached and
        writes the report."""
        unknown = [n for n in names if n not in self.names]
        if unknown:
            raise ValueError(f"{unknown} are not checkpoints of this study ({', '.join(self.names)})")
        store = Path(self.store)
        self.store = str(store.with_name(f"{store.stem}-{'-'.join(label(n) for n in names)}{store.suffix}"))
        with run_lock(self.dir / "stages" / "locks" / "-".join(label(n) for n in names)):
            for n in names:
                self.accuracy(n)
                self.circuit(n)
            self._wait([self.final, self.first_trained])
            circuits = {n: self.circuit(n) for n in {self.final, self.first_trained, *names}}
            for n in names:
                self.score(n, circuits)
                if n != self.names[0]:
                    self.cmap(n, circuits[self.final])
            dcm = self.dcm(circuits[self.final]) if self.final in names else None
            if dcm is None:
                self._wait_for("dcm", lambda: self.cache.ready("dcm", DcmStage(self).inputs(circuits[self.final])))
                dcm = self.dcm(circuits[self.final])
            for n in names:
                self.semantic(n, dcm)
            if self.final in names or self.st.roles:
                self._wait(self.names)
                every = {n: self.circuit(n) for n in self.names}
            if self.final in names:  # the other runs' checkpoints too (their accuracy, their ranking)
                for o in self.others:
                    self.accuracy(o)
                self.structure(every, {o: self.ranking(o) for o in self.others})
            for n in (n for n in names if n in self.role_checkpoints()):
                self.roles(n, every)
            for n in (n for n in names if n in self.edge_checkpoints()):
                self.edge_scores(n)
            if self.final in names and self.edge_checkpoints():
                for n in self.edge_checkpoints():
                    self._wait_for(
                        f"edges:{n}", lambda n=n: self.cache.ready(f"edges:{n}", EdgeScoresStage(self).inputs(n))
                    )
                self.edges({n: self.edge_scores(n) for n in self.edge_checkpoints()})

    def _wait(self, names: list[str], poll: float = WAIT_POLL) -> None:
        for n in names:
            self._wait_for(f"circuit:{n}", lambda: self.cache.ready(f"circuit:{n}", CircuitStage(self).inputs(n)), poll)

    @staticmethod
    def _wait_for(what: str, ready: Any, poll: float = WAIT_POLL) -> None:
        if not ready():
            log.info("waiting for %s (another process computes it)", what)  # once, not at every poll
        while not ready():
            time.sleep(poll)

    def write(self, results: dict[str, Any]) -> Path:
        from ...report.html import write_html
        from .report import write_trajectory_report

        self.write_attributions(results)
        report = write_trajectory_report(self, results)
        write_html(self.dir)  # report.html: read from what was just written (as `mechdiff view` does)
        return report

    def write_attributions(self, results: dict[str, Any]) -> Path:
        """``attributions.h5``: the per-prompt attributions behind the structure tables, float16, gzip, each
        checkpoint at the pairs some top-n of the structure stage selected, the rows only the steps read on their
        own prompts have at the pairs that comparison selected (`write_attributions`), so the tables recompute from
        committed files."""
        from ...methods.structure import ATTRIBUTIONS, attributions_over_bound, write_attributions

        st = results["structure"].result
        rankings = results.get("runs", {}).get("ranking", {})
        attribution = StructureStage(self).attributions(results["circuits"], rankings)
        meta = {
            "structure": asdict(self.st.structure),
            "n_pairs": st["n_pairs"],
            "seed": st["seed"],
            "ranking_n": self.st.discovery.n,
            "steps": dict(zip(self.names, self.steps)),
            "runs": self.runs,
            "matched": {r["level"]: r["runs"] for r in st.get("matched_runs", [])},
        }
        classes = results["circuits"][self.final].result["classes"]
        path = write_attributions(self.dir / ATTRIBUTIONS, attribution, st, classes, meta)
        size = path.stat().st_size
        log.info("%s: %.1f MB", path, size / 1e6)
        over = attributions_over_bound(self.dir.parent)  # this and the sibling trajectories' stores together
        if over:
            log.warning("%s: lower [discovery] runs_n or [structure] resamples", over)
        return path

    def settings_record(self) -> dict:
        return {
            **{k: asdict(getattr(self.st, k)) for k in SECTIONS if getattr(self.st, k) is not None},
            "source": self.st.source,
            "model_digests": self.digests,
        }
