"""Roles, not head ids: which heads hold each role (a desideratum of the task) at every checkpoint of a trajectory,
and which heads join, leave or take over a role between steps (`transitions`). Two ways to say who holds it.

**Single heads** (``[roles] method = "heads"``, `head_scores`): single-head semantic patching, the cheap and
exact form of DCM's question: the head's output (z) at its group's position is patched from each pair's
counterfactual (source) prompt into the base run, every other head left alone, and the score is the **share of
pairs whose patched run gives the desideratum's target** (top-1), with its exact binomial (Clopper-Pearson)
interval. A share, not the mean gain in the target's log-probability: it is DCM's own test measure, bounded, and
its interval is exact at any number of pairs. A head **holds** a role at a step when its share's lower bound
exceeds a threshold (`THRESHOLD`, ``[roles] threshold``; `held`). Each head alone, so a role that
needs several heads together shows in none of them (a departure from DCM, stated in the report).

**DCM over seeds** (``[roles] method = "dcm"``, `dcm_seeds`; the paper's method): in each checkpoint, DCM's
mask is trained over every candidate head of a group (the heads any checkpoint's own circuit has there) with one
absolute sparsity weight, the same at every step (``lam_scale = "absolute"``: a weight scaled by each checkpoint's
own logits would select more heads where the logits are larger, whatever the heads do), ``seeds`` times: seed 0
on DCM's own training/validation split, seed ``k`` on the same pairs redrawn by ``seed + k`` (`redraw`),
each with its own training order; the test pairs are the same for every seed and held out from all. A head's
**selection frequency** is the number of seeds whose mask selects it (`frequency`); the group's selection
at the step is the heads selected in at least ``votes`` seeds. That selection is patched on the test pairs and
its per-pair outcomes kept beside the unpatched floor's and those of ``n_random`` layer-matched random head sets
(each selected head replaced by a random head of its own layer, `random_heads`). The
report decides: the group holds the role at the step where the paired test against the floor and the one against
the random heads both reject after Holm in the "roles" family (`encodes_family`,
the circuits study's test); the heads holding it are then its selection.
"""

from __future__ import annotations

import random
from dataclasses import replace
from typing import Any, Sequence

import numpy as np

from ..common.components import Head
from ..common.inference import proportion
from ..common.outcomes import bits, outcome_record

#: A head holds a role where the lower bound of its share of pairs moved to the target exceeds this: with 95%
#: confidence, patching it alone gives the desideratum's target on more than a tenth of the pairs.
THRESHOLD = 0.1
CONFIDENCE = 0.95
#: DCM trainings per checkpoint (``[roles] seeds``), and the seeds that must select a head for the group's selection
#: (``[roles] votes``): a head in at least 2 of 3 masks, so that one seed's churn does not make a head join or leave.
SEEDS = 3
VOTES = 2

#: One group of a circuit whose heads are scored: (group, position class, heads).
Site = tuple[str, str, Sequence[Head]]


def head_scores(
    lm: Any, sites: Sequence[Site], pairs: dict[str, Sequence], batch_size: int = 32, progress: bool = False
) -> dict:
    """Every head of every site scored on every desideratum's ``pairs`` in ``lm`` (see the module docstring):
    ``{"rows": [{group, position, desideratum, head, share (exact binomial), outcomes}], "floor": {desideratum:
    {share, outcomes}}}``, the outcomes in the compact format (`outcome_record`).
    One `PairCache` per desideratum serves every head: two forward passes a pair,
    then one suffix run a pair per head."""
    from .dcm_cache import PairCache

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


def transitions(membership: np.ndarray, heads: Sequence[str], steps: Sequence[int]) -> list[dict]:
    """What happens to one role between consecutive steps (``membership``: ``"head step"``, whether each head holds
    the role at each step): a head that holds it at a step and did not at the step before **joins**; one that held
    it and does not **leaves**; a head that joins at a step where another head leaves the same role **takes it
    over** from those heads. A head that joins where no head leaves (nothing held before it, or the others stay)
    joins and takes nothing over. One row per event: ``{step, head, event, others}``, ``others`` the heads that
    leave (for "takes over") or the heads that take over from it (for "leaves"); in step order, joins and
    takeovers before leaves, heads in the given order."""
    m = np.asarray(membership, dtype=bool)
    if m.shape != (len(heads), len(steps)):
        raise ValueError(f"membership of shape {m.shape} is not heads x steps ({len(heads)} x {len(steps)})")
    rows = []
    for j in range(1, len(steps)):
        joined = [h for i, h in enumerate(heads) if m[i, j] and not m[i, j - 1]]
        left = [h for i, h in enumerate(heads) if m[i, j - 1] and not m[i, j]]
        event = "takes over" if left else "joins"
        rows += [{"step": steps[j], "head": h, "event": event, "others": left} for h in joined]
        rows += [{"step": steps[j], "head": h, "event": "leaves", "others": joined} for h in left]
    return rows


# --- roles by DCM over seeds ---------------------------------------------------------------------------------------


