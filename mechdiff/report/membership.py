"""Heatmap of circuit membership: one panel per circuit (model), layers x heads, cells coloured by group."""

from __future__ import annotations

from pathlib import Path
from typing import Mapping

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
import numpy as np  # noqa: E402
from matplotlib.colors import ListedColormap  # noqa: E402
from matplotlib.patches import Patch as LegendPatch  # noqa: E402

from ..circuits.circuit import Circuit  # noqa: E402
from ..common.io import save_figure

_MULTI = "several"


def membership_grid(circuit: Circuit, n_layers: int, n_heads: int, groups: list[str]) -> np.ndarray:
    """``"layer head"`` codes: 0 outside the circuit, ``i + 1`` for ``groups[i]``, ``len(groups) + 1``
    for a head in several groups."""
    grid = np.zeros((n_layers, n_heads), dtype=int)
    for g, heads in circuit.groups.items():
        code = groups.index(g) + 1
        for h in heads:
            grid[h.layer, h.head] = code if grid[h.layer, h.head] in (0, code) else len(groups) + 1
    return grid


def membership_heatmap(
    circuits: Mapping[str, Circuit], n_layers: int, n_heads: int, path: str | Path, title: str | None = None
) -> Path:
    """Write a PNG with one layers x heads panel per circuit; returns the path (written atomically)."""
    if not circuits:
        raise ValueError("no circuits to draw")
    for c in circuits.values():
        c.validate(n_layers, n_heads)
    groups = list(dict.fromkeys(g for c in circuits.values() for g in c.groups))
    names = {g: n for c in circuits.values() for g, n in c.names.items()}
    colours = ["#f2f2f2"] + [plt.get_cmap("tab10")(i) for i in range(len(groups))] + ["black"]
    cmap = ListedColormap(colours)
    fig, axes = plt.subplots(
        1,
        len(circuits),
        figsize=(1.2 + 0.28 * n_heads * len(circuits), 1.0 + 0.2 * n_layers),
        squeeze=False,
        sharey=True,
    )
    for ax, (label, circuit) in zip(axes[0], circuits.items()):
        grid = membership_grid(circuit, n_layers, n_heads, groups)
        ax.imshow(grid, cmap=cmap, vmin=0, vmax=len(colours) - 1, aspect="auto", interpolation="nearest")
        ax.set_title(f"{label}\n{len(circuit.heads())} heads", fontsize=9)
        ax.set_xlabel("head")
        ax.set_xticks(range(0, n_heads, max(1, n_heads // 8)))
        ax.set_yticks(range(0, n_layers, max(1, n_layers // 10)))
    axes[0][0].set_ylabel("layer")
    handles = [LegendPatch(color=colours[i + 1], label=f"{g} {names.get(g, '')}".strip()) for i, g in enumerate(groups)]
    handles.append(LegendPatch(color="black", label=_MULTI))
    fig.legend(handles=handles, loc="lower center", ncol=min(len(handles), 5), fontsize=8, frameon=False)
    if title:
        fig.suptitle(title, fontsize=10)
    fig.tight_layout(rect=(0, 0.08, 1, 1))
    return save_figure(fig, path, dpi=120)
