"""An activation-patching scan of a task's pairs, as ``mechdiff scan`` runs it: the position's checks, the pairs,
`mechdiff.patching.scan.scan_pairs`, the tensor, JSON and heatmap it writes and the largest effects."""

from __future__ import annotations

from pathlib import Path
from typing import Any, Callable, Mapping

import torch

from ...common.components import Head
from ...common.io import write_json
from ...models.loading import LoadedModel
from ...patching.scan import ScanResult, scan_pairs
from ...report.figures import grid_heatmap, head_heatmap
from ...tasks.base import Task, pair_batch_tensors

EVERY = "all"  # patch every position at once


def check_position(task: Task, position: str) -> None:
    """``position`` is one of ``task``'s named positions, or `EVERY`."""
    known = (*task.positions, EVERY)
    if position not in known:
        raise ValueError(
            f"--position {position!r} is not a position of task {task.name}; choose one of {', '.join(known)}"
        )


def largest_effects(result: ScanResult, k: int = 5) -> str:
    """The clean and source metric and the ``k`` cells of largest absolute effect."""
    top = result.effects.flatten().abs().argsort(descending=True)[:k]
    cells = [divmod(int(i), result.effects.shape[1]) for i in top]
    return f"{result.label}: clean {result.clean:.4f}, source {result.source:.4f}; largest effects " + ", ".join(
        f"[{a}, {b}] {float(result.effects[a, b]):+.4f}" for a, b in cells
    )


def write_scan(result: ScanResult, stem: Path, meta: Mapping[str, Any], title: str) -> None:
    """``stem.pt`` (effects and ``meta``), ``stem.json`` and the heatmap ``stem.png``."""
    torch.save({"effects": result.effects, **meta}, stem.with_suffix(".pt"))
    write_json(stem.with_suffix(".json"), {**meta, "effects": result.effects.tolist()})
    if result.axes == ("layer", "head"):
        scores = {
            Head(l, h): float(result.effects[l, h])
            for l in range(result.effects.shape[0])
            for h in range(result.effects.shape[1])
        }
        head_heatmap(scores, *result.effects.shape, stem.with_suffix(".png"), title=title, label=result.label)
    else:
        grid_heatmap(result.effects.numpy(), stem.with_suffix(".png"), title=title, label=result.label)


def scan_task(
    task: Task,
    site: str,
    position: str,
    metric: str,
    n: int,
    seed: int,
    options: Mapping[str, Any],
    per_pass: int,
    out: Path,
    load_tokenizer: Callable[[], Any],
    load_model: Callable[[Any], LoadedModel],
) -> str:
    """Patch ``site`` of each head (or residual position) alone at ``position`` (`EVERY`: all at once) on
    ``n`` pairs of ``task`` (seed ``seed``, generator ``options``), effects on ``metric``; the position and the
    pairs are checked before the weights load (``load_tokenizer()``, then ``load_model(tokenizer)``). Writes
    ``out/scan_{site}_{position}.pt/.json/.png``; returns the summary the command prints."""
    check_position(task, position)
    tokenizer = load_tokenizer()
    # the pairs (and which positions are single tokens: one prompt shows it) are checked before the weights load
    pairs = task.discovery_pairs(tokenizer, n, seed, **options)
    tensors = pair_batch_tensors(pairs[:1])
    if position != EVERY and (
        position not in tensors["base"]["positions"] or tensors["base"]["positions"][position].ndim != 1
    ):
        raise ValueError(f"--position {position!r} is not a single position of each prompt of task {task.name}")
    model = load_model(tokenizer)
    # prompts of several lengths and templates: each group scanned alone, effects averaged over every prompt
    result = scan_pairs(
        model, pairs, site=site, position=None if position == EVERY else position, metric=metric, per_pass=per_pass
    )
    out.mkdir(parents=True, exist_ok=True)
    stem = out / f"scan_{site}_{position}"
    meta = {
        **{k: v for k, v in result.to_dict().items() if k != "effects"},
        "model": model.name,
        "task": task.name,
        "n_pairs": len(pairs),
        **task.kwargs(**options),
        "seed": seed,
        "position": position,
    }
    write_scan(result, stem, meta, f"{model.name}: {site} patched at {position}")
    return f"{largest_effects(result)}\n-> {stem}.pt, .json, .png"
