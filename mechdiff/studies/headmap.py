"""The HeadMap study: locate task heads (layer-conditioned), then HeadMap against LoRA and ablations.

Stages, each cached in ``<out>/stages/`` by :class:`mechdiff.runs.stages.StageCache`:
``locate-<task>`` (the located circuit of a task, with its figures under ``circuits/<task>/``) and
``train-<run>-seed<s>[-lr<lr>][-hlr<lr>]`` for each run of :data:`RUNS` chosen and each training seed
(``train-base`` and ``train-lora-zoo``: one evaluation). Each key holds what the stage reads (the model's
name, the locating or training options, the heads trained, the evaluation and validation prompts); a rerun
recomputes only the stages whose inputs changed, and the tables, figures and ``report.md`` are rewritten
from the records every time.

Learning rates: with ``lrs`` set, HeadMap (on the located heads) and the small LoRA are each trained at
every rate on the first seed and each method then trains at the rate with the best accuracy on validation
prompts of *training* objects (:func:`mechdiff.methods.headmap.choose_lr`); the held-out evaluation prompts are
never read for the choice. Seeds: run ``r`` at seed ``s`` initialises from ``s``, trains on the batches of
data seed ``data_seed + s`` and (random, outside) draws its head set from ``derive(s, ...)``
(:func:`mechdiff.runs.seeds.derive`). Settings: :class:`HeadMapSettings` (a task file's ``[headmap]``
section, ``tasks/headmap.toml``; the command's flags override it).
"""

from __future__ import annotations

import logging
import shlex
import time
from dataclasses import asdict, dataclass, fields
from pathlib import Path
from typing import Any, Callable, Optional

import numpy as np

from ..circuits.circuit import Circuit
from ..methods.headmap import (HeadMap, LocateConfig, TrainConfig, choose_lr, correct, get_task, heads_by_layer,
                       locate_task, lora_params, random_heads, train, validation_batch)
from ..common.io import run_lock, save_figure, write_json, write_text
from ..models.loading import LoadedModel
from ..common.stats import bootstrap, paired_difference, pooled_mean, pooled_proportion
from .base import Study, load_section_file, section_study
from ..runs.seeds import derive
from ..runs.stages import Pending, _Unknown

log = logging.getLogger(__name__)
TASK = "entity-tracking"  # the task HeadMap and LoRA train on
RUNS = ("base", "located", "random", "lora-large", "lora-small", "outside", "headmap+lora", "transfer", "lora-zoo")
UNSEEDED = ("base", "lora-zoo")  # evaluations of fixed models: one record, not one per seed
VAL = "validation"  # key of the validation prompts' outcomes in a training record
#: Paired comparisons of the report (first minus second), where both runs are chosen.
COMPARISONS = (("located", "random"), ("located", "outside"), ("located", "transfer"), ("located", "lora-small"),
               ("headmap+lora", "lora-small"))


@dataclass
class HeadMapSettings:
    """The ``[headmap]`` section of a task file: the model, locating, training, and which runs to make."""

    model: str = "smollm2-135m"
    transfer_task: str = "arithmetic-mc"  # task whose located circuit is transferred to entity tracking
    path_patching: tuple = ("results/headmap-smollm2/path-patching/smollm2-et-early.json",)  # circuits to compare
    lora_small: int = 1  # rank of the LoRA near HeadMap's parameter count
    lora_large: int = 8
    transfer_n: int = 0  # samples for locating on the transfer task (0: n)
    lora_zoo: str = "smollm2-et-early"  # a saved LoRA of the same recipe, evaluated instead of trained
    runs: tuple = RUNS
    notes: str = ""  # how the stages were computed (machine load, processes), printed under the report's first line
    # locating
    n: int = LocateConfig.n
    pool: int = LocateConfig.pool
    k: int = LocateConfig.k
    batch_size: int = LocateConfig.batch_size
    seed: int = LocateConfig.seed
    # training
    steps: int = TrainConfig.steps
    batch: int = TrainConfig.batch_size
    lr: float = TrainConfig.lr  # LoRA's rate when lrs is empty
    headmap_lr: float = TrainConfig.headmap_lr  # HeadMap's rate when lrs is empty
    lrs: tuple = ()  # learning-rate sweep for HeadMap and LoRA alike (first seed; chosen on validation prompts)
    val_n: int = 100  # validation prompts (training objects) the learning rate is chosen on
    val_seed: int = 2_000_000
    rank: int = TrainConfig.rank
    eval_n: int = TrainConfig.eval_n
    seeds: tuple = (TrainConfig.seed,)  # training seeds: each trained run once per seed
    data_seed: int = TrainConfig.data_seed  # seed s trains on the batches of data seed data_seed + s

    def locate_config(self, n: Optional[int] = None) -> LocateConfig:
        return LocateConfig(n=n or self.n, pool=self.pool, k=self.k, batch_size=self.batch_size, seed=self.seed)

    def train_config(self, task: str = TASK, lora_rank: int = 0, seed: Optional[int] = None,
                     lr: Optional[float] = None, headmap_lr: Optional[float] = None) -> TrainConfig:
        """One run's training: seed ``s`` (default the first) initialises from ``s`` and trains on data seed
        ``data_seed + s``; ``lr``/``headmap_lr`` default to the settings' rates."""
        seed = self.seeds[0] if seed is None else seed
        return TrainConfig(task=task, steps=self.steps, batch_size=self.batch, lr=self.lr if lr is None else lr,
                           headmap_lr=self.headmap_lr if headmap_lr is None else headmap_lr,
                           seed=seed, data_seed=self.data_seed + seed, rank=self.rank, lora_rank=lora_rank,
                           eval_n=self.eval_n)


