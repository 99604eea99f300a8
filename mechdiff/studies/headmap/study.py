"""The HeadMap study: locate task heads (layer-conditioned), then HeadMap against LoRA and ablations.

Stages, each cached in ``<out>/stages/`` by `mechdiff.runs.stages.StageCache`:
``locate-<task>`` (the located circuit of a task, with its figures under ``circuits/<task>/``) and
``train-<run>-seed<s>[-lr<lr>][-hlr<lr>]`` for each run of `RUNS` chosen and each training seed
(``train-base`` and ``train-lora-zoo``: one evaluation). Each key holds what the stage reads (the model's
name, the locating or training options, the heads trained, the evaluation and validation prompts); a rerun
recomputes only the stages whose inputs changed, and the tables, figures and ``report.md`` are rewritten
from the records every time.

Learning rates: with ``lrs`` set, HeadMap (on the located heads) and the small LoRA are each trained at
every rate on the first seed and each method then trains at the rate with the best accuracy on validation
prompts of *training* objects (`mechdiff.methods.headmap.choose_lr`); the held-out evaluation prompts are
never read for the choice. Seeds: run ``r`` at seed ``s`` initialises from ``s``, trains on the batches of
data seed ``data_seed + s`` and (random, outside) draws its head set from ``derive(s, ...)``
(`mechdiff.runs.seeds.derive`). Settings: `HeadMapSettings` (a task file's ``[headmap]``
section, ``tasks/headmap.toml``; the command's flags override it).
"""

from __future__ import annotations

import time
from dataclasses import asdict, replace
from pathlib import Path
from typing import Any, Callable, Optional

from ...circuits.circuit import Circuit
from ...common.io import run_lock
from ...methods.headmap import choose_lr, get_task, heads_by_layer, random_heads, train, validation_batch
from ...models.loading import LoadedModel, dtype_inputs
from ...runs.seeds import derive
from ...runs.stages import Pending, Unknown
from ..base import Study, section_study
from .locate import locate_and_write, locate_inputs, task_tokens
from .plan import headmap_costs
from .report import write_report
from .settings import LORA_RUNS, MAP_RUNS, TASK, UNSEEDED, VAL, HeadMapSettings, check_runs, load_file
from .tables import validation_accuracy
from .training import evaluate_model, evaluation_inputs, stage_name, train_inputs, zoo_evaluation


