"""Figures as plain functions writing PNGs (matplotlib, Agg backend)."""

from __future__ import annotations

from pathlib import Path
from typing import Mapping, Optional, Sequence

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
import numpy as np  # noqa: E402

from ..common.components import Head  # noqa: E402
from ..common.io import save_figure


def scores_grid(scores: Mapping[Head, float], n_layers: int, n_heads: int) -> np.ndarray:
    """``"layer head"`` array of scores, NaN where a head was not scored."""
    grid = np.full((n_layers, n_heads), np.nan)
    for h, s in scores.items():
        grid[h.layer, h.head] = s
    return grid


def head_heatmap(
    scores: Mapping[Head, float],
    n_layers: int,
    n_heads: int,
    path: str | Path,
    title: str = "",
    selected: Sequence[Head] = (),
    label: str = "score",
) -> Path:
    """Layers x heads heatmap of per-head scores (diverging, centred on 0); ``selected`` heads boxed."""
    grid = scores_grid(scores, n_layers, n_heads)
    vmax = float(np.nanmax(np.abs(grid))) if np.isfinite(grid).any() else 1.0
    fig, ax = plt.subplots(figsize=(max(3.0, 0.45 * n_heads + 1.5), max(3.0, 0.22 * n_layers + 1)))
    cmap = plt.get_cmap("RdBu").copy()
    cmap.set_bad("#dddddd")
    im = ax.imshow(
        np.ma.masked_invalid(grid),
        cmap=cmap,
        vmin=-vmax or -1,
        vmax=vmax or 1,
        aspect="auto",
        origin="lower",
        interpolation="nearest",
    )
    for h in selected:
        ax.add_patch(plt.Rectangle((h.head - 0.5, h.layer - 0.5), 1, 1, fill=False, ec="black", lw=1.5))
    ax.set_xlabel("head")
    ax.set_ylabel("layer")
    ax.set_xticks(range(n_heads))
    ax.set_title(title + ("\n(grey: not tested)" if np.isnan(grid).any() else ""), fontsize=9)
    fig.colorbar(im, ax=ax, label=label)
    return save_figure(fig, path)


def attention_pattern(
    pattern: np.ndarray,
    tokens: Sequence[str],
    path: str | Path,
    title: str = "",
    query_positions: Optional[Sequence[int]] = None,
) -> Path:
    """An attention pattern (``"query key"``) with token labels; ``query_positions`` selects rows."""
    pattern = np.asarray(pattern)
    rows = list(query_positions) if query_positions is not None else list(range(pattern.shape[0]))
    data = pattern[rows]
    fig, ax = plt.subplots(figsize=(max(4.0, 0.18 * len(tokens) + 2), max(2.0, 0.3 * len(rows) + 1.5)))
    im = ax.imshow(data, cmap="Blues", vmin=0, vmax=max(float(data.max()), 1e-9), aspect="auto")
    ax.set_xticks(range(len(tokens)))
    ax.set_xticklabels(tokens, rotation=90, fontsize=6)
    ax.set_yticks(range(len(rows)))
    ax.set_yticklabels([tokens[r] for r in rows], fontsize=7)
    ax.set_title(title, fontsize=9)
    fig.colorbar(im, ax=ax, label="attention")
    return save_figure(fig, path)


def grid_heatmap(
    grid: np.ndarray,
    path: str | Path,
    title: str = "",
    xlabel: str = "position",
    ylabel: str = "layer",
    label: str = "effect",
) -> Path:
    """A ``"row column"`` grid of effects (diverging, centred on 0), e.g. a [layer, position] patching scan."""
    grid = np.asarray(grid, dtype=float)
    vmax = float(np.nanmax(np.abs(grid))) if np.isfinite(grid).any() else 1.0
    fig, ax = plt.subplots(figsize=(max(3.0, 0.2 * grid.shape[1] + 2), max(3.0, 0.22 * grid.shape[0] + 1)))
    im = ax.imshow(
        grid, cmap="RdBu", vmin=-vmax or -1, vmax=vmax or 1, aspect="auto", origin="lower", interpolation="nearest"
    )
    ax.set_xlabel(xlabel)
    ax.set_ylabel(ylabel)
    ax.set_title(title, fontsize=9)
    fig.colorbar(im, ax=ax, label=label)
    return save_figure(fig, path)


def band_figure(
    steps: Sequence[int],
    series: dict[str, Sequence[Optional[dict]]],
    path: str | Path,
    title: str = "",
    ylabel: str = "",
    zero: bool = False,
    levels: Sequence[float] = (),
) -> Path:
    """Each series (``{"value", "low", "high"}`` per step, None where absent) against the step, its interval as
    a band; a dashed line at each of ``levels``."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    from ..common.io import save_figure

    fig, ax = plt.subplots(figsize=(6.4, 3.8))
    for label, points in series.items():
        xs = [s for s, p in zip(steps, points) if p is not None]
        got = [p for p in points if p is not None]
        if not got:
            continue
        (line,) = ax.plot(xs, [p["value"] for p in got], marker="o", ms=3, label=label)
        ax.fill_between(xs, [p["low"] for p in got], [p["high"] for p in got], color=line.get_color(), alpha=0.2)
    if zero:
        ax.axhline(0, color="grey", lw=0.8)
    for y in levels:
        ax.axhline(y, color="grey", lw=0.8, ls="--")
    ax.set_xlabel("training step")
    ax.set_ylabel(ylabel)
    ax.set_title(title, fontsize=9)
    if ax.get_legend_handles_labels()[0]:
        ax.legend(fontsize=7, loc="best")
    return save_figure(fig, path)
