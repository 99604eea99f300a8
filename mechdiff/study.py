"""The main job: one command from a task spec to a comparison report.

Stages (each runnable alone from the CLI too): accuracy of every model, circuit discovery in
every model, pruning, the circuit x model matrix, overlap tables, DCM labels per group,
semantic patching, CMAP per group and per Q/K/V. Each stage's result is written to
``<run>/stages/<stage>.json`` under a key that hashes everything it depends on (its config
section, the task section, the digests of its models, the keys of the stages it reads), so
a rerun recomputes only what a changed option touches and a killed run resumes at the first
unfinished stage. Position-wise means live in the HDF5 activation store.
"""

from __future__ import annotations

import logging
import platform
import time
from dataclasses import asdict
from importlib.metadata import version
from pathlib import Path
from typing import Optional

from .circuits.circuit import Circuit
from .io import check_writable, run_lock, write_json
from .models.loading import LoadedModel, resolve_spec, spec_digest
from .models.modelset import ModelSet
from .studies.stages import StageCache, StageRecord, label
from .studies.stages import key_hash as _hash
from .tasks.base import Task, get_task
from .tasks.spec import RunSpec

log = logging.getLogger(__name__)
PACKAGES = ("mechdiff", "torch", "transformers", "nnsight", "peft", "h5py", "scipy", "numpy")


