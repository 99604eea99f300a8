"""The circuits study (kind ``circuits``, the default): one command from a task spec to a comparison report,
for any task (entity tracking, IOI, an imported task directory).

Stages (each runnable alone from the CLI too): accuracy of every model, circuit discovery in
every model, pruning, the circuit x model matrix, overlap tables, DCM labels per group,
semantic patching, CMAP per group and per Q/K/V. Each stage is one module of
`mechdiff.studies.circuits.stages` (its key, its computation, its cost); this class orders them. Each stage's
result is written to ``<run>/stages/<stage>.json`` under a key that hashes everything it depends on (its config
section, the task section, the digests of its models, the keys of the stages it reads), so
a rerun recomputes only what a changed option touches and a killed run resumes at the first
unfinished stage. Position-wise means live in the HDF5 activation store. Every prompt set is seeded
by name (`mechdiff.runs.seeds.prompt_seed`).
"""

from __future__ import annotations

import logging
import time
from pathlib import Path
from typing import Any, Optional

from ...common.io import WAIT_POLL, check_writable, run_lock
from ...models.loading import spec_digest
from ...models.modelset import ModelSet
from ...models.resolve import resolve_spec
from ...runs.stages import StageRecord, label
from ...runs.stages import key_hash as _hash
from ..planner import Lengths, task_lengths
from .data import CircuitsData
from .spec import RunSpec
from .stages import accuracy, circuit, cmap, dcm, matrix, plan, positions, prune, reproduction

log = logging.getLogger(__name__)


