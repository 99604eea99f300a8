"""The HeadMap study's figures: the locating loss curve, the located heads' heatmap and the training loss."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np

from ...common.io import save_figure


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


def heatmap_figure(
    meta_scores: dict[str, float], heads: list, shape: Any, path: Path, title: str, curve: Any = None
) -> Path:
    """Per head: the loss with it masked (and earlier selections) minus the layer's loss with only the earlier
    selections masked (``curve[layer]``), so every layer's candidates are comparable; selected heads boxed."""
    from ...common.components import parse_heads
    from ...report.figures import head_heatmap

    scores = {
        h: v - (curve[h.layer] if curve else 0.0) for h, v in zip(parse_heads(list(meta_scores)), meta_scores.values())
    }
    return head_heatmap(
        scores,
        shape.n_layers,
        shape.n_heads,
        path,
        title=title,
        selected=heads,
        label="loss increase from masking the head (given earlier selections)",
    )


def loss_figure(results: dict[str, list[dict]], path: Path) -> Path:
    """Training loss per step of every run that trained (mean over its seeds)."""
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 3.6))
    for name, records in results.items():
        losses = [r["losses"] for r in records if r["losses"]]
        if losses:
            ax.plot(
                range(1, len(losses[0]) + 1),
                np.mean(losses, axis=0),
                linewidth=1,
                label=f"{name} (mean of {len(losses)} seeds)",
            )
    ax.set_xlabel("step")
    ax.set_ylabel("training answer loss")
    ax.set_yscale("log")
    ax.legend(fontsize=6)
    return save_figure(fig, path)
