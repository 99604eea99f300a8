"""Grouped bar charts with confidence intervals (matplotlib, Agg backend), written atomically."""

from __future__ import annotations

from pathlib import Path
from typing import Mapping, Optional, Sequence

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
import numpy as np  # noqa: E402

from ..common.inference import Interval  # noqa: E402
from ..common.io import save_figure


def grouped_bars(
    path: str | Path,
    categories: Sequence[str],
    series: Mapping[str, Sequence[Optional[Interval]]],
    title: str = "",
    ylabel: str = "accuracy",
    references: Optional[Mapping[str, Interval]] = None,
    ylim: Optional[tuple[float, float]] = (0.0, 1.0),
    caption: Optional[str] = None,
) -> Path:
    """One cluster of bars per category, one bar per series (with its CI as an error bar).

    ``series[name][i]`` is the estimate of ``categories[i]`` (``None``: no bar). ``references``
    draws labelled horizontal lines (e.g. base and fine-tune accuracy) with shaded CIs.
    """
    categories = list(categories)
    if not categories or not series:
        raise ValueError("a bar chart needs at least one category and one series")
    for name, values in series.items():
        if len(values) != len(categories):
            raise ValueError(f"series {name!r} has {len(values)} values for {len(categories)} categories")
    n = len(series)
    width = 0.8 / n
    x = np.arange(len(categories))
    fig, ax = plt.subplots(figsize=(max(5.0, 1.1 * len(categories) * max(1, n) * 0.45 + 2), 3.8))
    colors = plt.get_cmap("tab10")
    for i, (name, values) in enumerate(series.items()):
        heights = np.array([np.nan if v is None else v.value for v in values])
        err = np.array([[0.0, 0.0] if v is None else [v.value - v.low, v.high - v.value] for v in values]).T
        ax.bar(x - 0.4 + width * (i + 0.5), heights, width, yerr=err, capsize=2, label=name, color=colors(i % 10))
    for j, (name, est) in enumerate((references or {}).items()):
        style = ["--", ":", "-."][j % 3]
        ax.axhline(est.value, color="black", linestyle=style, linewidth=1, label=f"{name} ({est.value:.2f})")
        ax.axhspan(est.low, est.high, color="grey", alpha=0.12)
    ax.set_xticks(x, categories)
    ax.set_ylabel(ylabel)
    if ylim is not None:
        ax.set_ylim(*ylim)
    if title:
        ax.set_title(title, fontsize=10)
    ax.legend(fontsize=7, ncol=2, loc="upper left", bbox_to_anchor=(1.0, 1.0))
    if caption:
        fig.text(0.01, 0.01, caption, fontsize=6, wrap=True, va="bottom")
        fig.subplots_adjust(bottom=0.3)
    return save_figure(fig, Path(path))