def redraw(rows: Sequence[int], n_train: int, seed: int, items: Sequence) -> tuple[list[int], list[int]]:
    """``rows`` (DCM's training and validation pairs) in a seeded order, whole items (``items[row]``) into
    training until it holds ``n_train`` rows, the rest validation (never empty: the last item stays there)."""
    order = list(rows)
    random.Random(seed).shuffle(order)
    by_item: dict = {}
    for r in order:
        by_item.setdefault(items[r], []).append(r)
    groups = list(by_item.values())
    if len(groups) < 2:
        raise ValueError(f"redrawing DCM's training and validation pairs needs at least 2 items, got {len(groups)}")
    train: list[int] = []
    for k, g in enumerate(groups[:-1]):
        if len(train) >= n_train:
            return train, [r for g2 in groups[k:] for r in g2]
        train += g
    return train, groups[-1]


def frequency(selections: Sequence[Sequence[str]], heads: Sequence[str]) -> list[int]:
    """How many of the seeds' ``selections`` hold each of ``heads``."""
    return [sum(h in set(s) for s in selections) for h in heads]


def dcm_seeds(
    lm: Any,
    sites: Sequence[Site],
    pairs: dict[str, Sequence],
    config: Any,
    seeds: int = SEEDS,
    votes: int = VOTES,
    progress: bool = False,
) -> list[dict]:
    """DCM (`dcm`, ``config`` its training) over every site's heads, on every desideratum's
    ``pairs`` in ``lm``, trained ``seeds`` times; one row per (site, desideratum), see the module docstring. The
    sparsity weight must be absolute (``config.lam_scale == "absolute"``): one weight at every checkpoint."""
    from .dcm import pair_items, split_indices
    from .dcm_cache import PairCache

    if config.lam_scale != "absolute":
        raise ValueError(
            f"roles compare DCM selections across checkpoints: give one sparsity weight at every step "
            f"(lam_scale='absolute'), not lam_scale={config.lam_scale!r}, a weight scaled by each checkpoint's logits"
        )
    if not 1 <= votes <= seeds:
        raise ValueError(f"a head selected in {votes} of {seeds} seeds: votes must lie in 1..seeds")
    sites = [(g, p, list(hs)) for g, p, hs in sites if hs]
    rows = []
    for desideratum, these in pairs.items():
        items = pair_items(these)
        train, val, test = split_indices(len(these), config.split, config.seed, items)
        draws = [(train, val)] + [redraw(train + val, len(train), config.seed + k, items) for k in range(1, seeds)]
        cache = PairCache.build(lm, these, [(hs, p) for _, p, hs in sites], config.eval_batch, progress)
        try:
            for group, position, heads in sites:
                rows.append(_seeded_role(lm, cache, group, position, heads, desideratum, draws, test, config, votes))
        finally:
            cache.close()
    return rows


def _seeded_role(
    lm: Any,
    cache: Any,
    group: str,
    position: str,
    heads: list[Head],
    desideratum: str,
    draws: list[tuple[list[int], list[int]]],
    test: list[int],
    config: Any,
    votes: int,
) -> dict:
    """One (site, desideratum): a mask trained per seed, the heads selected in at least ``votes`` seeds, and
    their per-pair outcomes on the test pairs beside the floor's and layer-matched random heads'."""
    from .dcm import random_heads, train_mask

    seeds = []
    for k, (train, val) in enumerate(draws):
        values, best, _ = train_mask(lm, heads, position, cache, train, val, replace(config, seed=config.seed + k))
        chosen = [h.name for h, m in zip(heads, values.tolist()) if m < 0.5]
        mask = [round(float(m), 4) for m in values.tolist()]
        seeds.append(
            {"seed": config.seed + k, "selected": chosen, "mask": mask, "best_step": best, "n_train": len(train)}
        )
    names = [h.name for h in heads]
    counts = frequency([s["selected"] for s in seeds], names)
    selected = [h for h, c in zip(heads, counts) if c >= votes]
    acc = cache.accuracy(lm, test, selected, position, config.eval_batch)
    floor = cache.floor[test]
    drawn = random_heads(lm, heads, selected, replace(config, random_pool="layer"), config.n_random, config.seed + 1)
    randoms = [cache.accuracy(lm, test, hs, position, config.eval_batch) for hs in drawn]
    return {
        "group": group,
        "desideratum": desideratum,
        "position": position,
        "heads": names,
        "lam": config.lam,
        "seeds": seeds,
        "frequency": counts,
        "votes": votes,
        "selected": [h.name for h in selected],
        "n_test": len(test),
        "test_accuracy": proportion(acc, confidence=CONFIDENCE).to_dict(),
        "floor": proportion(floor, confidence=CONFIDENCE).to_dict(),
        "test_outcomes": bits(acc),
        "floor_outcomes": bits(floor),
        "random_heads": [[h.name for h in hs] for hs in drawn],
        "random_outcomes": [bits(o) for o in randoms],
    }
