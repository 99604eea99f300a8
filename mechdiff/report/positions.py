"""Figure of a position scan: faithfulness as classes are added, with intervals."""

from __future__ import annotations

from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402

from ..io import save_figure  # noqa: E402


def position_scan_figure(scan: dict, path: str | Path, title: str = "") -> Path:
    """Accuracy and probability faithfulness per greedy step (95% CIs), the full model at 1."""
    steps = scan["steps"]
    x = range(1, len(steps) + 1)
    fig, ax = plt.subplots(figsize=(max(5.0, 0.55 * len(steps) + 2), 3.6))
    for key, label in (("faithfulness", "accuracy"), ("faithfulness_prob", "answer probability")):
        v = [s[key]["value"] for s in steps]
        lo = [s[key]["value"] - s[key]["low"] for s in steps]
        hi = [s[key]["high"] - s[key]["value"] for s in steps]
        ax.errorbar(x, v, yerr=[lo, hi], marker="o", capsize=3, label=f"faithfulness ({label})")
    ax.axhline(1.0, color="grey", ls="--", lw=1, label="full model")
    ax.set_xticks(list(x), [s["added"] for s in steps], rotation=50, ha="right", fontsize=8)
    ax.set_xlabel("position class added (every head kept there)")
    ax.set_ylabel("F(kept) / F(M)")
    ax.set_title(title, fontsize=10)
    ax.legend(fontsize=8)
    fig.tight_layout()
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    return save_figure(fig, path, dpi=120)
