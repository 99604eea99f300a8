"""The HeadMap study: locate task heads (layer-conditioned), then HeadMap against LoRA and ablations.

Stages, each cached in ``<out>/stages/`` by :class:`mechdiff.studies.stages.StageCache`:
``locate-<task>`` (the located circuit of a task, with its figures under ``circuits/<task>/``) and
``train-<run>`` for each run of :data:`RUNS` chosen (a training run, or an evaluation for ``base`` and
``lora-zoo``). Each key holds what the stage reads (the model's name, the locating or training options,
the heads trained); a rerun recomputes only the stages whose inputs changed, and the tables, figures and
``report.md`` are rewritten from the records every time. The random head sets draw their seeds by name
(:func:`mechdiff.studies.seeds.derive`). Settings: :class:`HeadMapSettings` (a task file's ``[headmap]``
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
from ..headmap import (HeadMap, LocateConfig, TrainConfig, correct, get_task, heads_by_layer, locate_task,
                       lora_params, random_heads, train)
from ..io import check_writable, run_lock, save_figure, write_json, write_text
from ..models.loading import LoadedModel
from ..stats import bootstrap
from ..tasks.spec import load_sections
from .seeds import derive
from .stages import StageCache

log = logging.getLogger(__name__)
TASK = "entity-tracking"  # the task HeadMap and LoRA train on
RUNS = ("base", "located", "random", "lora-large", "lora-small", "outside", "headmap+lora", "transfer", "lora-zoo")


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
    # locating
    n: int = LocateConfig.n
    pool: int = LocateConfig.pool
    k: int = LocateConfig.k
    batch_size: int = LocateConfig.batch_size
    seed: int = LocateConfig.seed
    # training
    steps: int = TrainConfig.steps
    batch: int = TrainConfig.batch_size
    lr: float = TrainConfig.lr
    headmap_lr: float = TrainConfig.headmap_lr
    rank: int = TrainConfig.rank
    eval_n: int = TrainConfig.eval_n
    train_seed: int = TrainConfig.seed
    data_seed: int = TrainConfig.data_seed

    def locate_config(self, n: Optional[int] = None) -> LocateConfig:
        return LocateConfig(n=n or self.n, pool=self.pool, k=self.k, batch_size=self.batch_size, seed=self.seed)

    def train_config(self, task: str = TASK, lora_rank: int = 0) -> TrainConfig:
        return TrainConfig(task=task, steps=self.steps, batch_size=self.batch, lr=self.lr, headmap_lr=self.headmap_lr,
                           seed=self.train_seed, data_seed=self.data_seed, rank=self.rank, lora_rank=lora_rank,
                           eval_n=self.eval_n)


def load_settings(path: str | Path) -> HeadMapSettings:
    """The ``[headmap]`` section of the task file ``path`` (unknown keys, runs and tasks refused with their line)."""
    from ..tasks.base import trainable_tasks

    choices = {("headmap", "runs"): RUNS, ("headmap", "transfer_task"): tuple(trainable_tasks())}
    return load_sections(path, {"headmap": HeadMapSettings}, choices=choices,
                         example="tasks/headmap.toml")[0]["headmap"]


def check_runs(settings: HeadMapSettings) -> None:
    """Refuse unknown runs, and a transfer task without training batches, before anything loads."""
    unknown = sorted(set(settings.runs) - set(RUNS))
    if unknown:
        raise ValueError(f"unknown runs {unknown}; choose from {', '.join(RUNS)}")
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
    from ..components import parse_heads
    from ..report.figures import head_heatmap

    scores = {h: v - (curve[h.layer] if curve else 0.0)
              for h, v in zip(parse_heads(list(meta_scores)), meta_scores.values())}
    return head_heatmap(scores, shape.n_layers, shape.n_heads, path, title=title, selected=heads,
                        label="loss increase from masking the head (given earlier selections)")


def loss_figure(results: dict, path: Path) -> Path:
    """Training loss per step of every run that trained."""
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 3.6))
    for name, r in results.items():
        if r["losses"]:
            ax.plot(range(1, len(r["losses"]) + 1), r["losses"], label=name, linewidth=1)
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


# --------------------------------------------------------------------------------------
# The study
# --------------------------------------------------------------------------------------


class HeadMapStudy:
    """Locating on entity tracking (and the transfer task), the training runs, the tables, figures and report.

    ``load`` loads a model by name (the command's ``load_from_args``; a test's tiny models); the study's model
    is loaded at once, the zoo's LoRA only when its stage is computed."""

    def __init__(self, settings: HeadMapSettings, out: str | Path, load: Callable[[str], LoadedModel],
                 progress: bool = True):
        check_runs(settings)
        self.settings, self.load, self.progress = settings, load, progress
        self.out = check_writable(out)
        for path in settings.path_patching:  # read now, not after hours of training
            Circuit.load(path)
        self.cache = StageCache(self.out)
        self.model = load(settings.model)
        self.located: dict[str, Circuit] = {}

    # -- stages -------------------------------------------------------------------------
    def locate(self, task: str, n: int) -> Circuit:
        """Stage ``locate-<task>``: the circuit located on ``task`` from ``n`` samples."""
        if task not in self.located:
            st = self.settings
            inputs = {"model": st.model, "pool": st.pool, "k": st.k, "batch_size": st.batch_size, "seed": st.seed,
                      "task": task, "n": n}
            rec = self.cache.run(f"locate-{task}", inputs, lambda: locate_and_write(
                self.model, task, st.locate_config(n), self.out / "circuits" / task, self.progress))
            self.located[task] = Circuit.from_dict(rec.result)
        return self.located[task]

    def heads(self, run_id: str) -> Optional[dict[int, list[int]]]:
        """The heads a run trains HeadMap maps on (None: no maps)."""
        st, s = self.settings, self.model.shape
        per_layer = {layer: st.k for layer in range(s.n_layers)}  # locating keeps k heads in every layer
        located = lambda: self.locate(TASK, st.n)  # noqa: E731
        return {
            "located": lambda: heads_by_layer(located().heads()),
            "headmap+lora": lambda: heads_by_layer(located().heads()),
            "random": lambda: random_heads(s, per_layer, seed=derive(st.train_seed, "random-heads")),
            "outside": lambda: random_heads(s, per_layer, seed=derive(st.train_seed, "outside-heads"),
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

    def train_run(self, run_id: str, ev: dict) -> dict:
        """Stage ``train-<run>``: a training run (or the evaluation of the base or the zoo's LoRA)."""
        st = self.settings
        cfg = st.train_config(TASK, self.lora_rank(run_id))
        evaluation = {"eval_n": cfg.eval_n, "eval_seed": cfg.eval_seed}
        if run_id == "base":
            return self.cache.run("train-base", {"model": st.model, **evaluation},
                                  lambda: self._evaluate(self.model, ev)).result
        if run_id == "lora-zoo":
            return self.cache.run("train-lora-zoo", {"model": st.lora_zoo, **evaluation}, lambda: self._zoo(ev)).result
        heads = self.heads(run_id)
        inputs = {"model": st.model, "config": asdict(cfg) | {"lora_targets": list(cfg.lora_targets)},
                  "heads": {str(k): v for k, v in (heads or {}).items()}}
        return self.cache.run(f"train-{run_id}", inputs,
                              lambda: train(self.model, cfg, heads, ev, progress=self.progress)).result

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
        """Every chosen run, then (unless ``train_only``) tables, figures and ``report.md``; returns its path.
        Under the output directory's lock: a second run on it is refused with the holder's PID."""
        with run_lock(self.out):
            return self._run(train_only)

    def _run(self, train_only: bool) -> Optional[Path]:
        t_start = time.time()
        st = self.settings
        cfg = st.train_config()
        ev = {TASK: get_task(TASK).eval_batch(self.model.tokenizer, cfg.eval_n, cfg.eval_seed)}
        names = self.names()
        results = {names[r]: self.train_run(r, ev) for r in st.runs}
        if train_only:
            return None
        self.locate(TASK, st.n)
        report = self.write(results, time.time() - t_start)
        write_json(self.out / "run.json", {"settings": asdict(st), "stages": self.cache.summary(),
                                           "seconds": round(time.time() - t_start, 1)})
        return report

    def write(self, results: dict[str, dict], seconds: float) -> Path:
        """Figures of the located circuits, the overlap with path-patching circuits, tables and the report."""
        from ..report.bars import grouped_bars
        from ..report.tables import write_table

        st, s, out = self.settings, self.model.shape, self.out
        curve_figure({t: c.meta for t, c in self.located.items()}, out / "figures" / "loss_curve.png")
        for t, c in self.located.items():
            heatmap_figure(c.scores["headmap"], c.heads(), s, out / "figures" / f"heads_{t}.png",
                           f"{st.model} on {t}: k={st.k} per layer, n={c.meta['n_samples']}", c.meta["curve"])
        overlap_rows = self.overlap_rows()
        rows, estimates = method_rows(results, lora_params(s, st.lora_large), st.lora_large)
        write_table(rows, out / "tables" / "methods", caption="HeadMap vs LoRA on entity tracking")
        if overlap_rows:
            write_table(overlap_rows, out / "tables" / "overlap", caption="Located heads vs path-patching circuits")
        loc_rows = locating_rows(self.located)
        write_table(loc_rows, out / "tables" / "locating", caption="Locating cost and losses")
        grouped_bars(out / "figures" / "accuracy.png", ["entity tracking (held-out objects)"],
                     {name: [est] for name, est in estimates.items()},
                     title=f"{st.model}: {st.steps} steps of batch {st.batch}, lr {st.lr}")
        loss_figure(results, out / "figures" / "train_loss.png")
        text = report_text(st, str(out), s, self.located, rows, overlap_rows, loc_rows, seconds)
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


def method_rows(results: dict[str, dict], lora_ref: int, lora_large: int) -> tuple[list[dict], dict]:
    """One row per run: parameters (and their ratio to the large LoRA's), accuracy with its interval, loss, time."""
    rows, estimates = [], {}
    for name, r in results.items():
        est = bootstrap(r["correct"][TASK])
        estimates[name] = est
        rows.append({"method": name, "trainable_params": r["trainable"],
                     f"ratio_to_lora_r{lora_large}": r["trainable"] / lora_ref,
                     "accuracy": est.value, "ci_low": est.low, "ci_high": est.high,
                     "final_train_loss": float(np.mean(r["losses"][-5:])) if r["losses"] else float("nan"),
                     "train_seconds": r["train_seconds"]})
    return rows, estimates


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
        if value != getattr(default, f.name):
            text = ",".join(map(str, value)) if isinstance(value, tuple) else str(value)
            flags.append(f"--{f.name.replace('_', '-')} {shlex.quote(text)}")
    return " ".join(["mechdiff headmap compare", f"--out {out}", *flags])


def report_text(st: HeadMapSettings, out: str, shape: Any, located: dict[str, Circuit], rows: list[dict],
                overlap_rows: list[dict], loc_rows: list[dict], seconds: float) -> str:
    from ..report.tables import to_markdown

    et_c = located[TASK]
    tr_c = located.get(st.transfer_task)
    shared = sorted(set(et_c.heads()) & set(tr_c.heads())) if tr_c else []
    lora_ref = lora_params(shape, st.lora_large)
    hm_formula = HeadMap.n_params_for(heads_by_layer(et_c.heads()), shape.d_head, shape.d_model, st.rank)
    pick = lambda rs, keys: [{k: r[k] for k in keys if k in r} for r in rs]  # noqa: E731
    ratio_col = f"ratio_to_lora_r{st.lora_large}"
    lines = [
        f"# HeadMap on {st.model}",
        "",
        f"Made by `{command_line(st, out)}` in {seconds / 60:.1f} min "
        "(stages cached under `stages/`; each stage's seconds are those of the run that computed it).",
        "",
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
        f"Training: {st.steps} steps of {st.batch} prompts (2-7 boxes, training objects), AdamW, lr {st.lr} "
        f"for LoRA and {st.headmap_lr} for the HeadMap maps; "
        f"evaluation: {st.eval_n} held-out 7-box prompts (objects never seen in training), 95% bootstrap CI. "
        f"HeadMap rank r = {st.rank}; its parameter count by the formula sum_l r (k_l d_head + d_model) = "
        f"{hm_formula}. LoRA: alpha = 2r on q, k, v, o; LoRA r={st.lora_large} has {lora_ref} parameters. "
        "The random head sets' seeds are derived by name from the training seed "
        "(`derive(train_seed, \"random-heads\")`, `derive(train_seed, \"outside-heads\")`).",
        "",
        to_markdown(pick(rows, ["method", "trainable_params", ratio_col, "accuracy", "ci_low", "ci_high",
                                "final_train_loss", "train_seconds"])),
        "",
        (f"The `lora-zoo` row is not retrained here: `{st.lora_zoo}` is step 15 of the zoo's LoRA run with exactly "
         "this LoRA recipe and these training batches (r=8, alpha 16, q/k/v/o, lr 1e-3, batch 16, data seed 0; "
         "`mechdiff/zoo/smollm2-et/recipe.json`), evaluated on the same held-out prompts. That run's own validation "
         "accuracy (100 prompts of training objects) was 0.63 at step 15 and 0.75 at step 20, so at HeadMap's 20 "
         "steps the large LoRA would stand somewhat higher than this row." if "lora-zoo" in st.runs else ""),
        "",
        "![accuracy](figures/accuracy.png)",
        "",
        "![training loss](figures/train_loss.png)",
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
