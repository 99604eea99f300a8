"""Minimality and pruning (Wang et al. 2022; Prakash et al. 2024): how much each (head, position) pair of a
circuit contributes, and the circuit without the pairs that contribute too little.

Two rules: ``"greedy"`` (mechdiff's default, `minimality`) grows K greedily per pair; ``"paper"``
(`pairwise_minimality`) is the paper's pairwise search within each group. Both score with a
`Scorer` (mean ablation, incremental runs); `prune` cuts a circuit by
either result.
"""

from __future__ import annotations

import math
import random
from typing import Iterable, Optional

from ..common.progress import progress_bar
from .circuit import Circuit
from .measures import group_pairs
from .scoring import Metric, Pair, Scorer, per_prompt


def pair_name(pair: Pair) -> str:
    """``"L14H7@last"``."""
    return f"{pair[0].name}@{pair[1]}"


ROUNDING = 1e-6  # a relative change this small is float rounding (an incremental run against a full one)


#: Pruning rules: ``"greedy"`` (mechdiff's default, `minimality`) and ``"paper"`` (`pairwise_minimality`).
PRUNE_RULES = ("greedy", "paper")
PAPER_SHARE = 0.3  # the paper's K: at most ceil(0.3 |group|) heads


def minimality(
    scorer: Scorer,
    circuit: Circuit,
    max_steps: int = 1,
    n_candidates: Optional[int] = 4,
    seed: int = 0,
    metric: Metric = "accuracy",
    threshold: Optional[float] = None,
) -> dict:
    """Per pair v, the contribution max_K |F(C \\ (K + v)) - F(C \\ K)| with K grown greedily (rule ``"greedy"``).

    mechdiff's rule, after Wang et al.'s minimality (not the paper's; that is `pairwise_minimality`):
    start from K = {}; each step tries adding one other circuit pair of any group (``n_candidates``
    drawn at random, or all with ``None``) and keeps the one that raises v's contribution most; stop
    after ``max_steps`` steps or when none raises it. Its cost is linear in the circuit's size, so it
    serves circuits of many (head, position class) pairs. ``relative`` is the contribution divided by the
    circuit's own performance F(C) (a pair stays if it moves the metric, in either direction, by more than
    a fraction of F(C)); ``relative_full`` divides by F(M). Results are cached across heads.

    ``threshold``: skip the greedy search for a pair whose relative contribution at K = {} already exceeds
    it. The search only ever raises a contribution, so pruning at that threshold decides the same; the
    skipped pairs' contributions are then lower bounds (``"searched": false``).

    Each F(C \\ K) is computed incrementally from F(C)'s run (`Scorer.keep_without`); a change of at
    most `ROUNDING` counts as none.
    """
    pairs = circuit.pairs()
    f_full = float(per_prompt(scorer.full(), metric).mean())
    f_circuit = float(per_prompt(scorer.keep(pairs), metric).mean())

    def f(removed: frozenset) -> float:  # incremental: only layers and positions from the removed pairs on
        return float(per_prompt(scorer.keep_without(pairs, removed), metric).mean())

    def contribution(v: Pair, k: frozenset) -> float:
        a, b = f(k | {v}), f(k)
        return abs(a - b) if abs(a - b) > ROUNDING * max(abs(a), abs(b)) else 0.0

    out = {}
    for v in progress_bar(pairs, desc="minimality", disable=not scorer.progress):
        k: frozenset = frozenset()
        best = contribution(v, k)
        settled = bool(threshold is not None and f_circuit and best / f_circuit > threshold)
        rng = random.Random(f"{seed}:{pair_name(v)}")  # per pair: skipping one search changes no other
        for _ in range(0 if settled else max_steps):
            others = [u for u in pairs if u != v and u not in k]
            if n_candidates is not None and len(others) > n_candidates:
                others = rng.sample(others, n_candidates)
            scored = [(contribution(v, k | {u}), u) for u in others]
            if not scored or max(scored, key=lambda t: t[0])[0] <= best:
                break
            value, u = max(scored, key=lambda t: t[0])
            best, k = value, k | {u}
        out[pair_name(v)] = {
            "contribution": best,
            "relative": best / f_circuit if f_circuit else float("nan"),
            "relative_full": best / f_full if f_full else float("nan"),
            "K": sorted(pair_name(u) for u in k),
            "searched": not settled,
        }
    return {
        "rule": "greedy",
        "metric": metric,
        "full": f_full,
        "circuit": f_circuit,
        "relative_to": "F(C)",
        "threshold": threshold,
        "max_steps": max_steps,
        "n_candidates": n_candidates,
        "seed": seed,
        "n_prompts": len(scorer.records),
        "pairs": out,
    }


def paper_ratio(before: float, after: float) -> float:
    """The paper's minimality score of v: F(C \\ K) / F(C \\ (K + v)) - 1 (signed: negative when removing v
    helps). ``after = 0``: +inf when ``before > 0`` (removing v destroys what is left), 0 when both are 0."""
    if after == 0:
        return math.inf if before > 0 else 0.0
    return before / after - 1.0


