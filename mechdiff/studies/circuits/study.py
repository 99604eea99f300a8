"""The circuits study (kind ``circuits``, the default): one command from a task spec to a comparison report,
for any task (entity tracking, IOI, an imported task directory).

Stages (each runnable alone from the CLI too): accuracy of every model, circuit discovery in
every model, pruning, the circuit x model matrix, overlap tables, DCM labels per group,
semantic patching, CMAP per group and per Q/K/V. Each stage's result is written to
``<run>/stages/<stage>.json`` under a key that hashes everything it depends on (its config
section, the task section, the digests of its models, the keys of the stages it reads), so
a rerun recomputes only what a changed option touches and a killed run resumes at the first
unfinished stage. Position-wise means live in the HDF5 activation store. Every prompt set is seeded
by name (`mechdiff.runs.seeds.prompt_seed`).
"""

from __future__ import annotations

import logging
import math
import time
from dataclasses import asdict
from pathlib import Path
from typing import Any, Optional

from ...circuits.circuit import Circuit
from ...common.io import check_writable, run_lock
from ...common.metrics import metric_label, scored_metric
from ...models.loading import LoadedModel, spec_digest
from ...models.modelset import ModelSet
from ...models.resolve import resolve_spec
from ...runs.seeds import prompt_seed
from ...runs.stages import Pending, StageRecord, label
from ...runs.stages import key_hash as _hash
from ...tasks.base import Task, get_task
from ..base import Study, rows_inputs, vocabulary_digest
from .spec import MATRIX_ONLY, RunSpec, discovery_inputs, section_inputs

log = logging.getLogger(__name__)


def accuracy_cost(ctx: Any, name: str) -> Any:
    """The cost of `CircuitsStudy.accuracy` of model ``name`` (``ctx``: a `mechdiff.studies.resources.Context`): one
    forward a prompt of ``[eval] n``, in passes of ``[eval] batch_size``."""
    from ..resources import StageCost

    e, t = ctx.spec.eval, ctx.lengths
    return StageCost(
        f"accuracy:{name}",
        1,
        e.n,
        ctx.rows(e.n),
        ctx.fwd(e.n, t.tokens),
        ctx.weights,
        0,
        ctx.act(ctx.rows(e.n), t.longest),
        reads=ctx.reads(math.ceil(e.n / e.batch_size)),
    )


