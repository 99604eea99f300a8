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

import logging
import math
import time
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import Any, Callable, Optional

from ...circuits.circuit import Circuit
from ...common.io import run_lock, write_json
from ...common.stats import bootstrap
from ...methods.headmap import (
    LocateConfig,
    TrainConfig,
    choose_lr,
    correct,
    get_task,
    heads_by_layer,
    locate_task,
    lora_params,
    random_heads,
    train,
    validation_batch,
)
from ...models.footprint import dtype_bytes
from ...models.loading import LoadedModel, dtype_inputs
from ...runs.seeds import derive
from ...runs.stages import Pending, Unknown
from ..base import Study, load_section_file, section_study
from .report import (
    TASK,
    UNSEEDED,
    VAL,
    curve_figure,
    heatmap_figure,
    validation_accuracy,
    write_report,
)

log = logging.getLogger(__name__)
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

    def train_config(
        self,
        task: str = TASK,
        lora_rank: int = 0,
        seed: Optional[int] = None,
        lr: Optional[float] = None,
        headmap_lr: Optional[float] = None,
    ) -> TrainConfig:
        """One run's training: seed ``s`` (default the first) initialises from ``s`` and trains on data seed
        ``data_seed + s``; ``lr``/``headmap_lr`` default to the settings' rates."""
        seed = self.seeds[0] if seed is None else seed
        return TrainConfig(
            task=task,
            steps=self.steps,
            batch_size=self.batch,
            lr=self.lr if lr is None else lr,
            headmap_lr=self.headmap_lr if headmap_lr is None else headmap_lr,
            seed=seed,
            data_seed=self.data_seed + seed,
            rank=self.rank,
            lora_rank=lora_rank,
            eval_n=self.eval_n,
        )


def load_settings(path: str | Path) -> HeadMapSettings:
    """The ``[headmap]`` section of the task file ``path`` (unknown keys, runs and tasks refused with their line)."""
    return load_file(path)[0]


def load_file(path: str | Path) -> tuple[HeadMapSettings, str]:
    """The ``[headmap]`` settings and the ``[output] dir`` of the task file ``path`` (checked with their line)."""
    from ...tasks.base import trainable_tasks

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
# locate / finetune (one part each)
# --------------------------------------------------------------------------------------


def locate_and_write(model: LoadedModel, task: str, cfg: LocateConfig, out: Path, progress: bool = True) -> dict:
    """Locate ``cfg.k`` heads per layer on ``task``; ``out``: circuit.json, heads.png, curve.png."""
    res = locate_task(model, task, cfg, progress=progress)
    circuit = res.circuit(model.name, task)
    circuit.save(out / "circuit.json")
    heatmap_figure(
        circuit.scores["headmap"],
        circuit.heads(),
        model.shape,
        out / "heads.png",
        f"{model.name} on {task}: k={cfg.k} per layer, n={cfg.n}",
        circuit.meta["curve"],
    )
    curve_figure({task: circuit.meta}, out / "curve.png")
    log.info(
        "located %d heads in %.0f s, %d forward passes (%d prompt rows); loss %.3f -> %.3f (pool mean %.3f)",
        len(res.heads),
        res.seconds,
        res.forward_passes,
        res.rows,
        res.base_loss,
        res.curve[-1],
        res.pool_loss,
    )
    return circuit.to_dict()


def finetune(model: LoadedModel, circuit: Circuit, cfg: TrainConfig, progress: bool = True) -> dict:
    """HeadMap maps on ``circuit``'s heads (and a LoRA when ``cfg.lora_rank``) trained on ``cfg.task``; the
    training record with the held-out accuracy (bootstrap interval)."""
    ev = get_task(cfg.task).eval_batch(model.tokenizer, cfg.eval_n, cfg.eval_seed)
    res = train(model, cfg, heads_by_layer(circuit.heads()), {cfg.task: ev}, progress=progress)
    return res | {"accuracy": bootstrap(res["correct"][cfg.task]).to_dict()}


def train_maps_and_write(model: LoadedModel, circuit: Circuit, cfg: TrainConfig, out: Path) -> str:
    """`finetune`, its record written to ``out/result.json``; returns the line ``headmap finetune`` prints."""
    res = finetune(model, circuit, cfg)
    acc = res["accuracy"]
    write_json(out / "result.json", res)
    return (
        f"trainable parameters {res['trainable']}; {cfg.task} accuracy {acc['value']:.3f} "
        f"[{acc['low']:.3f}, {acc['high']:.3f}]"
    )


# --------------------------------------------------------------------------------------
# The cost of each stage above, for the resource plan (`mechdiff.studies.planner`)
# --------------------------------------------------------------------------------------

#: Rows a pass of `correct` (the held-out and validation evaluations) holds: its default batch size.
EVAL_BATCH = 50