def pairwise_minimality(
    scorer: Scorer, circuit: Circuit, metric: Metric = "accuracy", share: float = PAPER_SHARE, threshold: float = 0.01
) -> dict:
    """The paper's minimality (rule ``"paper"``; Prakash et al. 2024, Nix07/finetuning ``experiment_1/minimality.py``
    with ``pp_utils.compute_pair_drop_values`` and ``get_head_significance_score``), within each group:

    1. F(C \\ {u}) for every head u of the group and F(C \\ {u, v}) for every pair of its heads;
    2. for each v, the group's other heads u ranked by F(C \\ {u}) - F(C \\ {u, v}) (ties in circuit order);
       K = those of the top ceil(``share`` |group|) with a positive score;
    3. ``score`` = F(C \\ K) / F(C \\ (K + v)) - 1 (`paper_ratio`); v stays iff ``score >= threshold``.

    C is the whole circuit (every group), F the mean of ``metric`` over the scorer's prompts (the paper:
    accuracy on 100 prompts). The pairwise step costs |group|(|group| + 1)/2 evaluations per group, so it
    suits the A-D circuits of a few dozen heads per group. Each F(C \\ S) is computed incrementally from
    F(C)'s run (`Scorer.keep_without`)."""
    pairs = circuit.pairs()
    f_full = float(per_prompt(scorer.full(), metric).mean())
    f_circuit = float(per_prompt(scorer.keep(pairs), metric).mean())

    def f(removed: Iterable[Pair]) -> float:
        return float(per_prompt(scorer.keep_without(pairs, frozenset(removed)), metric).mean())

    out = {}
    for g in circuit.groups:
        members = group_pairs(circuit, g)
        alone = {u: f({u}) for u in members}
        size = math.ceil(share * len(members))
        for v in progress_bar(members, desc=f"minimality {g}", disable=not scorer.progress):
            ranked = sorted(((alone[u] - f({u, v}), u) for u in members if u != v), key=lambda t: -t[0])
            k = [u for score, u in ranked[:size] if score > 0]
            before, after = f(k), f([*k, v])
            score = paper_ratio(before, after)
            out[pair_name(v)] = {
                "group": g,
                "before": before,
                "after": after,
                "score": score,
                "kept": score >= threshold,
                "K": sorted(pair_name(u) for u in k),
                "ranking": [[pair_name(u), s] for s, u in ranked[:size]],
            }
    return {
        "rule": "paper",
        "metric": metric,
        "full": f_full,
        "circuit": f_circuit,
        "share": share,
        "threshold": threshold,
        "relative_to": "F(C \\ (K + v))",
        "n_prompts": len(scorer.records),
        "pairs": out,
    }


def disjoint_groups(circuit: Circuit) -> Circuit:
    """The circuit with each (head, position) pair in one group only: a head that several groups hold at the same
    position stays in the last of them (in the circuit's group order) and leaves the others. The paper removes the
    value fetchers that are also position transmitters from the value fetchers before pruning (A minus B; Prakash
    et al.'s ``pp_utils.get_circuit``), so no pair is scored in two groups. The removed pairs are recorded in the
    circuit's ``meta["disjoint"]``."""
    later: dict[tuple, str] = {}
    for g, heads in circuit.groups.items():
        for h in heads:
            later[(h, circuit.positions[g])] = g
    groups, removed = {}, []
    for g, heads in circuit.groups.items():
        groups[g] = [h for h in heads if later[(h, circuit.positions[g])] == g]
        removed += [f"{pair_name((h, circuit.positions[g]))} from {g}" for h in heads if h not in groups[g]]
    return Circuit(
        circuit.model,
        circuit.task,
        groups,
        dict(circuit.positions),
        scores=dict(circuit.scores),
        names=dict(circuit.names),
        meta={**circuit.meta, "disjoint": removed},
    )


def prune(circuit: Circuit, result: dict, threshold: float = 0.01) -> Circuit:
    """The circuit without the pairs that fail ``threshold``: under rule ``"greedy"`` (`minimality`) those
    whose relative contribution is at most it; under ``"paper"`` (`pairwise_minimality`) those whose
    score F(C \\ K) / F(C \\ (K + v)) - 1 is below it. The threshold and the minimality settings are recorded
    in the pruned circuit's ``meta``."""
    contributions = result["pairs"]
    paper = result.get("rule") == "paper"
    value = "score" if paper else "relative"
    groups, removed = {}, []
    for g, heads in circuit.groups.items():
        groups[g] = []
        for h in heads:
            name = pair_name((h, circuit.positions[g]))
            if name not in contributions:
                raise ValueError(f"no minimality score for {name}; score the same circuit before pruning")
            score = contributions[name][value]
            if (score >= threshold) if paper else (score > threshold):
                groups[g].append(h)
            else:
                removed.append(name)
    settings = ("share",) if paper else ("max_steps", "n_candidates", "seed")
    meta = {
        **circuit.meta,
        "pruned": {
            "rule": result.get("rule", "greedy"),
            "threshold": threshold,
            "relative_to": result.get("relative_to", "F(M)"),
            "metric": result["metric"],
            **{key: result[key] for key in settings},
            "n_prompts": result["n_prompts"],
            "removed": sorted(set(removed)),
            "sizes_before": circuit.sizes(),
        },
    }
    scores = {**circuit.scores, "minimality": {n: r[value] for n, r in contributions.items()}}
    return Circuit(
        circuit.model,
        circuit.task,
        groups,
        dict(circuit.positions),
        scores=scores,
        names=dict(circuit.names),
        meta=meta,
    )