class CircuitsStudy(Study):
    """Runs the stages of one `RunSpec` into ``spec.output.dir``."""

    kind = "circuits"
    settings_key = "spec"  # the reports and `mechdiff view` tell a circuits run.json by it

    @classmethod
    def plan_inputs(cls, path: Optional[str | Path], task: Optional[str] = None, dtype: Optional[str] = None) -> Any:
        """The task file's spec, the base's dims and the task's token lengths (`circuits_inputs`)."""
        from ..resources import circuits_inputs
        from .spec import study_spec

        return circuits_inputs(study_spec(path, task), dtype=dtype)

    @classmethod
    def stage_costs(cls, inputs: Any, device: Any) -> list:
        """Every stage's cost (`circuits_costs`: the accuracy stage's counted here, `accuracy_cost`; the others still
        in `mechdiff.studies.resources`, beside this class rather than in it)."""
        from ..resources import circuits_costs

        return circuits_costs(inputs, device, accuracy_cost)

    @classmethod
    def with_batch(cls, settings: Any, cost: Any, batch: int) -> Any:
        from ..resources import _with_batch

        return _with_batch(settings, cost, batch)

    def __init__(self, spec: RunSpec, progress: bool = True, out_dir: Optional[str] = None):
        super().__init__(out_dir or spec.output.dir, progress)  # writable before anything loads or computes
        self._dcm_cache_mode: Optional[tuple[str, str]] = None  # DCM's pair-cache mode, chosen at its first stage
        self.spec = spec
        self.store = str(Path(spec.output.store))
        check_writable(Path(self.store).parent, "activation store directory")
        self.task  # noqa: B018 - an imported task's prompt sets are drawn (or refused, short of rows) before weights
        # Check the set before any weights load: weights present (or --remote set up), shapes, vocabularies, names.
        from ...models.remote import check_remote
        from .reproduce import check_weights

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
        self.tokenizer = _tokenizer(spec.models.base)

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

    # -- data ---------------------------------------------------------------------------
    def task_inputs(self) -> dict:
        """What every stage depends on besides its own section: the task, how models load, the
        held-out vocabulary, the tokenizer (the base's) and the code version."""
        from ...version import __version__

        return {
            "task": asdict(self.spec.task),
            "dtype": self.spec.models.dtype,
            "device_map": self.spec.models.device_map,
            "vocabulary": vocabulary_digest(self.task),
            "tokenizer": self.digests[self.spec.models.base],
            "mechdiff": __version__,
            **rows_inputs(self.task, self.prompt_sets),
            **self.item_inputs(),
            **({"remote": True} if self.spec.models.remote else {}),
        }

    def item_inputs(self) -> dict:
        """What items add to every stage's key: the nested sets where declared, and for a generated task the
        prompts each set drew past (an earlier set held their item); empty where neither, so the keys of a study
        whose generated prompts never repeat across sets stay what they were."""
        out: dict = {"nested_sets": self.nested_sets()} if self.spec.sets.nested else {}
        generated = self.generated_sets
        left_out = generated.left_out(self.tokenizer) if generated is not None else {}
        return {**out, "items_left_out": left_out} if left_out else out

    def metric_inputs(self) -> dict:
        """The task's metric, in the keys of the stages whose continuous scores it sets (the position scan, the
        circuit, pruning, the matrix, CMAP); none for ``prob``, so those stages' keys stay as they were before it
        counted."""
        return {} if self.task.metric == "prob" else {"metric": self.task.metric}

    @property
    def task(self) -> Task:
        """The task the task file's ``[task]`` section names (registered, or an imported task directory), with the
        study's prompt sets drawn from its rows where it holds a fixed list of them (`prompt_sets`), else its
        generators drawing each named set disjoint by item (`GeneratedSets`)."""
        if getattr(self, "_task", None) is None or self._task[0] != self.spec.task.name:
            from ...tasks.prompt_sets import GeneratedSets

            base = get_task(self.spec.task.name)
            sizes, nested = self.prompt_set_sizes(base), self.nested_sets(base)
            task, sets = base.draw_prompt_sets(sizes, self.spec.task.seed, nested)
            generated = None
            if base.strata is None:
                seed, options = self.spec.task.seed, {"n_boxes": self.spec.task.n_boxes, **base.split_options("eval")}
                blocks = {n: (k, prompt_seed(seed, nested[0] if n in nested else n)) for n, k in sizes.items()}
                generated = GeneratedSets(base, blocks, nested, base.kwargs(**options))
                task = generated.task()
            self._task = (self.spec.task.name, task, sets, generated)
        return self._task[1]

    @property
    def prompt_sets(self) -> dict[str, list[int]]:
        """Each prompt set's task rows (indices into an imported task's pairs), disjoint by item and stratified by
        (template, token length); empty for a task that generates its prompts (each set seeded by its name)."""
        self.task  # noqa: B018 - draws the sets
        return self._task[2]

    @property
    def generated_sets(self) -> Any:
        """A generated task's `GeneratedSets` (None for an imported task)."""
        self.task  # noqa: B018 - draws the sets
        return self._task[3]

    def nested_sets(self, task: Optional[Task] = None) -> list[str]:
        """The sets drawn as first-N of one draw (``[sets] nested = true``: those of `NESTED_SETS` the
        study has), in the order they are dealt; none by default (every set disjoint by item)."""
        from .spec import NESTED_SETS

        if not self.spec.sets.nested:
            return []
        return [name for name in self.prompt_set_sizes(task) if name in NESTED_SETS]

    def prompt_set_sizes(self, task: Optional[Task] = None) -> dict[str, int]:
        """The rows each prompt set of the study needs, in the order they are dealt: the mean-ablation reference
        first (so every group of the task has reference prompts), then as the stages run (``task``: the study's,
        where it is being built)."""
        d, s, p = self.spec.discovery, self.spec.scoring, self.spec.positions
        sizes = {"reference": s.reference_n, "eval": self.spec.eval.n}
        if p.n > 0:
            sizes["positions"] = p.n
        sizes.update({"ranking": d.n, "curve": d.curve_n} if d.method == "curve" else {"discovery": d.n})
        sizes["matrix"] = s.n
        if s.prune:
            sizes["prune"] = s.prune_n
        if (task or self.task).desiderata:
            sizes["dcm"] = self.spec.dcm.n_train + self.spec.dcm.n_val + self.spec.dcm.n_test
        if self.spec.models.finetunes:
            sizes["cmap"] = self.spec.cmap.n
        return sizes

    def prompt_set_items(self) -> dict[str, int]:
        """The items each prompt set takes (its rows' distinct items: clean prompts, or the task's item field), as
        the study's own set construction draws them before any weights load: an imported task's from its rows, a
        generated task's from its generators' prompts (one row an item where no prompt repeats). What ``--plan``
        computes each set's detectable difference on (`detectable_text`)."""
        return {name: int(k) for name, k in self.prompt_sets_record()["items"].items()}

    def options(self, held_out: bool = True, prompts: Optional[str] = None) -> dict:
        """Generator options: ``n_boxes``, the objects held out from fine-tuning where the task splits its
        objects (`split_options`), and the prompt set's name (an imported task
        hands out that set's rows); the task keeps only the options it accepts."""
        split = self.task.split_options("eval") if held_out else {}
        return {"n_boxes": self.spec.task.n_boxes, "prompt_set": prompts, **split}

    def seed(self, prompts: str) -> int:
        """The seed of one of the study's prompt sets (`prompt_seed`); nested sets
        (``[sets] nested = true``) share the first nested set's, so each is a prefix of one draw."""
        nested = self.nested_sets()
        return prompt_seed(self.spec.task.seed, nested[0] if prompts in nested else prompts)

    def eval_records(self) -> list:
        return self.task.records(self.tokenizer, self.spec.eval.n, self.seed("eval"), **self.options(prompts="eval"))

    def model(self, name: str) -> LoadedModel:
        return self.models[name]

    # -- stages -------------------------------------------------------------------------
    def accuracy(self, name: str) -> StageRecord:
        from ...patching.evaluate import evaluate

        def compute() -> dict:
            lm = self.model(name)
            res = evaluate(
                lm, self.eval_records(), self.spec.eval.batch_size, desc=f"accuracy {name}", progress=self.progress
            )
            return {**res.to_dict(), "fingerprint": lm.fingerprint, "provenance": lm.provenance}

        return self.cache.run(f"accuracy:{name}", self._accuracy_inputs(name), compute)

    def _accuracy_inputs(self, name: str) -> dict:
        return {"model": self.digests[name], "task": self.task_inputs(), "eval": self.eval_inputs(), "split": "eval"}

    def eval_inputs(self) -> dict:
        """``[eval]`` as the accuracy stage's key reads it: the floor decides which stages run, not what it measures."""
        return {k: v for k, v in asdict(self.spec.eval).items() if k != "floor"}

    def floor(self) -> float:
        """The accuracy a model's lower bound must exceed for the study to explain its behaviour (`floor_is`)."""
        return self.floor_is()[0]

    def floor_is(self) -> tuple[float, str]:
        """The floor and how it was set, in words: ``[eval] floor``, else the task's chance level, else chance
        derived from the accuracy prompts (one over their distinct answers,
        `answer_chance`)."""
        from ...tasks.base import answer_chance

        if self.spec.eval.floor is not None:
            return self.spec.eval.floor, "set by the task file's [eval] floor"
        chance = self.task.chance
        if chance:
            return chance(**self.task.kwargs(n_boxes=self.spec.task.n_boxes)), "the task's chance level"
        drawn = (self.spec.task.name, self.spec.eval.n, self.spec.task.seed)
        if getattr(self, "_chance", (None,))[0] != drawn:  # the accuracy prompts read once
            self._chance = (drawn, answer_chance(self.eval_records()))
        return self._chance[1]

    def has_behaviour(self, accuracy: StageRecord) -> bool:
        """Whether a model's accuracy (exact binomial lower bound) is above `floor`; in a plan, before the
        accuracy is computed, every model is taken to have it (the plan lists every stage that may run)."""
        try:
            return accuracy.result["accuracy"]["low"] > self.floor()
        except Pending:
            return True

    def without_behaviour(self, accuracy: dict[str, StageRecord]) -> dict[str, str]:
        """Model -> why the stages that explain a behaviour are not run for it (its accuracy is not above the
        floor); empty where every model has the behaviour."""
        (floor, how), source = self.floor_is(), "[eval] floor" if self.spec.eval.floor is not None else "the floor"
        out = {}
        for name, rec in accuracy.items():
            if not self.has_behaviour(rec):
                a = rec.result["accuracy"]
                out[name] = (
                    f"it answers {a['value']:.3f} [{a['low']:.3f}, {a['high']:.3f}] of the {a['n']} accuracy prompts, "
                    f"not above {source} {floor:.3f} ({how}): there is no behaviour to explain, so its "
                    "position scan, circuit, pruning, matrix row, DCM and CMAP into it were not run"
                )
        return out

    def positions(self, name: str) -> Optional[StageRecord]:
        """The position scan of ``name``: which position classes must keep every head (None: ``n = 0``)."""
        from ...circuits.positions import position_scan, task_classes
        from ...report.positions import position_scan_figure

        p = self.spec.positions
        if p.n < 1:
            return None

        def compute() -> dict:
            scorer = self.scorer(name, "positions", p.n)
            scan = position_scan(scorer, task_classes(scorer), stop_at=p.stop_at, max_steps=p.max_steps)
            path = self.dir / "figures" / f"positions_{label(name)}.png"
            position_scan_figure(scan, path, title=f"{name}: every head kept at the classes chosen so far")
            return {"scan": scan, "figure": str(path.relative_to(self.dir))}

        return self.cache.run(
            f"positions:{name}",
            {
                "model": self.digests[name],
                "task": self.task_inputs(),
                "positions": asdict(p),
                "scoring": self._reference(),
                **self.metric_inputs(),
            },
            compute,
        )

    def circuit(self, name: str) -> StageRecord:
        """The circuit of ``name`` by the configured method (``[discovery] method``)."""
        compute = self._curve_circuit if self.spec.discovery.method == "curve" else self._path_circuit
        return self.cache.run(f"circuit:{name}", self._circuit_inputs(name), lambda: compute(name))

    def _circuit_inputs(self, name: str) -> dict:
        from ...tasks.plan import task_plan

        d = self.spec.discovery
        plan_k = task_plan(self.task).k if d.method == "path" else None
        inputs = {"model": self.digests[name], "task": self.task_inputs(), "discovery": discovery_inputs(d, plan_k)}
        inputs.update(self.metric_inputs())
        if d.method == "curve":
            inputs["scoring"] = self._reference()
        return inputs

    def _curve_circuit(self, name: str) -> dict:
        """Rank every (head, position class) pair by attribution, score nested circuits, keep the smallest
        reaching the target; the ranking's stability over bootstrap resamples of its prompts."""
        from ...circuits.curve import curve_circuit
        from ...circuits.positions import task_classes
        from ...circuits.pruning import pair_name
        from ...report.positions import curve_figure, stability_figure

        d = self.spec.discovery
        ranker = self.scorer(name, "ranking", d.n)
        classes = task_classes(ranker)
        found = curve_circuit(
            ranker,
            self.scorer(name, "curve", d.curve_n),
            classes,
            d.sizes,
            d.target,
            d.select,
            d.stability_draws,
            self.seed("ranking"),
            name,
            self.task.name,
        )
        circuit, curve, ranked, n, stability, scores = (
            found.circuit,
            found.curve,
            found.ranked,
            found.n,
            found.stability,
            found.scores,
        )
        circuit.save(self.dir / "circuits" / f"{label(name)}.json")
        figures = {
            "curve": self.dir / "figures" / f"curve_{label(name)}.png",
            "stability": self.dir / "figures" / f"stability_{label(name)}.png",
        }
        curve_figure(curve, figures["curve"], title=f"{name}: faithfulness vs circuit size")
        kept = {pair_name(p): stability[p] for p in ranked[:n]}
        in_circuit = set(ranked[:n])
        stability_figure(
            kept,
            n / len(ranked),
            figures["stability"],
            title=f"{name}: selection frequency over {d.stability_draws} resamples of {d.n} prompts",
        )
        return {
            "circuit": circuit.to_dict(),
            "curve": curve,
            "classes": classes,
            "stability": {
                "draws": d.stability_draws,
                "chance": n / len(ranked),
                "selected": kept,
                "others": {pair_name(p): f for p, f in stability.items() if f > 0 and p not in in_circuit},
            },
            "ranking": [[pair_name(p), scores[p]] for p in ranked[: 2 * n]],
            "figures": {k: str(v.relative_to(self.dir)) for k, v in figures.items()},
        }

    def path_settings(self, name: str, plan: Any) -> Any:
        """Model ``name``'s path-patching settings: the section's, with what ``[discovery.models.NAME]`` sets for it
        (top_k, circuit_k, seed), each step table cut to the steps of ``plan``."""
        from ...circuits.discovery import DiscoverySettings

        d, t = self.spec.discovery, self.spec.task
        own = d.models.get(name, {})
        steps_of_plan = {step.name for step in plan.steps}
        return DiscoverySettings(
            k={s: k for s, k in own.get("top_k", d.top_k).items() if s in steps_of_plan},
            circuit_k={s: k for s, k in own.get("circuit_k", d.circuit_k).items() if s in steps_of_plan},
            screen=d.screen,
            screen_multiple=d.screen_multiple,
            n_prompts=d.n,
            n_boxes=t.n_boxes,
            seed=own.get("seed", self.seed("discovery")),
            score=d.score,
            source_position={s: p for s, p in d.source_position.items() if s in steps_of_plan},
            pairs_per_part=d.pairs_per_part,
        )

    def pair_options(self) -> dict:
        """The path-patching pairs' options ``[discovery]`` sets off their defaults: the paper's counterfactual
        construction, and the study's clean prompts where a model's seed redraws only the counterfactuals (none at the
        defaults, so every other task's generator is called as before)."""
        from .spec import KEYED_WHEN_SET

        d, defaults = self.spec.discovery, KEYED_WHEN_SET["discovery"]
        out = {}
        if d.counterfactual != defaults["counterfactual"]:
            out["counterfactual"] = d.counterfactual
        if d.model_seed_redraws != defaults["model_seed_redraws"]:
            out["clean_seed"] = self.seed("discovery")
        return out

    def _path_circuit(self, name: str) -> dict:
        """The paper's path patching: each step of the task's plan keeps its top-k heads as the next step's
        receivers and puts its top circuit_k heads (default: the same) in the circuit."""
        from ...circuits.discovery import discover
        from ...report.figures import head_heatmap
        from ...tasks.plan import task_plan

        d = self.spec.discovery
        lm = self.model(name)
        plan = task_plan(self.task)
        settings = self.path_settings(name, plan)
        pairs = self.task.discovery_pairs(
            self.tokenizer, d.n, settings.seed, **self.options(prompts="discovery"), **self.pair_options()
        )
        circuit, steps = discover(
            lm, pairs, settings, task=self.task.name, progress=self.progress, plan=plan, metric=self.task.metric
        )
        figures = {}
        for step, res in steps.items():
            path = self.dir / "figures" / f"path_patching_{label(name)}_{step}.png"
            head_heatmap(
                res.exact,
                lm.shape.n_layers,
                lm.shape.n_heads,
                path,
                title=f"{name}: step {step} ({circuit.names.get(step, '')}), senders at {res.sender_position}",
                selected=res.selected,
                label=f"(p_patched - p_clean)/p_clean, p: {metric_label(self.task.metric)}",
            )
            figures[step] = str(path.relative_to(self.dir))
        circuit.save(self.dir / "circuits" / f"{label(name)}.json")
        return {
            "circuit": circuit.to_dict(),
            "figures": figures,
            "exact": {s: {h.name: v for h, v in r.exact.items()} for s, r in steps.items()},
        }

    def _reference(self) -> dict:
        """What a scorer's ablation means depend on besides the task and model."""
        return {"reference_n": self.spec.scoring.reference_n, "batch_size": self.spec.eval.batch_size}

    def scored_sets(self) -> dict[str, int]:
        """The prompt sets scored under mean ablation (name -> number of prompts), as the stages ask for them."""
        d, s, p = self.spec.discovery, self.spec.scoring, self.spec.positions
        out = {"matrix": s.n}
        if p.n > 0:
            out["positions"] = p.n
        if d.method == "curve":
            out.update(ranking=d.n, curve=d.curve_n)
        if s.prune:
            out["prune"] = s.prune_n
        return out

    def check_prompts(self) -> None:
        """Before any weights load: every scored prompt's group (template, token length) has reference prompts
        (mean ablation never averages across templates or lengths), and the task's rows are readable."""
        from ...tasks.base import check_reference

        reference = self.reference_records()
        for prompts, n in self.scored_sets().items():
            records = self.task.records(self.tokenizer, n, self.seed(prompts), **self.options(prompts=prompts))
            check_reference(records, reference, f"{prompts} prompts")

    def reference_records(self, seed: Optional[int] = None) -> list:
        """The mean-ablation reference: ``reference_n`` prompts of their own (held-out objects, like every set),
        drawn by the study's seed or by ``seed`` (a model's pruning seed, as if it were the task's)."""
        s = self.spec.scoring
        drawn = self.seed("reference") if seed is None else prompt_seed(seed, "reference")
        return self.task.reference_records(self.tokenizer, s.reference_n, drawn, **self.options(prompts="reference"))

    def prompt_records(self, prompts: str, n: int) -> list:
        """The ``n`` records of the named prompt set (held-out objects; an imported task's drawn rows)."""
        return self.task.records(self.tokenizer, n, self.seed(prompts), **self.options(prompts=prompts))

    def scorer(self, name: str, prompts: str = "matrix", n: Optional[int] = None, seed: Optional[int] = None):
        """A scorer of ``name`` on ``n`` prompts of the named set; every scorer ablates with the means of the
        same ``reference_n`` reference prompts (held-out objects, like every other prompt set), or of those a
        seed of its own draws (``seed``: a model's pruning seed)."""
        from ...circuits.scoring import Scorer

        records = self.prompt_records(prompts, n or self.spec.scoring.n)
        return Scorer.build(
            self.model(name),
            records,
            self.reference_records(seed),
            self.spec.eval.batch_size,
            self.progress,
            store=self.store,
            metric=self.task.metric,
        )

    def pruned(self, name: str, circuit_rec: StageRecord) -> StageRecord:
        """The circuit of ``circuit_rec`` pruned on ``name``; ``[scoring.models.NAME] seed`` (the paper: one per
        model) draws this model's pruning reference and greedy candidates in place of the study's seed."""
        from ...circuits.pruning import disjoint_groups, minimality, pairwise_minimality, prune

        s = self.spec.scoring
        own = s.models.get(name, {}).get("seed")
        seed = self.seed("prune") if own is None else prompt_seed(own, "prune")

        def compute() -> dict:
            circuit = Circuit.from_dict(circuit_rec.result["circuit"])
            if s.prune_disjoint:  # the paper: A minus B before pruning, so no pair is scored in two groups
                circuit = disjoint_groups(circuit)
            # Pruning decides on its own prompts, never on those the matrix reports.
            scorer = self.scorer(name, "prune", s.prune_n, own)
            metric = self.prune_metric()
            if s.prune_rule == "paper":
                result = pairwise_minimality(
                    scorer, circuit, metric=metric, share=s.prune_share, threshold=s.prune_threshold
                )
            else:
                result = minimality(
                    scorer,
                    circuit,
                    max_steps=s.prune_steps,
                    n_candidates=s.prune_candidates,
                    seed=seed,
                    metric=metric,
                    threshold=s.prune_threshold,
                )
            pruned = prune(circuit, result, s.prune_threshold)
            pruned.save(self.dir / "circuits" / f"{label(name)}.pruned.json")
            return {"circuit": pruned.to_dict(), "minimality": result}

        return self.cache.run(f"prune:{name}", self._prune_inputs(name, circuit_rec.key), compute)

    def prune_metric(self) -> str:
        """The metric pruning decides on: ``accuracy``, or for ``[scoring] prune_metric = "prob"`` (the continuous)
        the task's own (the answer's probability, or the logit difference)."""
        return scored_metric(self.spec.scoring.prune_metric, self.task.metric)

    def _prune_inputs(self, name: str, circuit_key: str) -> dict:
        scoring = section_inputs("scoring", self.spec.scoring)
        own = scoring.pop("models", {}).get(name)  # another model's seed leaves this stage's key alone
        for k, keyed in MATRIX_ONLY.items():  # the matrix's random control leaves pruning's key alone
            if keyed is None:
                scoring.pop(k, None)
            else:
                scoring[k] = keyed
        return {
            "model": self.digests[name],
            "circuit": circuit_key,
            "scoring": {**scoring, **({"models": {name: own}} if own is not None else {})},
            "task": self.task_inputs(),
            **self.metric_inputs(),
        }

    def matrix(self, name: str, circuits: dict[str, StageRecord]) -> StageRecord:
        """Every circuit of ``circuits`` scored on ``name``; random circuits and completeness for its own."""
        from ...circuits.scoring import completeness, matrix_rows

        s = self.spec.scoring

        def compute() -> dict:
            scorer = self.scorer(name, "matrix")
            loaded = {key: Circuit.from_dict(rec.result["circuit"]) for key, rec in circuits.items()}
            outcomes: dict = {}
            rows = matrix_rows(
                name,
                loaded,
                scorer,
                n_random=s.random_draws,
                seed=self.seed("matrix"),
                random_for=[name],
                outcomes=outcomes,
                random_prompts=s.random_prompts,
                # an item: a clean prompt (its tokens), so the draws' intervals resample prompts, not rows
                items=[" ".join(map(str, r.input_ids)) for r in scorer.records],
            )
            own = loaded.get(name)
            comp = (
                completeness(
                    scorer,
                    own,
                    n_draws=s.completeness_draws,
                    seed=self.seed("matrix"),
                    groups=self.analysis_groups(own, s.completeness_groups or self.spec.dcm.groups, check=False),
                )
                if own is not None and s.completeness_draws > 0
                else None
            )
            return {"rows": rows, "completeness": comp, "outcomes": outcomes}

        return self.cache.run(
            f"matrix:{name}",
            {
                "model": self.digests[name],
                "task": self.task_inputs(),
                "circuits": {k: r.key for k, r in circuits.items()},
                "scoring": section_inputs("scoring", s),
                **self.metric_inputs(),
            },
            compute,
        )

    def analysis_groups(self, circuit: Circuit, wanted: list[str], check: bool = True) -> list[str]:
        """The groups DCM and CMAP (``check``: groups at a position the prompts carry) or completeness look at;
        each patches every token of a group's position class (`group_choice`)."""
        return self.group_choice(circuit, wanted, check)[0]

    def group_choice(self, circuit: Circuit, wanted: list[str], check: bool = True) -> tuple[list, dict]:
        """The groups a stage looks at and each group left out, with why (`group_choice`)."""
        return group_choice(self.task, self.probe_records(), circuit, wanted, check)

    def probe_records(self) -> list:
        """A few of the task's eval prompts (16), enough to read which positions its prompts carry and how."""
        return self.task.records(self.tokenizer, 16, self.seed("eval"), **self.options(prompts="eval"))

    def class_groups(self, wanted: list[str]) -> dict[str, list[str]]:
        """Key inputs naming the classes of several tokens a DCM or CMAP stage may patch (`class_groups`);
        a path circuit's groups (a plan's steps) sit at their step's sender position."""
        from ...tasks.plan import task_plan

        path = self.spec.discovery.method == "path"
        at = {s.name: s.sender for s in task_plan(self.task).steps} if path else {}
        return class_groups(self.probe_records(), wanted, at)

    def dcm(self, circuit_rec: StageRecord, name: Optional[str] = None) -> StageRecord:
        """DCM masks over the groups of ``circuit_rec``'s circuit in model ``name`` (default: the base); semantic
        patching of the selections into every model for the base's."""
        from ...methods.dcm import dcm_circuit, semantic_patching, split_pairs
        from ...tasks.desiderata import chosen_desiderata, desideratum_pairs

        c, t = self.spec.dcm, self.spec.task
        base = self.spec.models.base
        name = name or base

        def compute() -> dict:
            circuit = Circuit.from_dict(circuit_rec.result["circuit"])
            config = dcm_config(self.spec)
            opts = self.options()
            n = c.n_train + c.n_val + c.n_test
            # the configured desiderata the task defines; none of them: the task's own (an imported task's
            # counterfactual: the patched run should give the counterfactual prompt's answer)
            names = chosen_desiderata(c.desiderata, self.task.desiderata)
            if not names:
                return {
                    "dcm": [],
                    "semantic": [],
                    "skipped": f"the task declares no desideratum: {self.task.name} defines none (import it "
                    "with --desideratum NAME=COLUMN, or give every row a counterfactual_answer)",
                }
            desiderata = {
                d: desideratum_pairs(
                    d,
                    self.tokenizer,
                    n,
                    t.n_boxes,
                    self.seed("dcm"),
                    vocabulary=opts.get("vocabulary"),
                    task=self.task,
                    prompt_set="dcm",
                )
                for d in names
            }
            groups, left_out = self.group_choice(circuit, c.groups)
            left_out.update(unpaired_classes(circuit, groups, desiderata, config.eval_batch))
            groups = [g for g in groups if g not in left_out]
            if not groups:
                return {
                    "dcm": [],
                    "semantic": [],
                    "skipped": f"no group of the circuit of {name} with heads sits at a position DCM can patch",
                    "left_out": left_out,
                }
            items = self.dcm_items(n)
            mode, why = self.dcm_cache_mode()
            log.info("DCM of %s: pair cache %s (%s)", name, mode, why)
            results = dcm_circuit(
                self.model(name), circuit, desiderata, config, groups, self.progress, items=items, mode=mode
            )
            semantic = []
            for r in results if name == base else ():
                if not r.selected:
                    continue
                test = split_pairs(desiderata[r.desideratum], config.split, config.seed, items)[2]
                for sem in semantic_patching(
                    self.models,
                    r.selected,
                    r.position,
                    test,
                    self.spec.eval.batch_size,
                    n_random=c.n_random,
                    seed=config.seed + 1,
                    mode=mode,
                ):
                    semantic.append(
                        {
                            "group": r.group,
                            "desideratum": r.desideratum,
                            "heads": [h.name for h in r.selected],
                            **sem.to_dict(),
                        }
                    )
            records = [r.to_dict() for r in results]
            return {"model": name, "dcm": records, "semantic": semantic, "left_out": left_out, "cache": mode}

        # the pair cache's mode is not in the key: the modes give the same results but for float rounding
        section = {k: v for k, v in asdict(c).items() if k != "cache"}
        inputs = {"models": self.digests, "circuit": circuit_rec.key, "dcm": section, "task": self.task_inputs()}
        inputs.update(self.class_groups(c.groups))
        stage = "dcm" if name == base else f"dcm:{name}"
        if not self.cache.planning and not self.cache.ready(stage, inputs):
            self.dcm_cache_mode()  # chosen (this machine measured) before the stage's own work and time begin
        return self.cache.run(stage, inputs, compute)

    def dcm_cache_mode(self) -> tuple[str, str]:
        """DCM's pair-cache mode and why (`run_cache_mode`), chosen once a run."""
        if self._dcm_cache_mode is None:
            from ..resources import run_cache_mode

            self._dcm_cache_mode = run_cache_mode(self.spec)
        return self._dcm_cache_mode

    def dcm_items(self, n: int) -> Optional[list]:
        """The item of each of DCM's ``n`` pairs: an imported task's items of the ``dcm`` set's rows (its clean
        prompt, or the field it names); None for a generated task (DCM reads a pair's clean prompt itself)."""
        t = self.task
        if "dcm" not in self.prompt_sets or t.items is None:
            return None
        return [t.items[r] for r in self.prompt_sets["dcm"][:n]]

    def dcm_circuit(self, found: dict[str, StageRecord], pruned: dict[str, StageRecord], name: str) -> StageRecord:
        """The circuit record DCM masks for ``name``: its pruned circuit under ``[dcm] circuit = "pruned"``."""
        return pruned[name] if self.spec.dcm.circuit == "pruned" else found[name]

    def cmap_of(self, finetune: str, found: dict[str, StageRecord], pruned: dict[str, StageRecord]) -> StageRecord:
        """CMAP of ``finetune`` by the configured scope: the base's found circuit (``"base"``) or, as the paper,
        the fine-tune's pruned circuit cut to its own DCM selections (``"paper"``)."""
        if self.spec.cmap.scope != "paper":
            return self.cmap(finetune, found[self.spec.models.base])
        own = pruned[finetune]
        return self.cmap(finetune, own, self.dcm(own, finetune))

    def cmap(self, finetune: str, circuit_rec: StageRecord, dcm_rec: Optional[StageRecord] = None) -> StageRecord:
        from ...circuits.scoring import control_prompts
        from ...methods.cmap import dcm_cut, run_cmap

        c = self.spec.cmap
        base = self.spec.models.base
        owner = finetune if c.scope == "paper" else base

        def compute() -> dict:
            circuit = Circuit.from_dict(circuit_rec.result["circuit"])
            if dcm_rec is not None:
                circuit = dcm_cut(circuit, dcm_rec.result["dcm"], c.selection)
            if not circuit.heads():
                return {"skipped": f"the circuit of {owner} has no heads left after pruning; there is nothing to patch"}
            records = self.task.records(self.tokenizer, c.n, self.seed("cmap"), **self.options(prompts="cmap"))
            groups, left_out = self.group_choice(circuit, c.groups)
            if not groups:
                return {
                    "skipped": f"no group of the circuit of {owner} sits at a position of the task's prompts",
                    "left_out": left_out,
                }
            # the "circuit" scope: the union of these groups
            circuit = Circuit(
                circuit.model,
                circuit.task,
                {g: circuit.groups[g] for g in groups},
                {g: circuit.positions[g] for g in groups},
                names=dict(circuit.names),
            )
            res = run_cmap(
                self.model(base),
                self.model(finetune),
                circuit,
                records,
                c.parts,
                self.spec.eval.batch_size,
                progress=self.progress,
                isolate=c.isolate,
                n_random=c.n_random,
                seed=self.seed("cmap"),
                rule="paper" if c.scope == "paper" else "base",
                random_prompts=control_prompts(records, c.random_prompts, self.seed("cmap")) if c.n_random else None,
                metric=self.task.metric,
            )
            out = {**res.to_dict(), "left_out": left_out}
            return {**out, "circuit": circuit.to_dict()} if c.scope == "paper" else out

        inputs = {
            "base": self.digests[base],
            "finetune": self.digests[finetune],
            "circuit": circuit_rec.key,
            "cmap": asdict(c),
            "task": self.task_inputs(),
            **self.metric_inputs(),  # a logit_diff task's CMAP scores the logit difference too
        }
        if dcm_rec is not None:
            inputs["dcm"] = dcm_rec.key
        inputs.update(self.class_groups(c.groups))
        return self.cache.run(f"cmap:{finetune}", inputs, compute)

    # -- the whole study ----------------------------------------------------------------
    def run_model(self, name: str, poll: float = 5.0) -> None:
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
            accuracy = self.cache.ready(f"accuracy:{n}", self._accuracy_inputs(n))
            if accuracy and not self.has_behaviour(self.accuracy(n)):
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
            from .reproduce import reproduction_records

            out["reproduction"] = reproduction_records(self)
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

    def resources_record(self) -> Optional[dict]:
        """The planner's stage FLOPs and this machine's measured throughput (`run_record`),
        measured once per study, so ``run.json`` and the report read the same figures."""
        if not hasattr(self, "_resources"):
            from ..resources import run_record

            try:
                self._resources = run_record(self.spec)
            except (OSError, ValueError) as err:  # no config or tokenizer to plan from: the run's results stand
                self._resources = {"not_planned": str(err)}
        return self._resources

    def set_items(self, prompts: str) -> Any:
        """The item id of each row of the prompt set ``prompts`` (``np.ndarray``, int64), aligned with the rows its
        stages score (their first ``n`` where a stage reads fewer): rows of one item share an id, and ids are the
        study's (one item, one id in every set), as ``run.json``'s ``prompt_sets.item_ids`` records them. What an
        interval clustered by item resamples. A model's own discovery or pruning seed (``[discovery.models.NAME]``)
        draws other prompts than these."""
        from ...tasks.prompt_sets import set_items

        return set_items(self.prompt_sets_record(), prompts)

    def prompt_sets_record(self) -> dict:
        """``run.json``'s account of the prompt sets: each set's rows (an imported task's task rows) and item ids
        (aligned with the rows its stages score: `set_items` reads them), the sets
        each stage reads, and what the report states of them (rows and items per set, groups, rows and items shared
        between sets, counterfactuals that are another item's prompt), computed from the lists; declared nested
        sets as a departure."""
        from ...tasks.prompt_sets import describe_items, describe_sets, nested_departure

        sets, ranked = self.prompt_sets, "discovery" if self.spec.discovery.method == "path" else "ranking"
        sizes, nested = self.prompt_set_sizes(), self.nested_sets()
        reads = {
            "accuracy": ["eval"],
            "positions": ["positions", "reference"],
            "circuit": [ranked, "curve", "reference"] if ranked == "ranking" else [ranked],
            "prune": ["prune", "reference"],
            "matrix": ["matrix", "reference"],
            "dcm": ["dcm"],
            "cmap": ["cmap"],
        }
        stages = {stage: [n for n in names if n in sizes] for stage, names in reads.items()}
        if sets:
            t = self.task
            out = {"rows": sets, **describe_sets(sets, t.strata, t.items, t.sources, nested)}
        else:
            generated = self.generated_sets
            keys = generated.set_keys(sizes, self.tokenizer)
            out = {"generated": True, **describe_items(keys, nested), "left_out": generated.left_out(self.tokenizer)}
        out.update(stages={k: v for k, v in stages.items() if v}, nested=nested)
        if nested:
            out["departure"] = nested_departure(nested)
        return out