class Study:
    """Runs the stages of one :class:`RunSpec` into ``spec.output.dir``."""

    def __init__(self, spec: RunSpec, progress: bool = True, out_dir: Optional[str] = None):
        self.started = time.time()
        self.spec = spec
        self.progress = progress
        self.dir = Path(out_dir or spec.output.dir)
        self.store = str(Path(spec.output.store))
        self.cache = StageCache(self.dir)
        # Where results go must be writable before anything loads or computes.
        check_writable(self.dir, "run directory")
        check_writable(Path(self.store).parent, "activation store directory")
        # Check the set before any weights load: weights present (or --remote set up), shapes, vocabularies, names.
        from .models.remote import check_remote
        from .reproduce import check_weights

        check_remote(spec.models.remote, [resolve_spec(n) for n in spec.model_names])
        check_weights(spec.model_names, remote=spec.models.remote)
        self.models = ModelSet(spec.model_names, dtype=spec.models.dtype, device_map=spec.models.device_map,
                               device=spec.models.device, remote=spec.models.remote)
        if spec.reproduce.circuit:  # the released circuit is read and checked against the models' shape now
            from .circuits.circuit import load_circuit_file

            load_circuit_file(spec.reproduce.circuit, self.models.shape.n_layers, self.models.shape.n_heads)
        self.digests = {name: spec_digest(resolve_spec(name)) for name in spec.model_names}
        self.tokenizer = _tokenizer(spec.models.base)

    # -- data ---------------------------------------------------------------------------
    def _task(self) -> dict:
        """What every stage depends on besides its own section: the task, how models load, the
        held-out vocabulary, the tokenizer (the base's) and the code version."""
        from . import __version__
        from .tasks.splits import eval_objects

        return {"task": asdict(self.spec.task), "dtype": self.spec.models.dtype,
                "device_map": self.spec.models.device_map, "vocabulary": _hash(eval_objects()),
                "tokenizer": self.digests[self.spec.models.base], "mechdiff": __version__,
                **({"remote": True} if self.spec.models.remote else {})}

    @property
    def task(self) -> Task:
        """The task the task file's ``[task]`` section names (registered, or an imported task directory)."""
        return get_task(self.spec.task.name)

    def options(self, held_out: bool = True) -> dict:
        """Generator options: ``n_boxes``, and the objects held out from fine-tuning where the task takes a
        vocabulary (the task keeps only the options it accepts)."""
        from .tasks.splits import eval_objects

        opts: dict = {"n_boxes": self.spec.task.n_boxes}
        if held_out and "vocabulary" in self.task.options:
            opts["vocabulary"] = eval_objects()
        return opts

    def eval_records(self) -> list:
        t = self.spec.task
        return self.task.records(self.tokenizer, self.spec.eval.n, t.seed + 1, **self.options())

    def model(self, name: str) -> LoadedModel:
        return self.models[name]

    # -- stages -------------------------------------------------------------------------
    def accuracy(self, name: str) -> StageRecord:
        from .evaluate import evaluate

        def compute() -> dict:
            lm = self.model(name)
            res = evaluate(lm, self.eval_records(), self.spec.eval.batch_size, desc=f"accuracy {name}",
                           progress=self.progress)
            return {**res.to_dict(), "fingerprint": lm.fingerprint, "provenance": lm.provenance}

        return self.cache.run(f"accuracy:{name}", {"model": self.digests[name], "task": self._task(),
                                                    "eval": asdict(self.spec.eval), "split": "eval"}, compute)

    def circuit(self, name: str) -> StageRecord:
        from .circuits.discovery import DiscoverySettings, discover
        from .circuits.plan import default_plan, load_plan
        from .report.figures import head_heatmap

        d, t = self.spec.discovery, self.spec.task

        def compute() -> dict:
            lm = self.model(name)
            plan = load_plan(self.task.plan) if self.task.plan else default_plan()
            steps_of_plan = {step.name for step in plan.steps}
            settings = DiscoverySettings(k={s: k for s, k in d.top_k.items() if s in steps_of_plan}, screen=d.screen,
                                         screen_multiple=d.screen_multiple, n_prompts=d.n, n_boxes=t.n_boxes,
                                         seed=t.seed)
            pairs = self.task.discovery_pairs(self.tokenizer, d.n, t.seed, **self.options())
            circuit, steps = discover(lm, pairs, settings, task=self.task.name, progress=self.progress, plan=plan)
            figures = {}
            for step, res in steps.items():
                path = self.dir / "figures" / f"path_patching_{label(name)}_{step}.png"
                head_heatmap(res.exact, lm.shape.n_layers, lm.shape.n_heads, path,
                             title=f"{name}: step {step} ({circuit.names.get(step, '')}), senders at "
                                   f"{res.sender_position}", selected=res.selected, label="(p_patched - p_clean)/p_clean")
                figures[step] = str(path.relative_to(self.dir))
            circuit.save(self.dir / "circuits" / f"{label(name)}.json")
            return {"circuit": circuit.to_dict(), "figures": figures,
                    "exact": {s: {h.name: v for h, v in r.exact.items()} for s, r in steps.items()}}

        return self.cache.run(f"circuit:{name}", {"model": self.digests[name], "task": self._task(),
                                                   "discovery": asdict(d)}, compute)

    def scorer(self, name: str, offset: int = 2):
        from .circuits.scoring import Scorer

        s, t = self.spec.scoring, self.spec.task
        records = self.task.records(self.tokenizer, s.n, t.seed + offset, **self.options())
        reference = self.task.reference_records(self.tokenizer, s.n, t.seed + 3, **self.options(held_out=False))
        return Scorer.build(self.model(name), records, reference, self.spec.eval.batch_size, self.progress,
                            store=self.store)

    def pruned(self, name: str, circuit_rec: StageRecord) -> StageRecord:
        from .circuits.scoring import minimality, prune

        s = self.spec.scoring

        def compute() -> dict:
            circuit = Circuit.from_dict(circuit_rec.result["circuit"])
            # Pruning decides on its own prompts (seed+6), never on those the matrix reports.
            result = minimality(self.scorer(name, offset=6), circuit, max_steps=s.prune_steps, n_candidates=4,
                                seed=self.spec.task.seed, metric=s.prune_metric)
            pruned = prune(circuit, result, s.prune_threshold)
            pruned.save(self.dir / "circuits" / f"{label(name)}.pruned.json")
            return {"circuit": pruned.to_dict(), "minimality": result}

        return self.cache.run(f"prune:{name}", {"model": self.digests[name], "circuit": circuit_rec.key,
                                                 "scoring": asdict(s), "task": self._task()}, compute)

    def matrix(self, name: str, circuits: dict[str, StageRecord]) -> StageRecord:
        from .circuits.scoring import completeness, matrix_rows

        s = self.spec.scoring

        def compute() -> dict:
            scorer = self.scorer(name)
            loaded = {label: Circuit.from_dict(rec.result["circuit"]) for label, rec in circuits.items()}
            rows = matrix_rows(name, loaded, scorer, n_random=s.random_draws, seed=self.spec.task.seed)
            own = loaded.get(name)
            comp = (completeness(scorer, own, n_draws=s.completeness_draws, seed=self.spec.task.seed)
                    if own is not None and s.completeness_draws > 0 else None)
            return {"rows": rows, "completeness": comp}

        return self.cache.run(f"matrix:{name}", {"model": self.digests[name], "task": self._task(),
                                                  "circuits": {k: r.key for k, r in circuits.items()},
                                                  "scoring": asdict(s)}, compute)

    def dcm(self, circuit_rec: StageRecord) -> StageRecord:
        from .dcm import DCMConfig, dcm_circuit, desideratum_pairs, semantic_patching, split_pairs

        c, t = self.spec.dcm, self.spec.task
        base = self.spec.models.base

        def compute() -> dict:
            circuit = Circuit.from_dict(circuit_rec.result["circuit"])
            n = c.n_train + c.n_val + c.n_test
            split = (c.n_train / n, c.n_val / n, c.n_test / n)
            config = DCMConfig(lam=c.lam, lr=c.lr, epochs=c.epochs, batch_size=c.batch_size, micro_batch=c.batch_size,
                               eval_batch=self.spec.eval.batch_size,
                               eval_every=4, split=split, seed=t.seed, random_pool=c.random_pool)
            opts = self.options()
            desiderata = {d: desideratum_pairs(d, self.tokenizer, n, t.n_boxes, t.seed + 4,
                                               vocabulary=opts.get("vocabulary"), task=self.task.name)
                          for d in c.desiderata}
            groups = [g for g, heads in circuit.groups.items() if heads]
            results = dcm_circuit(self.model(base), circuit, desiderata, config, groups, self.progress)
            semantic = []
            for r in results:
                if not r.selected:
                    continue
                test = split_pairs(desiderata[r.desideratum], config.split, config.seed)[2]
                for sem in semantic_patching(self.models, r.selected, r.position, test, self.spec.eval.batch_size):
                    semantic.append({"group": r.group, "desideratum": r.desideratum,
                                     "heads": [h.name for h in r.selected], **sem.to_dict()})
            return {"dcm": [r.to_dict() for r in results], "semantic": semantic}

        return self.cache.run("dcm", {"models": self.digests, "circuit": circuit_rec.key, "dcm": asdict(c),
                                      "task": self._task()}, compute)

    def cmap(self, finetune: str, circuit_rec: StageRecord) -> StageRecord:
        from .cmap import run_cmap

        c, t = self.spec.cmap, self.spec.task
        base = self.spec.models.base

        def compute() -> dict:
            circuit = Circuit.from_dict(circuit_rec.result["circuit"])
            if not circuit.heads():
                return {"skipped": f"the circuit of {base} has no heads left after pruning; there is nothing to patch"}
            records = self.task.records(self.tokenizer, c.n, t.seed + 5, **self.options())
            res = run_cmap(self.model(base), self.model(finetune), circuit, records, c.parts,
                           self.spec.eval.batch_size, progress=self.progress, isolate=c.isolate,
                           n_random=c.n_random, seed=t.seed + 5)
            return res.to_dict()

        return self.cache.run(f"cmap:{finetune}", {"base": self.digests[base], "finetune": self.digests[finetune],
                                                    "circuit": circuit_rec.key, "cmap": asdict(c),
                                                    "task": self._task()}, compute)

    # -- the whole study ----------------------------------------------------------------
    def run(self) -> Path:
        """Every stage, under the run directory's lock (a second run on it is refused with the holder's PID).
        Each stage's record is written atomically when it finishes, so an interrupted run loses only the
        stage in progress and resumes there."""
        with run_lock(self.dir):
            return self._run()

    def _run(self) -> Path:
        from .report.study_report import write_report

        if self.spec.reproduce.circuit:  # the released circuit on every model, beside the published figures
            from .reproduce import reproduction_stage

            reproduction_stage(self)
            if self.spec.reproduce.only:
                write_json(self.dir / "run.json", self.manifest())
                return self.dir / "reproduction.md"
        names = self.spec.model_names
        base = self.spec.models.base
        accuracy = {n: self.accuracy(n) for n in names}
        found = {n: self.circuit(n) for n in names}
        circuits = {n: (self.pruned(n, found[n]) if self.spec.scoring.prune else found[n]) for n in names}
        matrix = {n: self.matrix(n, circuits) for n in names}
        dcm = self.dcm(circuits[base])
        cmap = {ft: self.cmap(ft, circuits[base]) for ft in self.spec.models.finetunes}
        report = write_report(self, accuracy, found, circuits, matrix, dcm, cmap)
        write_json(self.dir / "run.json", self.manifest())
        return report

    def manifest(self) -> dict:
        """What was run: config, versions, fingerprints, seeds, stage timings."""
        loaded = {n: {"fingerprint": m.fingerprint, "provenance": m.provenance} for n, m in self.models._loaded.items()}
        return {
            "spec": self.spec.to_dict(), "source": self.spec.source, "versions": versions(),
            "python": platform.python_version(), "machine": platform.machine(),
            "model_digests": self.digests, "loaded_models": loaded,
            "stages": {n: {"key": r.key, "seconds": r.seconds, "cached": r.cached}
                       for n, r in self.cache.records.items()},
            "wall_seconds": time.time() - self.started,
        }


def versions() -> dict[str, str]:
    """Installed versions of the packages a result depends on."""
    out = {}
    for pkg in PACKAGES:
        try:
            out[pkg] = version(pkg)
        except Exception:  # noqa: BLE001 - a missing package is reported, not fatal
            out[pkg] = "not installed"
    return out


def _tokenizer(name: str):
    from .models.loading import load_tokenizer

    return load_tokenizer(resolve_spec(name))