def load_settings(path: str | Path) -> HeadMapSettings:
    """The ``[headmap]`` section of the task file ``path`` (unknown keys, runs and tasks refused with their line)."""
    return load_file(path)[0]


def load_file(path: str | Path) -> tuple[HeadMapSettings, str]:
    """The ``[headmap]`` settings and the ``[output] dir`` of the task file ``path`` (checked with their line)."""
    from ..tasks.base import trainable_tasks

    choices = {("headmap", "runs"): RUNS, ("headmap", "transfer_task"): tuple(trainable_tasks())}
    return load_section_file(path, "headmap", HeadMapSettings, choices, "tasks/headmap.toml")


def check_runs(settings: HeadMapSettings) -> None:
    """Refuse unknown runs, and a transfer task without training batches, before anything loads."""
    unknown = sorted(set(settings.runs) - set(RUNS))
    if unknown:
        raise ValueError(f"unknown runs {unknown}; choose from {', '.join(RUNS)}")
    if not settings.seeds or len(set(settings.seeds)) != len(settings.seeds):
        raise ValueError(f"seeds must be distinct and at least one; got {settings.seeds}")
    if any(lr <= 0 for lr in settings.lrs) or len(set(settings.lrs)) != len(settings.lrs):
        raise ValueError(f"learning rates must be distinct and positive; got {settings.lrs}")
    if "transfer" in settings.runs:
        get_task(settings.transfer_task)


# --------------------------------------------------------------------------------------
# Figures
# --------------------------------------------------------------------------------------


def curve_figure(curves: dict[str, dict], path: Path) -> Path:
    """Loss of the selected samples with the heads of layers < l masked, against the pool's mean loss."""
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 3.6))
    for i, (name, meta) in enumerate(curves.items()):
        color = plt.get_cmap("tab10")(i)
        ax.plot(range(len(meta["curve"])), meta["curve"], marker=".", color=color, label=f"{name}: selected samples")
        ax.axhline(meta["pool_loss"], color=color, linestyle="--", linewidth=1, label=f"{name}: mean of all samples")
    ax.set_xlabel("layers masked (heads selected in layers 0..l-1 zeroed)")
    ax.set_ylabel("answer loss (nats)")
    ax.set_yscale("log")
    ax.legend(fontsize=7)
    ax.set_title("Layer-conditioned locating: loss curve per layer", fontsize=9)
    return save_figure(fig, path)


def heatmap_figure(meta_scores: dict[str, float], heads: list, shape: Any, path: Path, title: str,
                   curve: Any = None) -> Path:
    """Per head: the loss with it masked (and earlier selections) minus the layer's loss with only the earlier
    selections masked (``curve[layer]``), so every layer's candidates are comparable; selected heads boxed."""
    from ..common.components import parse_heads
    from ..report.figures import head_heatmap

    scores = {h: v - (curve[h.layer] if curve else 0.0)
              for h, v in zip(parse_heads(list(meta_scores)), meta_scores.values())}
    return head_heatmap(scores, shape.n_layers, shape.n_heads, path, title=title, selected=heads,
                        label="loss increase from masking the head (given earlier selections)")


def loss_figure(results: dict[str, list[dict]], path: Path) -> Path:
    """Training loss per step of every run that trained (mean over its seeds)."""
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 3.6))
    for name, records in results.items():
        losses = [r["losses"] for r in records if r["losses"]]
        if losses:
            ax.plot(range(1, len(losses[0]) + 1), np.mean(losses, axis=0), linewidth=1,
                    label=f"{name} (mean of {len(losses)} seeds)")
    ax.set_xlabel("step")
    ax.set_ylabel("training answer loss")
    ax.set_yscale("log")
    ax.legend(fontsize=6)
    return save_figure(fig, path)


# --------------------------------------------------------------------------------------
# locate / finetune (one part each)
# --------------------------------------------------------------------------------------


def locate_and_write(model: LoadedModel, task: str, cfg: LocateConfig, out: Path, progress: bool = True) -> dict:
    """Locate ``cfg.k`` heads per layer on ``task``; ``out``: circuit.json, heads.png, curve.png."""
    res = locate_task(model, task, cfg, progress=progress)
    circuit = res.circuit(model.name, task)
    circuit.save(out / "circuit.json")
    heatmap_figure(circuit.scores["headmap"], circuit.heads(), model.shape, out / "heads.png",
                   f"{model.name} on {task}: k={cfg.k} per layer, n={cfg.n}", circuit.meta["curve"])
    curve_figure({task: circuit.meta}, out / "curve.png")
    log.info("located %d heads in %.0f s, %d forward passes (%d prompt rows); loss %.3f -> %.3f (pool mean %.3f)",
             len(res.heads), res.seconds, res.forward_passes, res.rows, res.base_loss, res.curve[-1], res.pool_loss)
    return circuit.to_dict()