def analysis_groups(task: Any, records: list, circuit: Circuit, wanted: list[str]) -> list[str]:
    """The groups DCM and CMAP look at (`group_choice`)."""
    return group_choice(task, records, circuit, wanted)[0]


def group_choice(
    task: Any, records: list, circuit: Circuit, wanted: list[str], check: bool = True
) -> tuple[list[str], dict[str, str]]:
    """``wanted`` where given (those of the circuit that have heads), else (or where ``wanted`` names none of the
    task's positions: another task's defaults) every non-empty group of ``circuit``; with ``check`` (DCM and
    CMAP) those whose position the prompts of ``records`` carry (a few of the task's prompts), as a named token
    of every prompt or as a position class of any number of tokens (DCM and CMAP patch each of them), and each
    group left out, with why (the report says it)."""
    if wanted and set(wanted) & {*task.positions, *circuit.groups}:
        groups = [g for g in wanted if circuit.groups.get(g)]
    else:
        groups = [g for g, heads in circuit.groups.items() if heads]
    if not check:
        return groups, {}
    from ...tasks.base import batch_tensors, grouped_batches, take

    batches = [batch_tensors(take(records, rows)) for rows in grouped_batches(records, 4)]
    left_out = {g: why for g in groups if (why := _position_missing(batches, circuit.positions[g]))}
    return [g for g in groups if g not in left_out], left_out


