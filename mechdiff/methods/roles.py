"""Roles, not head ids: which heads hold each role (a desideratum of the task) at every checkpoint of a trajectory,
and which heads take a role over from which.

A head's score for a desideratum (:func:`head_scores`) is single-head semantic patching, the cheap and exact form
of DCM's question: the head's output (z) at its group's position is patched from each pair's counterfactual
(source) prompt into the base run, every other head left alone, and the score is the **share of pairs whose
patched run gives the desideratum's target** (top-1), with its exact binomial (Clopper-Pearson) interval. A
share, not the mean gain in the target's log-probability: it is DCM's own test measure (the target accuracy its
selections are judged by), it is bounded, so one threshold means the same at every checkpoint however sharp the
checkpoint's logits are, and its interval is exact at any number of pairs. DCM trains a mask over all the
group's heads at once and keeps the fewest that move the run; this scores each head alone, so a role that needs
several heads together shows in none of them (a departure from DCM, stated in the report).

A head **holds** a role at a step when its share's lower bound exceeds a threshold (:data:`THRESHOLD`, the task
file's ``[roles] threshold``; :func:`held`). A head **takes a role over** at the first step from which it holds
the role at every later checkpoint (:func:`holding_since`), where that step is not the first; the heads that held
the role before that step and no longer hold it at the last step are the ones it took it from
(:func:`takeovers`).
"""

from __future__ import annotations

from typing import Any, Optional, Sequence

import numpy as np

from ..common.components import Head
from ..common.inference import proportion
from ..common.outcomes import outcome_record

#: A head holds a role where the lower bound of its share of pairs moved to the target exceeds this: with 95%
#: confidence, patching it alone gives the desideratum's target on more than a tenth of the pairs.
THRESHOLD = 0.1
CONFIDENCE = 0.95

#: One group of a circuit whose heads are scored: (group, position class, heads).
Site = tuple[str, str, Sequence[Head]]


def head_scores(
    lm: Any, sites: Sequence[Site], pairs: dict[str, Sequence], batch_size: int = 32, progress: bool = False
) -> dict:
    """Every head of every site scored on every desideratum's ``pairs`` in ``lm`` (see the module docstring):
    ``{"rows": [{group, position, desideratum, head, share (exact binomial), outcomes}], "floor": {desideratum:
    {share, outcomes}}}``, the outcomes in the compact format (:func:`~mechdiff.common.outcomes.outcome_record`).
    One :class:`~mechdiff.methods.dcm.PairCache` per desideratum serves every head: two forward passes a pair,
    then one suffix run a pair per head."""
    from .dcm import PairCache

    sites = [(g, p, list(hs)) for g, p, hs in sites if hs]
    rows, floor = [], {}
    for desideratum, these in pairs.items():
        if not these:
            raise ValueError(f"desideratum {desideratum!r} has no pairs to score heads on")
        cache = PairCache.build(lm, these, [(hs, p) for _, p, hs in sites], batch_size, progress)
        try:
            floor[desideratum] = {"share": proportion(cache.floor).to_dict(), "outcomes": outcome_record(cache.floor)}
            for group, position, heads in sites:
                for h in heads:
                    acc = cache.accuracy(lm, range(len(these)), [h], position, batch_size)
                    rows.append(
                        {
                            "group": group,
                            "position": position,
                            "desideratum": desideratum,
                            "head": h.name,
                            "share": proportion(acc, confidence=CONFIDENCE).to_dict(),
                            "outcomes": outcome_record(acc),
                        }
                    )
        finally:
            cache.close()
    return {"rows": rows, "floor": floor}


def held(low: np.ndarray | Sequence[Sequence[float]], threshold: float = THRESHOLD) -> np.ndarray:
    """``"head step"`` lower bounds -> whether each head holds the role at each step (bound above ``threshold``;
    a step not measured, nan, holds nothing)."""
    arr = np.asarray(low, dtype=float)
    if arr.ndim != 2:
        raise ValueError(f"lower bounds must be 'head step', got shape {arr.shape}")
    with np.errstate(invalid="ignore"):
        return np.nan_to_num(arr, nan=-np.inf) > threshold


def holding_since(row: np.ndarray | Sequence[bool]) -> Optional[int]:
    """The index of the first step from which ``row`` (one head's membership per step) is True at every later
    step; None where it is False at the last step."""
    r = np.asarray(row, dtype=bool)
    if r.size == 0 or not r[-1]:
        return None
    lost = np.flatnonzero(~r)
    return int(lost[-1]) + 1 if lost.size else 0


def takeovers(membership: np.ndarray, heads: Sequence[str], steps: Sequence[int]) -> list[dict]:
    """Every head holding the role at the last step (``membership``: ``"head step"``, :func:`held`): ``since``,
    the step from which it holds it at every later checkpoint; ``takes_over``, whether that is not the first step;
    ``held_before``, the other heads holding the role at some step before it; ``lost``, those of them not holding
    it at the last step. Ordered by ``since``, then by the heads' order."""
    m = np.asarray(membership, dtype=bool)
    if m.shape != (len(heads), len(steps)):
        raise ValueError(f"membership of shape {m.shape} is not heads x steps ({len(heads)} x {len(steps)})")
    out = []
    for i, h in enumerate(heads):
        since = holding_since(m[i])
        if since is None:
            continue
        before = [heads[j] for j in range(len(heads)) if j != i and m[j, :since].any()]
        out.append(
            {
                "head": h,
                "since": steps[since],
                "takes_over": since > 0,
                "held_before": before,
                "lost": [b for b in before if not m[heads.index(b), -1]],
            }
        )
    return sorted(out, key=lambda r: steps.index(r["since"]))