def finetune(model: LoadedModel, circuit: Circuit, cfg: TrainConfig, progress: bool = True) -> dict:
    """HeadMap maps on ``circuit``'s heads (and a LoRA when ``cfg.lora_rank``) trained on ``cfg.task``; the
    training record with the held-out accuracy (bootstrap interval)."""
    ev = get_task(cfg.task).eval_batch(model.tokenizer, cfg.eval_n, cfg.eval_seed)
    res = train(model, cfg, heads_by_layer(circuit.heads()), {cfg.task: ev}, progress=progress)
    return res | {"accuracy": bootstrap(res["correct"][cfg.task]).to_dict()}


def train_maps_and_write(model: LoadedModel, circuit: Circuit, cfg: TrainConfig, out: Path) -> str:
    """:func:`finetune`, its record written to ``out/result.json``; returns the line ``headmap finetune`` prints."""
    res = finetune(model, circuit, cfg)
    acc = res["accuracy"]
    write_json(out / "result.json", res)
    return (f"trainable parameters {res['trainable']}; {cfg.task} accuracy {acc['value']:.3f} "
            f"[{acc['low']:.3f}, {acc['high']:.3f}]")


# --------------------------------------------------------------------------------------
# The study
# --------------------------------------------------------------------------------------


MAP_RUNS = ("located", "random", "outside", "transfer", "headmap+lora")  # runs that train HeadMap maps
LORA_RUNS = ("lora-small", "lora-large", "headmap+lora")  # runs that train a LoRA


def train_inputs(model: str, cfg: TrainConfig, heads: Optional[dict[int, list[int]]], val_n: int,
                 val_seed: int) -> dict:
    """A training stage's key: the model, the options the run reads (a rate it does not use is left out, so the
    sweep's run at the chosen rate is the main run of that seed), the heads and the validation prompts."""
    config = asdict(cfg) | {"lora_targets": list(cfg.lora_targets)}
    if not cfg.lora_rank:
        del config["lr"], config["lora_targets"]
    if not heads:
        del config["headmap_lr"], config["rank"]
    return {"model": model, "config": config, "heads": {str(k): v for k, v in (heads or {}).items()},
            "validation": {"n": val_n, "seed": val_seed}}


def stage_name(run_id: str, cfg: TrainConfig, heads: Optional[dict[int, list[int]]]) -> str:
    """``train-<run>-seed<s>``, then ``-lr<LoRA rate>`` and ``-hlr<HeadMap rate>`` for the parts it trains."""
    name = f"train-{run_id}-seed{cfg.seed}"
    if cfg.lora_rank:
        name += f"-lr{cfg.lr:g}"
    if heads:
        name += f"-hlr{cfg.headmap_lr:g}"
    return name


