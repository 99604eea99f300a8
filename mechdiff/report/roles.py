"""Role membership over the steps of a trajectory, from its ``roles:<ckpt>`` stage records: per role (group,
desideratum) the heads x steps table of single-head scores, which heads hold the role at each step and which take
it over (:mod:`mechdiff.methods.roles`), as report rows."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

import numpy as np

from ..methods.roles import held, takeovers


@dataclass(frozen=True)
class Role:
    """One role's scores: ``"head step"`` arrays of the share of pairs moved to the target and its bounds."""

    group: str
    desideratum: str
    position: str
    heads: list[str]
    value: np.ndarray
    low: np.ndarray
    high: np.ndarray


def roles_of(records: Sequence[dict]) -> list[Role]:
    """Every role of the ``roles`` stage records of the steps in order (each a :func:`~mechdiff.methods.roles.
    head_scores` result); the steps must have scored the same heads."""
    keys = [(r["group"], r["desideratum"], r["position"], r["head"]) for r in records[0]["rows"]]
    for rec in records[1:]:
        if [(r["group"], r["desideratum"], r["position"], r["head"]) for r in rec["rows"]] != keys:
            raise ValueError("the roles stages of a trajectory must score the same heads at every step")
    out = []
    for g, d, p in dict.fromkeys(k[:3] for k in keys):
        idx = [i for i, k in enumerate(keys) if k[:3] == (g, d, p)]
        cols = {
            c: np.array([[rec["rows"][i]["share"][c] for rec in records] for i in idx])
            for c in ("value", "low", "high")
        }
        out.append(Role(g, d, p, [keys[i][3] for i in idx], cols["value"], cols["low"], cols["high"]))
    return out


def score_rows(roles: Sequence[Role], steps: Sequence[int], threshold: float) -> list[dict]:
    """A row per role, head and step: the share with its exact binomial interval and whether the head holds it."""
    rows = []
    for r in roles:
        member = held(r.low, threshold)
        for i, h in enumerate(r.heads):
            for j, s in enumerate(steps):
                rows.append(
                    {
                        "group": r.group,
                        "desideratum": r.desideratum,
                        "head": h,
                        "step": s,
                        "share": float(r.value[i, j]),
                        "share_low": float(r.low[i, j]),
                        "share_high": float(r.high[i, j]),
                        "holds": bool(member[i, j]),
                    }
                )
    return rows


def membership_rows(roles: Sequence[Role], steps: Sequence[int], threshold: float) -> list[dict]:
    """A row per role and step: how many of the role's scored heads hold it and which (``-``: none)."""
    rows = []
    for r in roles:
        member = held(r.low, threshold)
        for j, s in enumerate(steps):
            holding = [h for i, h in enumerate(r.heads) if member[i, j]]
            rows.append(
                {
                    "group": r.group,
                    "desideratum": r.desideratum,
                    "step": s,
                    "heads_scored": len(r.heads),
                    "n_holding": len(holding),
                    "holding": " ".join(holding) or "-",
                }
            )
    return rows


def takeover_rows(roles: Sequence[Role], steps: Sequence[int], threshold: float) -> list[dict]:
    """A row per role and head holding it at the last step: since when, whether it took it over, and the heads
    that held it before and lost it (:func:`~mechdiff.methods.roles.takeovers`)."""
    rows = []
    for r in roles:
        for t in takeovers(held(r.low, threshold), r.heads, list(steps)):
            rows.append(
                {
                    "group": r.group,
                    "desideratum": r.desideratum,
                    "head": t["head"],
                    "holds_since": t["since"],
                    "takes_over": t["takes_over"],
                    "held_before": " ".join(t["held_before"]) or "-",
                    "lost": " ".join(t["lost"]) or "-",
                }
            )
    return rows


def found(row: dict) -> bool:
    """A DCM selection found its property: selected heads, and test accuracy above the floor (intervals apart)."""
    return bool(row["selected"]) and row["test_accuracy"]["low"] > row["floor"]["high"]


def dcm_roles(records: Sequence[dict]) -> list[Role]:
    """Every role of ``roles`` stage records made by DCM in each checkpoint (``[roles] method = "dcm"``), as
    :class:`Role` membership: 1 where a head is in the step's DCM selection and that selection :func:`found` its
    property, else 0 (so :func:`membership_rows` and :func:`takeover_rows` read it at any threshold in [0, 1))."""
    keys = [(x["group"], x["desideratum"], x["position"]) for x in records[0]["dcm"]]
    out = []
    for g, d, p in keys:
        rows = [
            next(x for x in rec["dcm"] if (x["group"], x["desideratum"], x["position"]) == (g, d, p)) for rec in records
        ]
        heads = list(rows[0]["heads"])
        member = np.array([[float(h in x["selected"] and found(x)) for x in rows] for h in heads]).reshape(
            len(heads), -1
        )
        out.append(Role(g, d, p, heads, member, member, member))
    return out


def dcm_rows(records: Sequence[dict], steps: Sequence[int]) -> list[dict]:
    """A row per role and step of DCM trained in each checkpoint: the heads selected, their test accuracy and the
    floor (exact binomial 95% CI), and whether the selection found the property."""
    rows = []
    for s, rec in zip(steps, records):
        for x in rec["dcm"]:
            rows.append(
                {
                    "group": x["group"],
                    "desideratum": x["desideratum"],
                    "step": s,
                    "n_heads": len(x["heads"]),
                    "n_selected": len(x["selected"]),
                    "selected": " ".join(x["selected"]) or "-",
                    **{
                        f"test_accuracy{k}": x["test_accuracy"][v]
                        for k, v in (("", "value"), ("_low", "low"), ("_high", "high"))
                    },
                    **{f"floor{k}": x["floor"][v] for k, v in (("", "value"), ("_low", "low"), ("_high", "high"))},
                    "found": found(x),
                }
            )
    return rows