class CircuitsStudy(CircuitsData):
    """Runs the stages of one `RunSpec` into ``spec.output.dir``: each stage's module
    (`mechdiff.studies.circuits.stages`) computes and counts it; this class orders them and holds what they share
    (the models, the stage cache, the prompt sets of `CircuitsData`)."""

    kind = "circuits"
    settings_key = "spec"  # the reports and `mechdiff view` tell a circuits run.json by it

    @classmethod
    def plan_inputs(cls, path: Optional[str | Path], task: Optional[str] = None, dtype: Optional[str] = None) -> Any:
        """The task file's spec, the base's dims and the task's token lengths (`circuits_inputs`)."""
        from .spec import study_spec

        return plan.circuits_inputs(study_spec(path, task), dtype=dtype)

    @classmethod
    def stage_costs(cls, inputs: Any, device: Any) -> list:
        """Every stage's cost, each counted by its stage's module (`circuits_costs`)."""
        return plan.circuits_costs(inputs, device)

    @classmethod
    def with_batch(cls, settings: Any, cost: Any, batch: int) -> Any:
        return plan.with_batch(settings, cost, batch)

    def __init__(self, spec: RunSpec, progress: bool = True, out_dir: Optional[str] = None):
        super().__init__(out_dir or spec.output.dir, progress)  # writable before anything loads or computes
        self._dcm_cache_mode: Optional[tuple[str, str]] = None  # DCM's pair-cache mode, chosen at its first stage
        self.spec = spec
        self.store = str(Path(spec.output.store))
        check_writable(Path(self.store).parent, "activation store directory")
        self.task  # noqa: B018 - an imported task's prompt sets are drawn (or refused, short of rows) before weights
        # Check the set before any weights load: weights present (or --remote set up), shapes, vocabularies, names.
        from ...models.remote import check_remote
        from ...models.weights import check_weights

        check_remote(spec.models.remote, [resolve_spec(n) for n in spec.model_names])
        check_weights(spec.model_names, remote=spec.models.remote)
        self.models = ModelSet(
            spec.model_names,
            dtype=spec.models.dtype,
            device_map=spec.models.device_map,
            device=spec.models.device,
            remote=spec.models.remote,
        )
        if spec.reproduce.circuit:  # the released circuit is read and checked against the models' shape now
            from ...circuits.circuit import load_circuit_file

            load_circuit_file(spec.reproduce.circuit, self.models.shape.n_layers, self.models.shape.n_heads)
        self.digests = {name: spec_digest(resolve_spec(name)) for name in spec.model_names}
        self.tokenizer = self.models.tokenizers[resolve_spec(spec.models.base).name]

    @classmethod
    def from_file(
        cls,
        path: Optional[str | Path],
        out: Optional[str] = None,
        progress: bool = True,
        models: Optional[dict] = None,
        task: Optional[str] = None,
    ) -> "CircuitsStudy":
        """The study of a task file (None: the embedded default study, ``tasks/entity_tracking.toml``); ``task``
        replaces its ``[task] name``, ``models`` its ``[models]`` dtype, device, device_map and remote."""
        from .spec import output_dir, study_spec

        spec = study_spec(path, task)  # checked before anything loads; --task alone: that task's own groups
        if task is not None:
            spec.output.dir = out or output_dir(task)  # the file's directory holds its own task's results
        for key, value in (models or {}).items():
            if key not in ("dtype", "device", "device_map", "remote"):
                raise ValueError(f"the circuits study sets {key} per model in [models], not as an option")
            if value is not None:
                setattr(spec.models, key, value)
        return cls(spec, progress=progress, out_dir=out)

    def settings_record(self) -> dict:
        return self.spec.to_dict()

    # -- stages: each a module of `stages` ----------------------------------------------
    def accuracy(self, name: str) -> StageRecord:
        return accuracy.run(self, name)

    def floor(self) -> float:
        """The accuracy a model's lower bound must exceed for the study to explain its behaviour (`floor_is`)."""
        return self.floor_is()[0]

    def floor_is(self) -> tuple[float, str]:
        return accuracy.floor_is(self)

    def has_behaviour(self, rec: StageRecord) -> bool:
        return accuracy.has_behaviour(self, rec)

    def without_behaviour(self, records: dict[str, StageRecord]) -> dict[str, str]:
        return accuracy.without_behaviour(self, records)

    def positions(self, name: str) -> Optional[StageRecord]:
        return positions.run(self, name)

    def circuit(self, name: str) -> StageRecord:
        return circuit.run(self, name)

    def _circuit_inputs(self, name: str) -> dict:
        return circuit.inputs(self, name)

    def path_settings(self, name: str, task_plan: Any) -> Any:
        return circuit.path_settings(self, name, task_plan)

    def pair_options(self) -> dict:
        return circuit.pair_options(self)

    def pruned(self, name: str, circuit_rec: StageRecord) -> StageRecord:
        return prune.run(self, name, circuit_rec)

    def prune_metric(self) -> str:
        return prune.metric(self)

    def _prune_inputs(self, name: str, circuit_key: str) -> dict:
        return prune.inputs(self, name, circuit_key)

    def matrix(self, name: str, circuits: dict[str, StageRecord]) -> StageRecord:
        return matrix.run(self, name, circuits)

    def dcm(self, circuit_rec: StageRecord, name: Optional[str] = None) -> StageRecord:
        return dcm.run(self, circuit_rec, name)

    def dcm_cache_mode(self) -> tuple[str, str]:
        """DCM's pair-cache mode and why (`run_cache_mode`), chosen once a run."""
        if self._dcm_cache_mode is None:
            self._dcm_cache_mode = dcm.run_cache_mode(self.spec, self.lengths())
        return self._dcm_cache_mode

    def dcm_circuit(self, found: dict[str, StageRecord], pruned: dict[str, StageRecord], name: str) -> StageRecord:
        """The circuit record DCM masks for ``name``: its pruned circuit under ``[dcm] circuit = "pruned"``."""
        return pruned[name] if self.spec.dcm.circuit == "pruned" else found[name]

    def cmap(self, finetune: str, circuit_rec: StageRecord, dcm_rec: Optional[StageRecord] = None) -> StageRecord:
        return cmap.run(self, finetune, circuit_rec, dcm_rec)

    def cmap_of(self, finetune: str, found: dict[str, StageRecord], pruned: dict[str, StageRecord]) -> StageRecord:
        """CMAP of ``finetune`` by the configured scope: the base's found circuit (``"base"``) or, as the paper,
        the fine-tune's pruned circuit cut to its own DCM selections (``"paper"``)."""
        if self.spec.cmap.scope != "paper":
            return self.cmap(finetune, found[self.spec.models.base])
        own = pruned[finetune]
        return self.cmap(finetune, own, self.dcm(own, finetune))

    # -- the whole study ----------------------------------------------------------------
    def run_model(self, name: str, poll: float = WAIT_POLL) -> None:
        """The stages of one model, so that one process per model can share the cores: its accuracy, position
        scan, circuit and pruning; DCM (the base) or, once the base's circuit is in the cache (written by the
        base's process), its CMAP (a fine-tune); then, once every model's circuit is in the cache, its row of
        the circuit x model matrix. Each
        process writes its own activation store (``<store>-<model>.h5``); stage records are written atomically
        into the shared run directory, so ``mechdiff run`` afterwards finds every stage cached and writes
        the report."""
        if name not in self.spec.model_names:
            raise ValueError(f"{name!r} is not a model of this study ({', '.join(self.spec.model_names)})")
        store = Path(self.store)
        self.store = str(store.with_name(f"{store.stem}-{label(name)}{store.suffix}"))
        base = self.spec.models.base
        self.check_prompts()
        with run_lock(self.dir / "stages" / "locks" / label(name)):
            if not self.has_behaviour(self.accuracy(name)):
                return  # nothing to explain: the report says why
            self.positions(name)
            found = {name: self.circuit(name)}
            own = {name: self.pruned(name, found[name])} if self.spec.scoring.prune else {}
            # first what needs only the base's circuit (or, for CMAP as the paper, the fine-tune's own), then the
            # matrix, which needs every model's
            if name == base:
                self.dcm(self.dcm_circuit(found, own, base))
            elif self.spec.cmap.scope == "paper":
                self.cmap_of(name, found, own)
            else:
                self._wait([base], "circuit", name, poll)
                self.cmap(name, self.circuit(base))
            last = "prune" if self.spec.scoring.prune else "circuit"
            self._wait(self.spec.model_names, last, name, poll)
            able = [n for n in self.spec.model_names if self.has_behaviour(self.accuracy(n))]  # all cached now
            found = {n: self.circuit(n) for n in able}
            pruned = {n: self.pruned(n, found[n]) for n in able} if self.spec.scoring.prune else {}
            self.matrix(name, {**found, **{f"{n} pruned": rec for n, rec in pruned.items()}})

    def _wait(self, names: list[str], stage: str, waiter: str, poll: float) -> None:
        """Until the ``stage`` ("circuit" or "prune") records of ``names`` are in the cache under this study's
        inputs (written by the other processes; a record of other inputs does not count)."""

        def ready(n: str) -> bool:
            measured = self.cache.ready(f"accuracy:{n}", accuracy.inputs(self, n))
            if measured and not self.has_behaviour(self.accuracy(n)):
                return True  # no circuit will come: the model does not do the task
            inputs = self._circuit_inputs(n)
            if not self.cache.ready(f"circuit:{n}", inputs):
                return False
            return stage == "circuit" or self.cache.ready(f"prune:{n}", self._prune_inputs(n, _hash(inputs)))

        waiting, said = list(names), None
        while waiting:
            waiting = [n for n in waiting if not ready(n)]
            if waiting:
                if waiting != said:  # once per change, not at every poll
                    log.info("%s: waiting for the %s of %s", waiter, stage, ", ".join(waiting))
                    said = waiting
                time.sleep(poll)

    def stages(self) -> dict[str, Any]:
        """Every stage, in order (the reproduction first where ``[reproduce] circuit`` is set); their records."""
        self.check_prompts()
        out: dict[str, Any] = {}
        if self.spec.reproduce.circuit:  # the released circuit on every model, beside the published figures
            out["reproduction"] = reproduction.run(self)
            if self.spec.reproduce.only:
                return out
        base = self.spec.models.base
        out["accuracy"] = {n: self.accuracy(n) for n in self.spec.model_names}
        out["without_behaviour"] = self.without_behaviour(out["accuracy"])
        names = [n for n in self.spec.model_names if n not in out["without_behaviour"]]  # those with the behaviour
        out["positions"] = {n: self.positions(n) for n in names}
        found = out["found"] = {n: self.circuit(n) for n in names}
        pruned = out["pruned"] = {n: self.pruned(n, found[n]) for n in names} if self.spec.scoring.prune else {}
        scored = {**found, **{f"{n} pruned": rec for n, rec in pruned.items()}}
        out["matrix"] = {n: self.matrix(n, scored) for n in names}
        out["dcm"] = self.dcm(self.dcm_circuit(found, pruned, base)) if base in names else None
        finetunes = [ft for ft in self.spec.models.finetunes if ft in names]
        paper = self.spec.cmap.scope == "paper"
        out["cmap"] = {ft: self.cmap_of(ft, found, pruned) for ft in finetunes if paper or base in names}
        # CMAP as the paper reads each fine-tune's own DCM (cached by cmap_of): the report shows what it selected
        out["finetune_dcm"] = {ft: self.dcm(pruned[ft], ft) for ft in finetunes} if paper else {}
        return out

    def write(self, results: dict[str, Any]) -> Path:
        """``reproduction.md`` (with ``[reproduce] circuit``), ``report.md`` with its tables and figures and
        ``report.html`` from the stage records (``run.json`` is written before)."""
        from ...report.html import write_html
        from .report import write_report

        if "reproduction" in results:
            from .reproduce import write_reproduction

            write_reproduction(self, results["reproduction"])
            if self.spec.reproduce.only:
                return self.dir / "reproduction.md"
        r = results
        report = write_report(
            self,
            r["accuracy"],
            r["positions"],
            r["found"],
            r["pruned"],
            r["matrix"],
            r["dcm"],
            r["cmap"],
            r.get("finetune_dcm", {}),
            r.get("without_behaviour", {}),
        )
        write_html(self.dir)  # report.html: read from what was just written (as `mechdiff view` does)
        return report

    def manifest(self) -> dict:
        """The base manifest (the spec under ``spec``), with the spec's source and the models' digests,
        fingerprints and provenance."""
        loaded = {n: {"fingerprint": m.fingerprint, "provenance": m.provenance} for n, m in self.models.loaded.items()}
        out = {
            **super().manifest(),
            "source": self.spec.source,
            "model_digests": self.digests,
            "loaded_models": loaded,
            "resources": self.resources_record(),
        }
        out["prompt_sets"] = self.prompt_sets_record()
        return out

    def lengths(self) -> Optional[Lengths]:
        """The task's token lengths the plan reads (`task_lengths`), on the study's own tokenizer, taken once; None
        where they cannot be (the record and DCM's cache mode then take them, or say why not, as a plan does)."""
        if not hasattr(self, "_lengths"):
            try:
                self._lengths: Optional[Lengths] = task_lengths(self.spec, self.tokenizer)
            except (OSError, ValueError):
                self._lengths = None
        return self._lengths

    def resources_record(self) -> Optional[dict]:
        """The planner's stage FLOPs and this machine's measured throughput (`run_record`),
        measured once per study, so ``run.json`` and the report read the same figures."""
        if not hasattr(self, "_resources"):
            try:
                self._resources = plan.run_record(self.spec, self.lengths())
            except (OSError, ValueError) as err:  # no config or tokenizer to plan from: the run's results stand
                self._resources = {"not_planned": str(err)}
        return self._resources
