"""The trajectory report's account of when each component forms: rows of each component's normalised measure per
step, its formation steps with bootstrap intervals, the paired order of every two components, and the sentences
that say which pairs those intervals order and which they do not (:mod:`~mechdiff.methods.formation`)."""

from __future__ import annotations

from itertools import combinations
from typing import Any, Optional, Sequence

import numpy as np

from ..methods.formation import LEVELS, Curve, order


def level_name(q: float) -> str:
    """``0.5`` -> ``"50%"``."""
    return f"{q:.0%}"


def _bound(x: Optional[int], last: int) -> Any:
    """A formation step or bound; None (not reached by the last step in the draws beyond it) as text."""
    return f"after {last}" if x is None else x


def formation_rows(curves: dict[str, Curve], what: dict[str, str], levels: Sequence[float] = LEVELS) -> list[dict]:
    """Per component: its normalised measure at the final step (95% CI), whether it formed (that interval above
    0), and at each level the first step reaching that share of the final value with its bootstrap interval."""
    rows = []
    for name, c in curves.items():
        final = c.interval(len(c.steps) - 1)
        row: dict[str, Any] = {"component": name, "measure": what[name]}
        row.update(
            {"final": final["value"], "final_low": final["low"], "final_high": final["high"]}
            if final
            else {"final": None, "final_low": None, "final_high": None}
        )
        row["formed"] = c.formed()
        for q in levels:
            f = c.formation(q)
            key = f"step_{level_name(q)}"
            if f["formed"]:
                low, high = _bound(f["low"], c.steps[-1]), _bound(f["high"], c.steps[-1])
                row.update({key: f["step"], f"{key}_low": low, f"{key}_high": high})
            else:
                row.update({key: None, f"{key}_low": None, f"{key}_high": None})
            row[f"unreached_{level_name(q)}"] = f["unreached"]
        rows.append(row)
    return sorted(rows, key=lambda r: (not r["formed"], r.get(f"step_{level_name(levels[0])}") or 0))


def curve_rows(curves: dict[str, Curve]) -> list[dict]:
    """Per component and step, the normalised measure with its 95% CI (empty where it is not shown)."""
    rows = []
    for name, c in curves.items():
        for step, iv in zip(c.steps, c.per_step()):
            rows.append(
                {
                    "component": name,
                    "step": step,
                    "value": iv["value"] if iv else None,
                    "value_low": iv["low"] if iv else None,
                    "value_high": iv["high"] if iv else None,
                }
            )
    return rows


def _signed(x: float) -> Any:
    return x if np.isfinite(x) else ("inf" if x > 0 else "-inf")


def order_rows(curves: dict[str, Curve], levels: Sequence[float] = LEVELS) -> list[dict]:
    """Every two formed components at each level: the paired difference of their formation steps (a - b, 95% CI
    over the same draws) and what it orders: ``"a before b"``, ``"b before a"`` or ``"not ordered"``."""
    formed = [n for n, c in curves.items() if c.formed()]
    rows = []
    for q in levels:
        for a, b in combinations(formed, 2):
            o = order(curves[a], curves[b], q)
            verdict = {"a": f"{a} before {b}", "b": f"{b} before {a}"}.get(o["before"] or "", "not ordered")
            rows.append(
                {
                    "level": level_name(q),
                    "a": a,
                    "b": b,
                    "a_minus_b": _signed(o["difference"]),
                    "a_minus_b_low": _signed(o["low"]),
                    "a_minus_b_high": _signed(o["high"]),
                    "share_a_first": o["a_first"],
                    "share_b_first": o["b_first"],
                    "ordered": verdict,
                }
            )
    return rows


def order_text(rows: list[dict], formation: list[dict], steps: Sequence[int]) -> str:
    """What the intervals order, level by level, and what they leave unordered; components that never formed."""
    never = [r["component"] for r in formation if not r["formed"]]
    parts = []
    for level in dict.fromkeys(r["level"] for r in rows):
        mine = [r for r in rows if r["level"] == level]
        ordered = [r["ordered"] for r in mine if r["ordered"] != "not ordered"]
        parts.append(
            f"At {level} of the final value, the paired intervals order {len(ordered)} of {len(mine)} pairs of "
            "components"
            + (": " + "; ".join(ordered) if ordered else "")
            + f". The other {len(mine) - len(ordered)} pairs are not ordered by this run (their intervals hold 0)."
        )
    if not rows:
        parts.append("Fewer than two components formed: the run orders none.")
    if never:
        parts.append(f"Not formed (the final value's interval not above 0), so not ordered: {'; '.join(never)}.")
    parts.append(
        f"Checkpoints are at steps {', '.join(map(str, steps))}: a formation step is the first of these at which "
        "the measure reaches the level, so the step itself lies after the checkpoint before it."
    )
    return "\n\n".join(parts)