def locate_cost(meter: Any, st: HeadMapSettings, task: str, n: int, tokens: float, stage: str) -> Any:
    """`locate_and_write` (`locate_task`): the pool's full passes (sample selection); per layer after the first
    the selections' entry residual carried one block on, ``n`` rows; per layer the ``(heads + 1) x n`` variants'
    passes from that layer on; the final masked pass of the ``n`` samples."""
    from ..planner import StageCost

    d, b = meter.dims, st.batch_size
    L, H = d.n_layers, d.n_heads
    per_n, variants = math.ceil(n / b), math.ceil((H + 1) * n / b)
    flops = meter.fwd(st.pool, tokens) + meter.fwd(n, tokens) + (L - 1) * meter.fwd(n, tokens, layers=1)
    reads = meter.reads(math.ceil(st.pool / b) + per_n) + meter.reads((L - 1) * per_n, 1)
    for layer in range(L):
        flops += meter.fwd((H + 1) * n, tokens, layers=L - layer)
        reads += meter.reads(variants, L - layer)
    rows = min(b, max(st.pool, (H + 1) * n))
    entry = n * math.ceil(tokens) * d.d_model * dtype_bytes(meter.dtype)  # the residual entering the layer, kept
    return StageCost(
        stage, 1, n, rows, flops, meter.weights, entry, meter.act(rows, tokens),
        batch_option="[headmap] batch_size", reads=reads,
    )  # fmt: skip


def evaluation_cost(meter: Any, st: HeadMapSettings, tokens: float, stage: str, models: int = 1) -> Any:
    """``train-base`` and ``train-lora-zoo``: `correct` on the ``eval_n`` held-out prompts (``models``: the zoo's
    LoRA held beside the study's model)."""
    from ..planner import StageCost

    rows = meter.rows(st.eval_n, EVAL_BATCH)
    return StageCost(
        stage, models, st.eval_n, rows, meter.fwd(st.eval_n, tokens), models * meter.weights, 0,
        meter.act(rows, tokens), batch_option="", reads=meter.reads(math.ceil(st.eval_n / EVAL_BATCH)),
    )  # fmt: skip


def train_cost(meter: Any, st: HeadMapSettings, run_id: str, tokens: float, stage: str) -> Any:
    """A training stage (`train`): ``steps`` forward and backward passes of ``batch`` prompts (the backward to the
    activations and the few trained parameters: two forwards' FLOPs; training prompts counted as long as the
    held-out ones, the longest they get), on a copy of the model (two models' weights), then `correct` on the
    held-out and validation prompts; where maps attach, the copy's architecture probe (`architecture_for`: one
    forward of three tokens). Kept: the trained parameters, their gradients and AdamW's two moments."""
    from ...methods.headmap import HeadMap, lora_params
    from ...models.architectures import ModelShape
    from ...models.footprint import backward_bytes
    from ..planner import StageCost

    d, rank = meter.dims, {"lora-large": st.lora_large, "lora-small": st.lora_small, "headmap+lora": st.lora_small}
    shape = ModelShape(d.n_layers, d.n_heads, d.n_kv_heads, d.d_head, d.d_model, d.vocab_size)
    maps = {layer: list(range(st.k)) for layer in range(d.n_layers)} if run_id in MAP_RUNS else {}
    trained = (HeadMap.n_params_for(maps, d.d_head, d.d_model, st.rank) if maps else 0) + (
        lora_params(shape, rank[run_id]) if run_id in rank else 0
    )
    evaluated = st.eval_n + st.val_n
    flops = 2 * meter.fwd(st.steps * st.batch, tokens) + meter.fwd(evaluated, tokens)
    probe = 1 if maps else 0
    flops += probe * meter.fwd(1, 3)
    passes = math.ceil(st.eval_n / EVAL_BATCH) + math.ceil(st.val_n / EVAL_BATCH) + probe
    transient = backward_bytes(d, st.batch, math.ceil(tokens), d.n_layers, meter.dtype)
    return StageCost(
        stage, 2, st.steps * st.batch, st.batch, flops, 2 * meter.weights, 4 * trained * 4, transient,
        batch_option="[headmap] batch", reads=meter.reads(st.steps + passes),
    )  # fmt: skip


def task_tokens(tokenizer: Any, task: str, seed: int) -> int:
    """Tokens of ``task``'s locating prompts (a few of its pool) under ``tokenizer``."""
    return int(get_task(task).pool_batch(tokenizer, 8, seed)["input_ids"].shape[1])


