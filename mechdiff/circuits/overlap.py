"""Overlap of two circuits, group by group, with a hypergeometric p-value (scipy).

For each group shared by both circuits: the sizes, the intersection, the intersection as a
fraction of each circuit's group, the Jaccard index, and the probability that two random head
sets of these sizes, drawn from all heads of the model, share at least this many heads.
"""

from __future__ import annotations

from typing import Optional, Sequence

from scipy.stats import hypergeom

from ..common.components import Head
from .circuit import Circuit


def hypergeom_p(intersection: int, n_total: int, n_first: int, n_second: int) -> float:
    """P(|A & B| >= intersection) for random head sets of sizes ``n_first``, ``n_second`` out of ``n_total``."""
    if not (0 <= n_first <= n_total and 0 <= n_second <= n_total):
        raise ValueError(f"set sizes {n_first}, {n_second} must lie within the {n_total} heads of the model")
    return float(hypergeom(M=n_total, n=n_first, N=n_second).sf(intersection - 1))


def overlap_row(group: str, first: Sequence[Head], second: Sequence[Head], n_total: int, name: str = "") -> dict:
    """One row of the overlap table for two head sets."""
    a, b = set(first), set(second)
    inter, union = len(a & b), len(a | b)
    return {
        "group": group,
        "name": name,
        "size_first": len(a),
        "size_second": len(b),
        "intersection": inter,
        "frac_first": inter / len(a) if a else float("nan"),
        "frac_second": inter / len(b) if b else float("nan"),
        "jaccard": inter / union if union else float("nan"),
        "p_value": hypergeom_p(inter, n_total, len(a), len(b)),
    }


def overlap_table(
    first: Circuit,
    second: Circuit,
    n_layers: int,
    n_heads: int,
    groups: Optional[Sequence[str]] = None,
    include_all: bool = True,
) -> list[dict]:
    """Per-group overlap rows (groups of ``first`` that ``second`` also has, in ``first``'s order),
    plus an ``all`` row over the distinct heads of each circuit."""
    first.validate(n_layers, n_heads)
    second.validate(n_layers, n_heads)
    n_total = n_layers * n_heads
    names = groups if groups is not None else [g for g in first.groups if g in second.groups]
    missing = [g for g in names if g not in first.groups or g not in second.groups]
    if missing:
        raise ValueError(
            f"groups {missing} are not in both circuits (first: {list(first.groups)}, second: {list(second.groups)})"
        )
    rows = [overlap_row(g, first.groups[g], second.groups[g], n_total, first.names.get(g, "")) for g in names]
    if include_all:
        rows.append(overlap_row("all", first.heads(), second.heads(), n_total, "all heads"))
    return rows
