"""The ``locate-<task>`` stage of the HeadMap kind: the circuit located on a task (``k`` heads per layer, layer-
conditioned, from the ``n`` lowest-loss samples of a pool), its key, its computation (with its figures) and its
cost."""

from __future__ import annotations

import logging
import math
from pathlib import Path
from typing import Any

from ...methods.headmap import LocateConfig, get_task, locate_task
from ...models.footprint import dtype_bytes
from ...models.loading import LoadedModel, dtype_inputs
from ..planner import StageCost
from .figures import curve_figure, heatmap_figure
from .settings import HeadMapSettings

log = logging.getLogger(__name__)


def locate_inputs(st: HeadMapSettings, task: str, n: int, model: LoadedModel) -> dict:
    """The key of ``locate-<task>``: the model, the locating options, the task and its samples ``n``, the dtype."""
    return {
        "model": st.model,
        "pool": st.pool,
        "k": st.k,
        "batch_size": st.batch_size,
        "seed": st.seed,
        "task": task,
        "n": n,
    } | dtype_inputs(model.model)


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


def locate_cost(meter: Any, st: HeadMapSettings, task: str, n: int, tokens: float, stage: str) -> StageCost:
    """`locate_and_write` (`locate_task`): the pool's full passes (sample selection); per layer after the first
    the selections' entry residual carried one block on, ``n`` rows; per layer the ``(heads + 1) x n`` variants'
    passes from that layer on; the final masked pass of the ``n`` samples."""

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


def task_tokens(tokenizer: Any, task: str, seed: int) -> int:
    """Tokens of ``task``'s locating prompts (a few of its pool) under ``tokenizer``."""
    return int(get_task(task).pool_batch(tokenizer, 8, seed)["input_ids"].shape[1])