class HeadMapStudy(Study):
    """Locating on entity tracking (and the transfer task), the learning-rate sweep, the training runs on every
    seed, the tables, figures and report (kind ``headmap``).

    ``load`` loads a model by name (:func:`~mechdiff.studies.base.model_loader`; a test's tiny models); the
    study's model is loaded at once, the zoo's LoRA only when its stage is computed."""

    kind = "headmap"

    def __init__(self, settings: HeadMapSettings, out: str | Path, load: Callable[[str], LoadedModel],
                 progress: bool = True):
        check_runs(settings)
        super().__init__(out, progress)
        self.settings, self.load = settings, load
        for path in settings.path_patching:  # read now, not after hours of training
            Circuit.load(path)
        self.model = load(settings.model)
        self.forget()

    @classmethod
    def from_file(cls, path: Optional[str | Path], out: Optional[str] = None, progress: bool = True,
                  models: Optional[dict] = None, task: Optional[str] = None) -> "HeadMapStudy":
        """The study of a task file with ``[study] kind = "headmap"``; ``models``: how models load (dtype, ...)."""
        return section_study(cls, path, out, progress, models, task, load_file, "HeadMap", "tasks/headmap.toml")

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
            inputs = {"model": st.model, "pool": st.pool, "k": st.k, "batch_size": st.batch_size, "seed": st.seed,
                      "task": task, "n": n}
            rec = self.cache.run(f"locate-{task}", inputs, lambda: locate_and_write(
                self.model, task, st.locate_config(n), self.dir / "circuits" / task, self.progress))
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
            "outside": lambda: random_heads(s, per_layer, seed=derive(seed, "outside-heads"),
                                            exclude=located().heads()),
            "transfer": lambda: heads_by_layer(self.locate(st.transfer_task, st.transfer_n or st.n).heads()),
        }.get(run_id, lambda: None)()

    def lora_rank(self, run_id: str) -> int:
        st = self.settings
        return {"lora-large": st.lora_large, "lora-small": st.lora_small, "headmap+lora": st.lora_small}.get(run_id, 0)

    def names(self) -> dict[str, str]:
        """Each run's name in the tables."""
        st = self.settings
        return {
            "base": "base (no training)", "located": "HeadMap (located)",
            "random": "HeadMap, random heads per layer",
            "lora-large": f"LoRA r={st.lora_large} (q,k,v,o)", "lora-small": f"LoRA r={st.lora_small} (q,k,v,o)",
            "outside": "HeadMap, heads outside the located set",
            "headmap+lora": f"HeadMap + LoRA r={st.lora_small}",
            "lora-zoo": f"LoRA r={st.lora_large} (q,k,v,o), 15 steps: zoo {st.lora_zoo}",
            "transfer": f"HeadMap, circuit located on {st.transfer_task}",
        }

    def prompts(self) -> dict[str, dict]:
        """The held-out evaluation prompts (key :data:`TASK`, objects never seen in training) and the validation
        prompts (key :data:`VAL`, training objects) every training run is scored on."""
        st, tok = self.settings, self.model.tokenizer
        cfg = st.train_config()
        return {TASK: get_task(TASK).eval_batch(tok, cfg.eval_n, cfg.eval_seed),
                VAL: validation_batch(TASK, tok, st.val_n, st.val_seed)}

    def train_run(self, run_id: str, ev: dict, seed: Optional[int] = None, lr: Optional[float] = None,
                  headmap_lr: Optional[float] = None) -> dict:
        """A training stage at ``seed`` (default the first) and the given rates (default: the chosen ones,
        :meth:`chosen_lrs`); ``base`` and ``lora-zoo`` are evaluations (stages ``train-base``, ``train-lora-zoo``)."""
        st = self.settings
        evaluation = {"eval_n": st.eval_n, "eval_seed": st.train_config().eval_seed}
        if run_id == "base":
            return self.cache.run("train-base", {"model": st.model, **evaluation},
                                  lambda: self._evaluate(self.model, ev)).result
        if run_id == "lora-zoo":
            return self.cache.run("train-lora-zoo", {"model": st.lora_zoo, **evaluation}, lambda: self._zoo(ev)).result
        if lr is None or headmap_lr is None:
            chosen_lr, chosen_hlr = self.chosen_lrs(ev)
            lr = chosen_lr if lr is None else lr
            headmap_lr = chosen_hlr if headmap_lr is None else headmap_lr
        cfg = st.train_config(TASK, self.lora_rank(run_id), seed, lr, headmap_lr)
        heads = self.heads(run_id, cfg.seed)
        inputs = train_inputs(st.model, cfg, heads, st.val_n, st.val_seed)
        return self.cache.run(stage_name(run_id, cfg, heads), inputs,
                              lambda: train(self.model, cfg, heads, ev, progress=self.progress)).result

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
            self._chosen = (choose_lr(validation_accuracy(sw["lora"])) if "lora" in sw else st.lr,
                            choose_lr(validation_accuracy(sw["headmap"])) if "headmap" in sw else st.headmap_lr)
        return self._chosen

    @staticmethod
    def _evaluate(model: LoadedModel, ev: dict) -> dict:
        return {"trainable": 0, "correct": {TASK: correct(model.model, ev[TASK]).tolist()},
                "losses": [], "train_seconds": 0.0, "heads": {}}

    def _zoo(self, ev: dict) -> dict:
        zoo = self.load(self.settings.lora_zoo)
        return {**self._evaluate(zoo, ev), "trainable": lora_params(self.model.shape, self.settings.lora_large),
                "train_seconds": float("nan"), "provenance": zoo.provenance}

    # -- the whole study ----------------------------------------------------------------
    def run(self, train_only: bool = False) -> Optional[Path]:
        """Every chosen run, then (unless ``train_only``) ``run.json``, tables, figures and ``report.md``; returns
        its path. Under the output directory's lock: a second run on it is refused with the holder's PID."""
        if not train_only:
            return super().run()
        with run_lock(self.dir):
            self.results(self.prompts())
        return None

    def _train(self, run_id: str, ev: dict, seed: Optional[int] = None, lr: Optional[float] = None,
               headmap_lr: Optional[float] = None) -> dict:
        """:meth:`train_run`; in a plan, a run whose heads or rates read a stage still to compute is noted as
        pending and its record reads as still to compute."""
        try:
            return self.train_run(run_id, ev, seed, lr, headmap_lr)
        except Pending as pending:
            if not self.cache.planning:
                raise
            self.cache.pending(self._planned_name(run_id, seed, lr, headmap_lr), pending.stage)
            return _Unknown(pending.stage)  # type: ignore[return-value]

    def _planned_name(self, run_id: str, seed: Optional[int], lr: Optional[float], headmap_lr: Optional[float]) -> str:
        """The stage name of a training run in a plan (its rates unknown while the sweep is to compute)."""
        st = self.settings
        seed = st.seeds[0] if seed is None else seed
        if self._chosen is not None:
            lr = self._chosen[0] if lr is None else lr
            headmap_lr = self._chosen[1] if headmap_lr is None else headmap_lr
        if lr is None or headmap_lr is None:
            return f"train-{run_id}-seed{seed} (at the rates the sweep chooses)"
        cfg = st.train_config(TASK, self.lora_rank(run_id), seed, lr, headmap_lr)
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
        """Figures of the located circuits, the overlap with path-patching circuits, tables and the report."""
        results, sweep = outcome
        return self.write_report(results, sweep, time.time() - self.stages_started)

    def write_report(self, results: dict[str, list[dict]], sweep: dict[str, dict[float, dict]],
                     seconds: float) -> Path:
        """Figures of the located circuits, the overlap with path-patching circuits, tables and the report."""
        from ..report.bars import grouped_bars
        from ..report.tables import write_table

        st, s, out = self.settings, self.model.shape, self.dir
        names = self.names()
        curve_figure({t: c.meta for t, c in self.located.items()}, out / "figures" / "loss_curve.png")
        for t, c in self.located.items():
            heatmap_figure(c.scores["headmap"], c.heads(), s, out / "figures" / f"heads_{t}.png",
                           f"{st.model} on {t}: k={st.k} per layer, n={c.meta['n_samples']}", c.meta["curve"])
        overlap_rows = self.overlap_rows()
        rows, estimates = method_rows(results, names, lora_params(s, st.lora_large), st.lora_large)
        write_table(rows, out / "tables" / "methods", caption="HeadMap vs LoRA on entity tracking (seeds pooled)")
        seed_table = seed_rows(results, names, st.seeds)
        write_table(seed_table, out / "tables" / "seeds", caption="Every run, seed by seed")
        paired = paired_rows(results, names, st.seeds)
        if paired:
            write_table(paired, out / "tables" / "paired", caption="Paired differences on the same held-out prompts")
        lrs = self._chosen if sweep else None
        sweep_table = sweep_rows(sweep, names, lrs) if sweep else []
        if sweep_table:
            write_table(sweep_table, out / "tables" / "lr_sweep", caption="Learning-rate sweep (validation prompts)")
        if overlap_rows:
            write_table(overlap_rows, out / "tables" / "overlap", caption="Located heads vs path-patching circuits")
        loc_rows = locating_rows(self.located)
        write_table(loc_rows, out / "tables" / "locating", caption="Locating cost and losses")
        grouped_bars(out / "figures" / "accuracy.png", ["entity tracking (held-out objects)"],
                     {names[r]: [est] for r, est in estimates.items()},
                     title=f"{st.model}: {st.steps} steps of batch {st.batch}, {len(st.seeds)} seeds pooled")
        loss_figure({names[r]: recs for r, recs in results.items()}, out / "figures" / "train_loss.png")
        cold = sum(r.seconds for r in self.cache.records.values())
        text = report_text(st, str(out), s, self.located, rows, overlap_rows, loc_rows, seconds,
                           seed_table, paired, sweep_table, lrs, cold)
        return write_text(out / "report.md", text)

    def overlap_rows(self) -> list[dict]:
        from ..circuits.overlap import overlap_row

        s = self.model.shape
        rows = []
        for path in self.settings.path_patching:
            pp = Circuit.load(path)
            for name, c in self.located.items():
                for g, heads in [*pp.groups.items(), ("all", pp.heads())]:
                    if heads:
                        row = overlap_row(g, heads, c.heads(), s.n_layers * s.n_heads, pp.names.get(g, "all heads"))
                        rows.append({"path_patching": f"{pp.model} ({Path(path).name})", "located_on": name, **row})
        return rows


