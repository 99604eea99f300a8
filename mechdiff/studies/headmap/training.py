"""The training stages of the HeadMap kind, ``train-<run>-seed<s>[-lr<lr>][-hlr<lr>]`` (HeadMap maps on a head
set, a LoRA, or both, trained on `TASK`), and its two evaluations ``train-base`` and ``train-lora-zoo``: each
stage's key and name, the evaluations' computation (a training run's is `mechdiff.methods.headmap.train`), the
one-shot ``mechdiff headmap finetune`` and each stage's cost."""

from __future__ import annotations

import math
from dataclasses import asdict
from pathlib import Path
from typing import Any, Optional

from ...circuits.circuit import Circuit
from ...common.io import write_json
from ...common.stats import bootstrap
from ...methods.headmap import HeadMap, TrainConfig, correct, get_task, heads_by_layer, lora_params, train
from ...models.architectures import ModelShape
from ...models.footprint import backward_bytes
from ...models.loading import LoadedModel, dtype_inputs
from ..planner import StageCost
from .settings import MAP_RUNS, TASK, HeadMapSettings


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


#: Rows a pass of `correct` (the held-out and validation evaluations) holds: its default batch size.
EVAL_BATCH = 50


def evaluation_inputs(st: HeadMapSettings, name: str, model: LoadedModel) -> dict:
    """The key of ``train-base`` (``name``: the study's model) and ``train-lora-zoo`` (the zoo's): the model
    evaluated, the held-out prompts (their number and seed) and the dtype of the study's ``model``."""
    evaluation = {"eval_n": st.eval_n, "eval_seed": st.train_config().eval_seed} | dtype_inputs(model.model)
    return {"model": name, **evaluation}


def evaluate_model(model: LoadedModel, ev: dict) -> dict:
    """``train-base``'s record: ``model`` (no training) on the held-out prompts ``ev[TASK]``."""
    return {
        "trainable": 0,
        "correct": {TASK: correct(model.model, ev[TASK]).tolist()},
        "losses": [],
        "train_seconds": 0.0,
        "heads": {},
    }


def zoo_evaluation(zoo: LoadedModel, shape: ModelShape, rank: int, ev: dict) -> dict:
    """``train-lora-zoo``'s record: the zoo's saved LoRA of rank ``rank`` (on a model of ``shape``), evaluated
    as `evaluate_model`, not retrained, with its provenance."""
    return {
        **evaluate_model(zoo, ev),
        "trainable": lora_params(shape, rank),
        "train_seconds": float("nan"),
        "provenance": zoo.provenance,
    }


def evaluation_cost(meter: Any, st: HeadMapSettings, tokens: float, stage: str, models: int = 1) -> StageCost:
    """``train-base`` and ``train-lora-zoo``: `correct` on the ``eval_n`` held-out prompts (``models``: the zoo's
    LoRA held beside the study's model)."""
    rows = meter.rows(st.eval_n, EVAL_BATCH)
    return StageCost(
        stage, models, st.eval_n, rows, meter.fwd(st.eval_n, tokens), models * meter.weights, 0,
        meter.act(rows, tokens), batch_option="", reads=meter.reads(math.ceil(st.eval_n / EVAL_BATCH)),
    )  # fmt: skip


def train_cost(meter: Any, st: HeadMapSettings, run_id: str, tokens: float, stage: str) -> StageCost:
    """A training stage (`train`): ``steps`` forward and backward passes of ``batch`` prompts (the backward to the
    activations and the few trained parameters: two forwards' FLOPs; training prompts counted as long as the
    held-out ones, the longest they get), on a copy of the model (two models' weights), then `correct` on the
    held-out and validation prompts; where maps attach, the copy's architecture probe (`architecture_for`: one
    forward of three tokens). Kept: the trained parameters, their gradients and AdamW's two moments."""
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