def headmap_costs(meter: Any, st: HeadMapSettings, tokens: dict[str, int]) -> list:
    """Every stage of the study in the order `HeadMapStudy.stages` meets them: the evaluations, the learning-rate
    sweep on the first seed, each seed's runs (the sweep's run at the chosen rate is the first seed's run of
    ``located`` and ``lora-small``: not counted twice), each locating stage before the first run that reads it
    (that of `TASK` at the end where none does)."""
    runs, first = st.runs, st.seeds[0]
    maps_swept, lora_swept = bool(st.lrs and set(runs) & set(MAP_RUNS)), bool(st.lrs and set(runs) & set(LORA_RUNS))
    out, located = [], set()

    def locate(task: str) -> None:
        if task not in located:
            located.add(task)
            n = st.n if task == TASK else st.transfer_n or st.n
            out.append(locate_cost(meter, st, task, n, tokens[task], f"locate-{task}"))

    if "base" in runs:
        out.append(evaluation_cost(meter, st, tokens[TASK], "train-base"))
    if "lora-zoo" in runs:
        out.append(evaluation_cost(meter, st, tokens[TASK], "train-lora-zoo", 2))
    for lr in st.lrs if maps_swept else ():
        locate(TASK)
        out.append(train_cost(meter, st, "located", tokens[TASK], f"train-located-seed{first}-hlr{lr:g}"))
    for lr in st.lrs if lora_swept else ():
        out.append(train_cost(meter, st, "lora-small", tokens[TASK], f"train-lora-small-seed{first}-lr{lr:g}"))

    def name(r: str, seed: int) -> str:
        if st.lrs:
            return f"train-{r}-seed{seed} (at the chosen rates)"
        lora = {"lora-large": st.lora_large, "lora-small": st.lora_small, "headmap+lora": st.lora_small}.get(r, 0)
        return stage_name(r, st.train_config(TASK, lora, seed), {0: [0]} if r in MAP_RUNS else None)

    for seed in st.seeds:
        for r in (r for r in runs if r not in UNSEEDED):
            if seed == first and ((r == "located" and maps_swept) or (r == "lora-small" and lora_swept)):
                continue  # the sweep's run at the chosen rate
            if r in ("located", "outside", "headmap+lora"):
                locate(TASK)
            if r == "transfer":
                locate(st.transfer_task)
            out.append(train_cost(meter, st, r, tokens[TASK], name(r, seed)))
    locate(TASK)
    return out


# --------------------------------------------------------------------------------------
# The study
# --------------------------------------------------------------------------------------


MAP_RUNS = ("located", "random", "outside", "transfer", "headmap+lora")  # runs that train HeadMap maps
LORA_RUNS = ("lora-small", "lora-large", "headmap+lora")  # runs that train a LoRA


def train_inputs(
    model: str, cfg: TrainConfig, heads: Optional[dict[int, list[int]]], val_n: int, val_seed: int
) -> dict:
    """A training stage's key: the model, the options the run reads (a rate it does not use is left out, so the
    sweep's run at the chosen rate is the main run of that seed), the heads and the validation prompts."""
    config = asdict(cfg) | {"lora_targets": list(cfg.lora_targets)}
    if not cfg.lora_rank:
        del config["lr"], config["lora_targets"]
    if not heads:
        del config["headmap_lr"], config["rank"]
    return {
        "model": model,
        "config": config,
        "heads": {str(k): v for k, v in (heads or {}).items()},
        "validation": {"n": val_n, "seed": val_seed},
    }


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
            inputs = {
                "model": st.model,
                "pool": st.pool,
                "k": st.k,
                "batch_size": st.batch_size,
                "seed": st.seed,
                "task": task,
                "n": n,
            } | dtype_inputs(self.model.model)
            rec = self.cache.run(
                f"locate-{task}",
                inputs,
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

    def lora_rank(self, run_id: str) -> int:
        st = self.settings
        return {"lora-large": st.lora_large, "lora-small": st.lora_small, "headmap+lora": st.lora_small}.get(run_id, 0)

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
        evaluation = {"eval_n": st.eval_n, "eval_seed": st.train_config().eval_seed} | dtype_inputs(self.model.model)
        if run_id == "base":
            return self.cache.run(
                "train-base", {"model": st.model, **evaluation}, lambda: self._evaluate(self.model, ev)
            ).result
        if run_id == "lora-zoo":
            return self.cache.run("train-lora-zoo", {"model": st.lora_zoo, **evaluation}, lambda: self._zoo(ev)).result
        if lr is None or headmap_lr is None:
            chosen_lr, chosen_hlr = self.chosen_lrs(ev)
            lr = chosen_lr if lr is None else lr
            headmap_lr = chosen_hlr if headmap_lr is None else headmap_lr
        cfg = st.train_config(TASK, self.lora_rank(run_id), seed, lr, headmap_lr)
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

    @staticmethod
    def _evaluate(model: LoadedModel, ev: dict) -> dict:
        return {
            "trainable": 0,
            "correct": {TASK: correct(model.model, ev[TASK]).tolist()},
            "losses": [],
            "train_seconds": 0.0,
            "heads": {},
        }

    def _zoo(self, ev: dict) -> dict:
        zoo = self.load(self.settings.lora_zoo)
        return {
            **self._evaluate(zoo, ev),
            "trainable": lora_params(self.model.shape, self.settings.lora_large),
            "train_seconds": float("nan"),
            "provenance": zoo.provenance,
        }

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