# --------------------------------------------------------------------------------------
# Tables
# --------------------------------------------------------------------------------------


def validation_accuracy(records: dict[float, dict]) -> dict[float, float]:
    """Learning rate -> accuracy on the validation prompts (the only outcomes a rate is chosen on)."""
    return {lr: float(np.mean(r["correct"][VAL])) for lr, r in records.items()}


def _accuracies(records: list[dict]) -> np.ndarray:
    """``"seed prompt"`` 0/1 outcomes on the held-out prompts."""
    return np.asarray([r["correct"][TASK] for r in records], dtype=float)


def method_rows(results: dict[str, list[dict]], names: dict[str, str], lora_ref: int,
                lora_large: int) -> tuple[list[dict], dict]:
    """One row per run: parameters (and their ratio to the large LoRA's), every seed's accuracy, their mean,
    standard deviation and range, the mean's interval (two-stage bootstrap over seeds and prompts), the mean
    final training loss and seconds. Runs without records (an interrupted study) are left out."""
    rows, estimates = [], {}
    for run_id, records in results.items():
        if not records:
            continue
        acc = _accuracies(records)
        per_seed = acc.mean(axis=1)
        est = pooled_proportion(acc)
        estimates[run_id] = est
        losses = [float(np.mean(r["losses"][-5:])) for r in records if r["losses"]]
        rows.append({"method": names[run_id], "trainable_params": records[0]["trainable"],
                     f"ratio_to_lora_r{lora_large}": records[0]["trainable"] / lora_ref,
                     "seeds": len(records), "per_seed": " / ".join(f"{a:.3f}" for a in per_seed),
                     "accuracy": est.value, "sd": float(np.std(per_seed, ddof=1)) if len(records) > 1 else float("nan"),
                     "min": float(per_seed.min()), "max": float(per_seed.max()),
                     "ci_low": est.low, "ci_high": est.high,
                     "final_train_loss": float(np.mean(losses)) if losses else float("nan"),
                     "train_seconds": float(np.mean([r["train_seconds"] for r in records]))})
    return rows, estimates