def class_groups(records: list, wanted: list[str], at: Optional[dict[str, str]] = None) -> dict[str, list[str]]:
    """Key inputs naming the positions a DCM or CMAP stage may patch that are classes of several tokens in the
    prompts of ``records`` (``wanted`` where it names their positions, each group read at ``at``'s position where
    given; else every position of the prompts): DCM and CMAP patch every token of them since #40's item 5 (earlier
    such groups were left out). Empty where every such position is one named token, so the keys of studies
    without class groups stay what they were. Read from the prompts, not a circuit, so that a plan knows the key
    before the circuit is computed."""
    from ...circuits.scoring import is_one_token
    from ...tasks.base import batch_tensors, grouped_batches, take

    at = at or {}
    batches = [batch_tensors(take(records, rows)) for rows in grouped_batches(records, 4)]
    named = {n for b in batches for n in (*b["positions"], *b.get("position_classes", {}))}
    names = [at.get(g, g) for g in wanted if at.get(g, g) in named] or sorted(named)

    def wide(name: str, b: dict) -> bool:  # as the engine reads a position: a named token first (is_one_token)
        return not is_one_token(b, name) if name in b["positions"] else name in b.get("position_classes", {})

    found = [g for g in names if any(wide(g, b) for b in batches)]
    return {"class_groups": found} if found else {}


