"""Figure of a position scan: faithfulness as classes are added, with intervals."""

from __future__ import annotations

from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402

from ..common.io import save_figure  # noqa: E402
from ..common.metrics import continuous_key, continuous_label  # noqa: E402


def _errorbar(ax, x: list, estimates: list[dict], **kwargs) -> None:
    """Estimates (``value``, ``low``, ``high``) against ``x`` with their intervals as error bars."""
    v = [e["value"] for e in estimates]
    ax.errorbar(
        x,
        v,
        yerr=[[e["value"] - e["low"] for e in estimates], [e["high"] - e["value"] for e in estimates]],
        marker="o",
        capsize=3,
        **kwargs,
    )


def _finish(fig, ax, title: str, path: str | Path) -> Path:
    """Title and legend; the figure saved as PNG (atomically, its directory created) and closed."""
    ax.set_title(title, fontsize=10)
    ax.legend(fontsize=8)
    fig.tight_layout()
    return save_figure(fig, path, dpi=120)


def position_scan_figure(scan: dict, path: str | Path, title: str = "") -> Path:
    """Accuracy and probability faithfulness per greedy step (95% CIs), the full model at 1."""
    steps = scan["steps"]
    x = range(1, len(steps) + 1)
    fig, ax = plt.subplots(figsize=(max(5.0, 0.55 * len(steps) + 2), 3.6))
    for key, label in (("faithfulness", "accuracy"), (continuous_key(steps[0]), continuous_label(steps[0]))):
        _errorbar(ax, list(x), [s[key] for s in steps], label=f"faithfulness ({label})")
    ax.axhline(1.0, color="grey", ls="--", lw=1, label="full model")
    ax.set_xticks(list(x), [s["added"] for s in steps], rotation=50, ha="right", fontsize=8)
    ax.set_xlabel("position class added (every head kept there)")
    ax.set_ylabel("F(kept) / F(M)")
    return _finish(fig, ax, title, path)


def curve_figure(curve: dict, path: str | Path, title: str = "") -> Path:
    """Faithfulness F(C)/F(M) (accuracy, 95% CIs) and MIB-normalised probability faithfulness against the
    fraction of (head, position) pairs kept; the full model and the target drawn as lines."""
    rows = curve["rows"]
    x = [r["fraction"] for r in rows]
    fig, ax = plt.subplots(figsize=(5.5, 3.6))
    _errorbar(ax, x, [r["faithfulness"] for r in rows], label="F(C)/F(M), accuracy")
    m = continuous_key(rows[0]).removeprefix("faithfulness_")
    if all(r[f"normalised_{m}"] is not None for r in rows):
        label = f"normalised, {continuous_label(rows[0])}"
        ax.plot(x, [r[f"normalised_{m}"] for r in rows], marker="s", label=label)
    ax.axhline(1.0, color="grey", ls="--", lw=1, label="full model")
    ax.axhline(curve["target"], color="tab:red", ls=":", lw=1, label=f"target {curve['target']}")
    ax.set_xscale("log")
    ax.set_xlabel(f"fraction of the {curve['n_pairs_total']} (head, position class) pairs kept")
    ax.set_ylabel("faithfulness")
    return _finish(fig, ax, title, path)


def stability_figure(frequencies: dict[str, float], chance: float, path: str | Path, title: str = "") -> Path:
    """Each selected (head, position) pair's selection frequency over bootstrap resamples, sorted, with the
    frequency a pair drawn at random would have (the circuit's share of all pairs)."""
    items = sorted(frequencies.items(), key=lambda kv: (-kv[1], kv[0]))
    fig, ax = plt.subplots(figsize=(max(5.5, min(14.0, 0.12 * len(items) + 3)), 3.6))
    ax.bar(range(len(items)), [v for _, v in items], width=0.85)
    ax.axhline(chance, color="tab:red", ls=":", lw=1, label=f"chance ({chance:.2f})")
    if len(items) <= 40:
        ax.set_xticks(range(len(items)), [k for k, _ in items], rotation=70, ha="right", fontsize=7)
    else:
        ax.set_xlabel(f"the circuit's {len(items)} (head, position class) pairs, most stable first")
    ax.set_ylim(0, 1.02)
    ax.set_ylabel("selection frequency")
    return _finish(fig, ax, title, path)
