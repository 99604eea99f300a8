"""Atomic writes: every file mechdiff writes goes to a temporary name first, then is renamed,
so an interrupted run never leaves a half-written result behind."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any


def _tmp(path: Path) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    return path.with_name(f".{path.stem}.tmp{path.suffix}")


def write_text(path: str | Path, text: str) -> Path:
    """Write ``text`` to ``path`` atomically."""
    path = Path(path)
    tmp = _tmp(path)
    tmp.write_text(text)
    tmp.replace(path)
    return path


def write_json(path: str | Path, data: Any) -> Path:
    """Write ``data`` as indented JSON atomically."""
    return write_text(path, json.dumps(data, indent=2, default=str) + "\n")


def save_figure(fig: Any, path: str | Path, dpi: int = 150) -> Path:
    """Save a matplotlib figure as PNG atomically and close it."""
    import matplotlib.pyplot as plt

    path = Path(path)
    tmp = _tmp(path)
    fig.savefig(tmp, format="png", dpi=dpi, bbox_inches="tight")
    plt.close(fig)
    tmp.replace(path)
    return path