def unpaired_classes(circuit: Circuit, groups: list[str], desiderata: dict, batch_size: int) -> dict[str, str]:
    """The groups at a position class whose token count differs between a desideratum pair's two prompts, with
    why: DCM writes the source's tokens of the class into the base's token for token
    (`class_widths`)."""
    from ...methods.dcm import UnequalClass, class_widths

    out = {}
    for g in groups:
        for d, pairs in desiderata.items():
            try:
                class_widths(pairs, [circuit.positions[g]], batch_size)
            except UnequalClass as error:
                out[g] = f"desideratum {d}: {error}"
                break
    return out


def _position_missing(batches: list[dict], name: str) -> str:
    """Why DCM and CMAP cannot patch position ``name`` in the prompts of ``batches`` ("" where they can): it is
    neither a named position nor a position class of them, or a named token absent from some prompt."""
    for batch in batches:
        where = batch["positions"].get(name)
        if where is None and name not in batch.get("position_classes", {}):
            return f"its position `{name}` is neither a named position nor a position class of the task's prompts"
        if where is not None and where.dim() == 1 and bool((where < 0).any()):
            return f"its position `{name}` is missing from some prompts"
    return ""


def dcm_config(spec: RunSpec):
    """The `DCMConfig` a study's ``[dcm]`` section gives (split: its pair counts)."""
    from ...methods.dcm import DCMConfig

    c = spec.dcm
    n = c.n_train + c.n_val + c.n_test
    return DCMConfig(
        lam=c.lam,
        lam_scale=c.lam_scale,
        lr=c.lr,
        epochs=c.epochs,
        batch_size=c.batch_size,
        micro_batch=c.batch_size,
        eval_batch=spec.eval.batch_size,
        eval_every=c.eval_every,
        schedule=c.schedule,
        shuffle=c.shuffle,
        split=(c.n_train / n, c.n_val / n, c.n_test / n),
        seed=spec.task.seed,
        random_pool=c.random_pool,
        n_random=c.n_random,
    )


def _tokenizer(name: str):
    from ...models.loading import load_tokenizer

    return load_tokenizer(resolve_spec(name))