def seed_rows(results: dict[str, list[dict]], names: dict[str, str], seeds: tuple) -> list[dict]:
    """One row per run and seed: held-out accuracy with its bootstrap interval over prompts, validation accuracy."""
    rows = []
    for run_id, records in results.items():
        for seed, r in zip(seeds if run_id not in UNSEEDED else ("-",), records):
            est = bootstrap(r["correct"][TASK])
            val, cfg = r["correct"].get(VAL), r.get("config", {})
            rows.append({"method": names[run_id], "seed": seed, "accuracy": est.value, "ci_low": est.low,
                         "ci_high": est.high, "val_accuracy": float(np.mean(val)) if val else float("nan"),
                         "lr": cfg["lr"] if cfg.get("lora_rank") else float("nan"),
                         "headmap_lr": cfg["headmap_lr"] if r.get("heads") else float("nan")})
    return rows


def paired_rows(results: dict[str, list[dict]], names: dict[str, str], seeds: tuple) -> list[dict]:
    """For each comparison of :data:`COMPARISONS` with both runs present: the accuracy difference on the same
    held-out prompts seed by seed (paired bootstrap over prompts) and pooled over seeds x prompts (two-stage
    bootstrap of the per-prompt differences, resampling seeds then prompts)."""
    rows = []
    for a, b in COMPARISONS:
        if not results.get(a) or not results.get(b):
            continue
        m = min(len(results[a]), len(results[b]))  # seeds both runs finished
        x, y = _accuracies(results[a][:m]), _accuracies(results[b][:m])
        label = f"{names[a]} - {names[b]}"
        for seed, xs, ys in zip(seeds, x, y):
            d = paired_difference(xs, ys)
            rows.append({"comparison": label, "seed": str(seed), "difference": d.value, "ci_low": d.low,
                         "ci_high": d.high})
        d = pooled_mean(x - y)
        rows.append({"comparison": label, "seed": f"pooled ({m} seeds x {x.shape[1]} prompts)",
                     "difference": d.value, "ci_low": d.low, "ci_high": d.high})
    return rows


def sweep_rows(sweep: dict[str, dict[float, dict]], names: dict[str, str], chosen: tuple[float, float]) -> list[dict]:
    """One row per method and learning rate: validation accuracy (bootstrap interval over the prompts), the
    final training loss, and which rate was chosen."""
    label = {"headmap": names["located"], "lora": names["lora-small"]}
    pick = {"lora": chosen[0], "headmap": chosen[1]}
    rows = []
    for method, records in sweep.items():
        for lr, r in records.items():
            est = bootstrap(r["correct"][VAL])
            rows.append({"method": label[method], "lr": lr, "val_accuracy": est.value, "ci_low": est.low,
                         "ci_high": est.high, "final_train_loss": float(np.mean(r["losses"][-5:])),
                         "chosen": "yes" if lr == pick[method] else ""})
    return rows


def verdict(rows: list[dict], label: str) -> str:
    """What the pooled interval of comparison ``label`` carries, in one sentence."""
    pooled = [r for r in rows if r["comparison"] == label and r["seed"].startswith("pooled")]
    if not pooled:
        return ""
    r = pooled[0]
    interval = f"{r['difference']:+.3f} [{r['ci_low']:+.3f}, {r['ci_high']:+.3f}]"
    if r["ci_low"] > 0:
        return f"{label}: {interval}; the interval lies above 0, so the first beats the second here."
    if r["ci_high"] < 0:
        return f"{label}: {interval}; the interval lies below 0, so the second beats the first here."
    return (f"{label}: {interval}; the interval includes 0, so this study cannot tell the two apart "
            "(it does not show that the first beats the second).")


def locating_rows(located: dict[str, Circuit]) -> list[dict]:
    return [{"task": t, "n_samples": c.meta["n_samples"], "pool": c.meta["pool"], "k": c.meta["k"],
             "heads": len(c.heads()), "forward_passes": c.meta["forward_passes"], "rows": c.meta["rows"],
             "seconds": c.meta["seconds"], "selection_seconds": c.meta["selection_seconds"],
             "pool_loss": c.meta["pool_loss"], "selected_loss": c.meta["base_loss"],
             "loss_all_masked": c.meta["curve"][-1]} for t, c in located.items()]


def command_line(st: HeadMapSettings, out: str) -> str:
    """The ``mechdiff headmap compare`` call that makes this study (every setting that differs from the default)."""
    default = HeadMapSettings()
    flags = []
    for f in fields(HeadMapSettings):
        value = getattr(st, f.name)
        if f.name != "notes" and value != getattr(default, f.name):
            text = ",".join(map(str, value)) if isinstance(value, tuple) else str(value)
            flags.append(f"--{f.name.replace('_', '-')} {shlex.quote(text)}")
    return " ".join(["mechdiff headmap compare", f"--out {out}", *flags])