class HeadMapStudy(Study):
    """Locating on entity tracking (and the transfer task), the learning-rate sweep, the training runs on every
    seed, the tables, figures and report (kind ``headmap``).

    ``load`` loads a model by name (`model_loader`; a test's tiny models); the
    study's model is loaded at once, the zoo's LoRA only when its stage is computed."""

    kind = "headmap"

    def __init__(
        self, settings: HeadMapSettings, out: str | Path, load: Callable[[str], LoadedModel], progress: bool = True
    ):
        check_runs(settings)
        super().__init__(out, progress)
        self.settings, self.load = settings, load
        for path in settings.path_patching:  # read now, not after hours of training
            Circuit.load(path)
        self.model = load(settings.model)
        self.forget()

    @classmethod
    def from_file(
        cls,
        path: Optional[str | Path],
        out: Optional[str] = None,
        progress: bool = True,
        models: Optional[dict] = None,
        task: Optional[str] = None,
    ) -> "HeadMapStudy":
        """The study of a task file with ``[study] kind = "headmap"``; ``models``: how models load (dtype, ...)."""
        return section_study(cls, path, out, progress, models, task, load_file, "HeadMap", "tasks/headmap.toml")

    @classmethod
    def plan_inputs(cls, path: Optional[str | Path], task: Optional[str] = None, dtype: Optional[str] = None) -> Any:
        """The ``[headmap]`` settings, the model's dims and the tokens of each task it locates on."""
        from ...models.footprint import model_dims
        from ..planner import Lengths, PlanInputs, planning_tokenizer

        if path is None or task is not None:
            raise ValueError("a HeadMap study is a task file's [headmap] section; it has no [task] to override")
        st = load_file(path)[0]
        check_runs(st)
        dims, source = model_dims(st.model)
        tokenizer, used = planning_tokenizer(st.model)
        tasks = {TASK, *([st.transfer_task] if "transfer" in st.runs else [])}
        tokens = {t: task_tokens(tokenizer, t, st.seed) for t in tasks}
        lengths = Lengths(tokens[TASK], tokens[TASK], {}, 0, used)
        models = (st.model, *([st.lora_zoo] if "lora-zoo" in st.runs else []))
        rows = min(2048, st.batch_size * tokens[TASK])
        return PlanInputs(
            "headmap",
            st,
            dims,
            source,
            lengths,
            dtype or "float32",
            models,
            len(models),
            rows,
            known={"tokens": tokens},
        )

    @classmethod
    def stage_costs(cls, inputs: Any, device: Any) -> list:
        """Every stage (`headmap_costs`)."""
        return headmap_costs(inputs.meter(device), inputs.settings, inputs.known["tokens"])

    @classmethod
    def with_batch(cls, settings: Any, cost: Any, batch: int) -> Any:
        if cost.batch_option == "[headmap] batch_size":
            return replace(settings, batch_size=batch)
        return replace(settings, batch=batch) if cost.batch_option == "[headmap] batch" else settings

    def forget(self) -> None:
        """Drop what was read from stage records (after a plan, whose records may be still to compute)."""
        self.located: dict[str, Circuit] = {}
        self._sweep: Optional[dict[str, dict[float, dict]]] = None
        self._chosen: Optional[tuple[float, float]] = None

    def settings_record(self) -> dict:
        return asdict(self.settings)

    # -- stages -------------------------------------------------------------------------
    def locate(self, task: str, n: int) -> Circuit:
        """Stage ``locate-<task>``: the circuit located on ``task`` from ``n`` samples."""
        if task not in self.located:
            st = self.settings
            rec = self.cache.run(
                f"locate-{task}",
                locate_inputs(st, task, n, self.model),
                lambda: locate_and_write(
                    self.model, task, st.locate_config(n), self.dir / "circuits" / task, self.progress
                ),
            )
            self.located[task] = Circuit.from_dict(rec.result)
        return self.located[task]

    def heads(self, run_id: str, seed: Optional[int] = None) -> Optional[dict[int, list[int]]]:
        """The heads a run trains HeadMap maps on at training seed ``seed`` (default the first; None: no maps)."""
        st, s = self.settings, self.model.shape
        seed = st.seeds[0] if seed is None else seed
        per_layer = {layer: st.k for layer in range(s.n_layers)}  # locating keeps k heads in every layer
        located = lambda: self.locate(TASK, st.n)  # noqa: E731
        return {
            "located": lambda: heads_by_layer(located().heads()),
            "headmap+lora": lambda: heads_by_layer(located().heads()),
            "random": lambda: random_heads(s, per_layer, seed=derive(seed, "random-heads")),
            "outside": lambda: random_heads(
                s, per_layer, seed=derive(seed, "outside-heads"), exclude=located().heads()
            ),
            "transfer": lambda: heads_by_layer(self.locate(st.transfer_task, st.transfer_n or st.n).heads()),
        }.get(run_id, lambda: None)()

    def names(self) -> dict[str, str]:
        """Each run's name in the tables."""
        st = self.settings
        return {
            "base": "base (no training)",
            "located": "HeadMap (located)",
            "random": "HeadMap, random heads per layer",
            "lora-large": f"LoRA r={st.lora_large} (q,k,v,o)",
            "lora-small": f"LoRA r={st.lora_small} (q,k,v,o)",
            "outside": "HeadMap, heads outside the located set",
            "headmap+lora": f"HeadMap + LoRA r={st.lora_small}",
            "lora-zoo": f"LoRA r={st.lora_large} (q,k,v,o), 15 steps: zoo {st.lora_zoo}",
            "transfer": f"HeadMap, circuit located on {st.transfer_task}",
        }

    def prompts(self) -> dict[str, dict]:
        """The held-out evaluation prompts (key `TASK`, objects never seen in training) and the validation
        prompts (key `VAL`, training objects) every training run is scored on."""
        st, tok = self.settings, self.model.tokenizer
        cfg = st.train_config()
        return {
            TASK: get_task(TASK).eval_batch(tok, cfg.eval_n, cfg.eval_seed),
            VAL: validation_batch(TASK, tok, st.val_n, st.val_seed),
        }

    def train_run(
        self,
        run_id: str,
        ev: dict,
        seed: Optional[int] = None,
        lr: Optional[float] = None,
        headmap_lr: Optional[float] = None,
    ) -> dict:
        """A training stage at ``seed`` (default the first) and the given rates (default: the chosen ones,
        `chosen_lrs`); ``base`` and ``lora-zoo`` are evaluations (stages ``train-base``, ``train-lora-zoo``)."""
        st = self.settings
        if run_id == "base":
            inputs = evaluation_inputs(st, st.model, self.model)
            return self.cache.run("train-base", inputs, lambda: evaluate_model(self.model, ev)).result
        if run_id == "lora-zoo":
            inputs = evaluation_inputs(st, st.lora_zoo, self.model)
            zoo = lambda: zoo_evaluation(self.load(st.lora_zoo), self.model.shape, st.lora_large, ev)  # noqa: E731
            return self.cache.run("train-lora-zoo", inputs, zoo).result
        if lr is None or headmap_lr is None:
            chosen_lr, chosen_hlr = self.chosen_lrs(ev)
            lr = chosen_lr if lr is None else lr
            headmap_lr = chosen_hlr if headmap_lr is None else headmap_lr
        cfg = st.train_config(TASK, st.lora_rank(run_id), seed, lr, headmap_lr)
        heads = self.heads(run_id, cfg.seed)
        inputs = train_inputs(st.model, cfg, heads, st.val_n, st.val_seed) | dtype_inputs(self.model.model)
        return self.cache.run(
            stage_name(run_id, cfg, heads), inputs, lambda: train(self.model, cfg, heads, ev, progress=self.progress)
        ).result

    def sweep(self, ev: dict) -> dict[str, dict[float, dict]]:
        """The learning-rate sweep on the first seed: ``{"headmap": {lr: record}, "lora": {lr: record}}``, HeadMap
        on the located heads and the small LoRA, each method only when a chosen run trains it; ``{}`` without
        ``lrs``."""
        if self._sweep is None:
            st = self.settings
            out: dict[str, dict[float, dict]] = {}
            if st.lrs and set(st.runs) & set(MAP_RUNS):
                out["headmap"] = {lr: self._train("located", ev, st.seeds[0], st.lr, lr) for lr in st.lrs}
            if st.lrs and set(st.runs) & set(LORA_RUNS):
                out["lora"] = {lr: self._train("lora-small", ev, st.seeds[0], lr, st.headmap_lr) for lr in st.lrs}
            self._sweep = out
        return self._sweep

    def chosen_lrs(self, ev: dict) -> tuple[float, float]:
        """(LoRA's, HeadMap's) learning rate: each the sweep's best on the validation prompts (only those are
        read), or the settings' ``lr`` and ``headmap_lr`` without a sweep."""
        if self._chosen is None:
            st, sw = self.settings, self.sweep(ev)
            self._chosen = (
                choose_lr(validation_accuracy(sw["lora"])) if "lora" in sw else st.lr,
                choose_lr(validation_accuracy(sw["headmap"])) if "headmap" in sw else st.headmap_lr,
            )
        return self._chosen

    # -- the whole study ----------------------------------------------------------------
    def run(self, train_only: bool = False) -> Optional[Path]:
        """Every chosen run, then (unless ``train_only``) ``run.json``, tables, figures and ``report.md``; returns
        its path. Under the output directory's lock: a second run on it is refused with the holder's PID."""
        if not train_only:
            return super().run()
        with run_lock(self.dir):
            self.results(self.prompts())
        return None

    def _train(
        self,
        run_id: str,
        ev: dict,
        seed: Optional[int] = None,
        lr: Optional[float] = None,
        headmap_lr: Optional[float] = None,
    ) -> dict:
        """`train_run`; in a plan, a run whose heads or rates read a stage still to compute is noted as
        pending and its record reads as still to compute."""
        try:
            return self.train_run(run_id, ev, seed, lr, headmap_lr)
        except Pending as pending:
            if not self.cache.planning:
                raise
            self.cache.pending(self._planned_name(run_id, seed, lr, headmap_lr), pending.stage)
            return Unknown(pending.stage)  # type: ignore[return-value]

    def _planned_name(self, run_id: str, seed: Optional[int], lr: Optional[float], headmap_lr: Optional[float]) -> str:
        """The stage name of a training run in a plan (its rates unknown while the sweep is to compute)."""
        st = self.settings
        seed = st.seeds[0] if seed is None else seed
        if self._chosen is not None:
            lr = self._chosen[0] if lr is None else lr
            headmap_lr = self._chosen[1] if headmap_lr is None else headmap_lr
        if lr is None or headmap_lr is None:
            return f"train-{run_id}-seed{seed} (at the rates the sweep chooses)"
        cfg = st.train_config(TASK, st.lora_rank(run_id), seed, lr, headmap_lr)
        return stage_name(run_id, cfg, {0: [0]} if run_id in MAP_RUNS else None)

    def results(self, ev: dict) -> dict[str, list[dict]]:
        """Run id -> its records, one per seed (one for ``base`` and ``lora-zoo``): the evaluations first, then
        the sweep, then every seed's runs (seed by seed, so an interrupted study has whole seeds)."""
        st = self.settings
        out: dict[str, list[dict]] = {r: [] for r in st.runs}
        for r in st.runs:
            if r in UNSEEDED:
                out[r].append(self._train(r, ev))
        try:
            self.chosen_lrs(ev)
        except Pending:
            if not self.cache.planning:
                raise
        for seed in st.seeds:
            for r in st.runs:
                if r not in UNSEEDED:
                    out[r].append(self._train(r, ev, seed))
        return out

    def stages(self) -> tuple[dict[str, list[dict]], dict[str, dict[float, dict]]]:
        """The evaluations, the sweep, every seed's runs and the located circuits; (results, sweep)."""
        self.stages_started = time.time()
        ev = self.prompts()
        results = self.results(ev)
        self.locate(TASK, self.settings.n)
        return results, self.sweep(ev)

    def write(self, outcome: tuple[dict[str, list[dict]], dict[str, dict[float, dict]]]) -> Path:  # type: ignore[override]
        """Figures of the located circuits, the overlap with path-patching circuits, tables, the report and
        ``report.html`` (``run.json`` is written before)."""
        from ...report.html import write_html

        results, sweep = outcome
        report = self.write_report(results, sweep, time.time() - self.stages_started)
        write_html(self.dir)  # as `mechdiff view` writes it, from what was just written
        return report

    def write_report(self, results: dict[str, list[dict]], sweep: dict[str, dict[float, dict]], seconds: float) -> Path:
        """Figures of the located circuits, the overlap with path-patching circuits, tables and the report
        (`mechdiff.studies.headmap.report.write_report`)."""
        return write_report(
            self.dir,
            self.settings,
            self.model.shape,
            self.located,
            self.names(),
            results,
            sweep,
            self._chosen if sweep else None,
            seconds,
            sum(r.seconds for r in self.cache.records.values()),
        )