def settings_rows(st: HeadMapSettings) -> list[dict]:
    """The paper's setting beside this study's, one row per setting (where they differ, the row says so)."""
    lrs = f"swept over {', '.join(f'{x:g}' for x in st.lrs)} for each method" if st.lrs else \
        f"{st.lr:g} (LoRA), {st.headmap_lr:g} (HeadMap)"
    return [
        {"setting": "locating samples", "paper": "the 64 lowest-loss samples of the task",
         "here": f"the {st.n} lowest-loss of a pool of {st.pool}", "same": "yes" if st.n == 64 else "no"},
        {"setting": "models", "paper": "LLaMA-family 7-8B models (e.g. Llama3-8B)", "here": st.model, "same": "no"},
        {"setting": "tasks", "paper": "commonsense reasoning datasets (e.g. SIQA, HellaSwag)",
         "here": f"{TASK} (7-box prompts; transfer from {st.transfer_task})", "same": "no"},
        {"setting": "heads kept per layer", "paper": "not known here", "here": str(st.k), "same": "?"},
        {"setting": "map rank", "paper": "not known here", "here": str(st.rank), "same": "?"},
        {"setting": "learning rate", "paper": "not known here", "here": lrs, "same": "?"},
        {"setting": "training", "paper": "not known here",
         "here": f"{st.steps} steps of {st.batch} prompts, {len(st.seeds)} seeds", "same": "?"},
        {"setting": "baselines", "paper": "LoRA; random head selection; other locating strategies",
         "here": "LoRA r=1 and the zoo's r=8; random heads; heads outside the located set; a transferred circuit",
         "same": "partly"},
    ]


def edge_notes(lrs: tuple, chosen: dict[str, float]) -> list[str]:
    """A warning line (and a blank) for each method whose chosen rate lies at an end of the swept grid."""
    out = []
    for method, lr in chosen.items():
        if lrs and lr in (min(lrs), max(lrs)) and len(lrs) > 1:
            side = "largest" if lr == max(lrs) else "smallest"
            out += [f"{method}'s chosen rate {lr:g} is the {side} swept: rates beyond it were not tried, so "
                    f"{method} may be under-tuned.", ""]
    return out


def report_text(st: HeadMapSettings, out: str, shape: Any, located: dict[str, Circuit], rows: list[dict],
                overlap_rows: list[dict], loc_rows: list[dict], seconds: float, seed_table: list[dict],
                paired: list[dict], sweep_table: list[dict], lrs: Optional[tuple[float, float]],
                cold_seconds: float) -> str:
    from ..report.tables import to_markdown

    names = {"located": "HeadMap (located)", "random": "HeadMap, random heads per layer"}
    et_c = located[TASK]
    tr_c = located.get(st.transfer_task)
    shared = sorted(set(et_c.heads()) & set(tr_c.heads())) if tr_c else []
    lora_ref = lora_params(shape, st.lora_large)
    hm_formula = HeadMap.n_params_for(heads_by_layer(et_c.heads()), shape.d_head, shape.d_model, st.rank)
    pick = lambda rs, keys: [{k: r[k] for k in keys if k in r} for r in rs]  # noqa: E731
    ratio_col = f"ratio_to_lora_r{st.lora_large}"
    lora_lr, headmap_lr = lrs if lrs else (st.lr, st.headmap_lr)
    main = verdict(paired, f"{names['located']} - {names['random']}")
    et_meta = et_c.meta
    lines = [
        f"# HeadMap on {st.model}",
        "",
        f"Made by `{command_line(st, out)}` (the settings of `tasks/headmap.toml`: `mechdiff run "
        f"tasks/headmap.toml`). This invocation took {seconds:.0f} s; computing every stage it read "
        f"took {cold_seconds / 60:.1f} min in all (the sum of the stages' own seconds, each measured by the run that "
        "computed it, on 2 shared CPU cores; stages cached under `stages/`).",
        "",
        *([st.notes, ""] if st.notes else []),
        "## Locating (layer-conditioned, zero masks)",
        "",
        f"Samples: the {st.n} lowest-loss prompts of a pool of {st.pool}; k = {st.k} heads kept per layer. "
        f"One layer is one batch of (n_heads + 1) x n rows, the extra block masking only earlier selections "
        f"(it gives the loss curve).",
        "",
        to_markdown(loc_rows),
        "",
        "![loss curve](figures/loss_curve.png)",
        "",
        "![entity-tracking heads](figures/heads_entity-tracking.png)",
        "",
        (f"Heads located on both tasks: {len(shared)} of {len(et_c.heads())} "
         f"({', '.join(h.name for h in shared) or 'none'})." if len(located) > 1 else ""),
        "",
        "## HeadMap vs LoRA on entity tracking",
        "",
        f"Training: {st.steps} steps of {st.batch} prompts (2-7 boxes, training objects), AdamW; "
        f"{len(st.seeds)} seeds ({', '.join(map(str, st.seeds))}): seed s initialises the maps / LoRA from s, "
        f"trains on the batches of data seed {st.data_seed} + s, and draws the random and outside head sets from "
        "`derive(s, \"random-heads\")` and `derive(s, \"outside-heads\")`. "
        f"Evaluation: {st.eval_n} held-out 7-box prompts (objects never seen in training), the same prompts for "
        "every run and seed. "
        f"HeadMap rank r = {st.rank}; its parameter count by the formula sum_l r (k_l d_head + d_model) = "
        f"{hm_formula}. LoRA: alpha = 2r on q, k, v, o; LoRA r={st.lora_large} has {lora_ref} parameters.",
        "",
        "### Learning rates",
        "",
    ]
    if sweep_table:
        lines += [
            f"Both methods are swept over the same rates ({', '.join(f'{x:g}' for x in st.lrs)}) on seed "
            f"{st.seeds[0]}: HeadMap on the located heads, LoRA at r={st.lora_small}. Each rate is scored on "
            f"{st.val_n} validation prompts of *training* objects (7 boxes, seed {st.val_seed}; never the held-out "
            "evaluation prompts), and each method then trains at its own best rate (ties: the smaller rate): "
            f"LoRA at {lora_lr:g}, HeadMap at {headmap_lr:g}; the random, outside and transferred head sets train "
            "at HeadMap's rate (chosen on the located heads, which can only favour the located row), "
            "HeadMap + LoRA at both.",
            "",
            to_markdown(sweep_table),
            "",
            *edge_notes(st.lrs, {"LoRA": lora_lr, "HeadMap": headmap_lr}),
        ]
    else:
        lines += [f"No sweep: LoRA at {lora_lr:g}, HeadMap at {headmap_lr:g}.", ""]
    lines += [
        "### Accuracy (seeds pooled)",
        "",
        "accuracy: mean over seeds and prompts; per_seed: each seed's accuracy in seed order; sd, min, max: over "
        "the seeds; ci: 95% two-stage bootstrap (seeds, then prompts, resampled), an interval for the mean. "
        "`base` and the zoo's LoRA are fixed models, evaluated once.",
        "",
        to_markdown(pick(rows, ["method", "trainable_params", ratio_col, "seeds", "per_seed", "accuracy", "sd",
                                "min", "max", "ci_low", "ci_high", "final_train_loss", "train_seconds"])),
        "",
        (f"The `lora-zoo` row is not retrained here: `{st.lora_zoo}` is step 15 of the zoo's LoRA run (r=8, "
         "alpha 16, q/k/v/o, lr 1e-3, batch 16, data seed 0; `mechdiff/zoo/smollm2-et/recipe.json`), evaluated on "
         "the same held-out prompts; its rate was not swept and it has one seed. That run's own validation "
         "accuracy (100 prompts of training objects) was 0.63 at step 15 and 0.75 at step 20."
         if "lora-zoo" in st.runs else ""),
        "",
        "![accuracy](figures/accuracy.png)",
        "",
        "![training loss](figures/train_loss.png)",
        "",
        "Every run seed by seed (held-out accuracy with its 95% bootstrap interval over prompts, validation "
        "accuracy, the rates it trained at):",
        "",
        to_markdown(pick(seed_table, ["method", "seed", "accuracy", "ci_low", "ci_high", "val_accuracy", "lr",
                                      "headmap_lr"])),
        "",
    ]
    if paired:
        lines += [
            "### Paired comparisons",
            "",
            "Accuracy difference (first minus second) on the same held-out prompts: per seed a paired bootstrap "
            "over prompts; pooled, a two-stage bootstrap of the per-prompt differences (seeds, then prompts). "
            "Seed s of both runs shares its training batches.",
            "",
            to_markdown(paired),
            "",
            f"**Do located heads beat random ones here?** {main or 'not measured (no located and random runs).'}",
            "",
        ]
    lines += [
        "## Beside the paper (Wang et al., HeadMap, ICLR 2025)",
        "",
        "No paper figure is set beside a measured one: the references this study could read hold the paper's "
        "abstract, its repository's README and its OpenReview reviews, not its tables; and its models and tasks "
        "differ from these, so its accuracies would not be comparable anyway. What the paper states "
        "qualitatively, beside what is measured here:",
        "",
        f"- Masking a small portion of the located heads significantly reduces correct predictions (abstract). "
        f"Here: with all {len(et_c.heads())} located heads zero-masked, the selected samples' answer loss rises "
        f"from {et_meta['base_loss']:.2f} to {et_meta['curve'][-1]:.2f} nats (pool mean unmasked "
        f"{et_meta['pool_loss']:.2f}).",
        "- HeadMap on located heads outperforms random head selection (the paper's ablation, as its reviewers "
        f"summarise it). Here: {main or 'not measured.'}",
        "",
        to_markdown(settings_rows(st)),
        "",
    ]
    if overlap_rows:
        lines += [
            "## Located heads vs the path-patching circuit",
            "",
            "The path-patching circuits are those of `smollm2-et-early` (SmolLM2-135M after 15 LoRA steps on entity "
            "tracking, the base of the committed study `results/entity-tracking-smollm2`): the repository has no "
            "path-patching circuit of the raw `smollm2-135m`, which solves 7-box entity tracking too rarely "
            "(0.09-0.16) for path patching to find a mechanism. The located heads are those of `smollm2-135m`, "
            "whose weights `smollm2-et-early` shares but for a small LoRA.",
            "",
            "p: hypergeometric probability that a random head set of the located size shares at least this many "
            f"heads with the path-patching group ({shape.n_layers * shape.n_heads} heads in all).",
            "",
            to_markdown(pick(overlap_rows, ["path_patching", "located_on", "group", "name", "size_first",
                                            "size_second", "intersection", "frac_first", "p_value"])),
            "",
        ]
    return "\n".join(lines) + "\n"
