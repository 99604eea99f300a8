"""What is reported of a circuit scored by mean ablation (`mechdiff.circuits.scoring`): faithfulness with its bootstrap
interval and its random baseline (circuits of the same sizes, layers and positions), completeness (Wang et al. 2022)
and the rows of the circuit x model matrix.
"""

from __future__ import annotations

import random
from typing import Optional, Sequence

import numpy as np

from ..common import inference as inf
from ..common.components import Head, all_heads, layer_matched
from ..common.metrics import faithfulness_key
from ..common.outcomes import bits
from ..common.progress import progress_bar
from ..common.stats import bootstrap, bootstrap_ratio, mean_estimate
from ..patching.evaluate import EvalResult
from ..tasks.base import GroupKey, Record, group_key
from .circuit import Circuit
from .scoring import EVERY_POSITION, Metric, Pair, Scorer, per_prompt

RANDOM_MATCH = ("layer", "all")  # the first is the default


def random_circuit(
    circuit: Circuit, n_layers: int, n_heads: int, rng: random.Random, match: str = RANDOM_MATCH[0]
) -> Circuit:
    """A circuit with the same per-group sizes and positions. ``match="layer"``: each head is replaced
    by a head of the same layer (same position), so the draw keeps the circuit's depth profile;
    ``"all"``: heads drawn from all heads of the model."""
    if match not in RANDOM_MATCH:
        raise ValueError(f"match must be one of {RANDOM_MATCH}, got {match!r}")
    if match == "all":
        pool = all_heads(n_layers, n_heads)
        groups = {g: sorted(rng.sample(pool, len(hs))) for g, hs in circuit.groups.items()}
    else:
        groups = {g: layer_matched(hs, n_heads, rng) for g, hs in circuit.groups.items()}
    return Circuit(
        circuit.model,
        circuit.task,
        groups,
        dict(circuit.positions),
        names=dict(circuit.names),
        meta={"random_baseline_of": circuit.model},
    )


def full_circuit(n_layers: int, n_heads: int, model: str = "", task: str = "") -> Circuit:
    """The whole model as a circuit: every head at every position (`EVERY_POSITION`), one group
    per layer (``"L0"``, ``"L1"``...). Its faithfulness is exactly 1 and its completeness exactly 0.
    It scores in memory; `Circuit.load` rejects the ``"*"`` position."""
    groups = {f"L{layer}": [Head(layer, h) for h in range(n_heads)] for layer in range(n_layers)}
    circuit = Circuit(model, task, groups, dict.fromkeys(groups, "last"), names={g: "" for g in groups})
    circuit.positions = dict.fromkeys(groups, EVERY_POSITION)
    return circuit


def control_prompts(records: Sequence[Record], n: int, seed: int) -> list[int]:
    """The prompts random circuits are scored on: every one where ``n`` is 0 or at least their number; else ``n``
    of them, stratified by group (template and token length: each group's share of ``n`` by largest remainder),
    drawn within each group by ``seed``; indices into ``records``, sorted."""
    if n <= 0 or n >= len(records):
        return list(range(len(records)))
    groups: dict[GroupKey, list[int]] = {}
    for i, r in enumerate(records):
        groups.setdefault(group_key(r), []).append(i)
    share = {g: n * len(ix) / len(records) for g, ix in groups.items()}
    quota = {g: int(q) for g, q in share.items()}
    order = sorted(groups, key=lambda g: quota[g] - share[g])  # largest remainder first; stable: first seen first
    for g in order[: n - sum(quota.values())]:
        quota[g] += 1
    rng = random.Random(seed)
    return sorted(i for g, ix in groups.items() for i in rng.sample(ix, quota[g]))


def faithfulness(
    scorer: Scorer,
    circuit: Circuit,
    n_random: int = 0,
    seed: int = 0,
    match: str = RANDOM_MATCH[0],
    random_prompts: Optional[Sequence[int]] = None,
    items: Optional[Sequence] = None,
) -> dict:
    """F(M), F(C), faithfulness F(C)/F(M) for accuracy and the scorer's continuous metric (answer probability,
    ``faithfulness_prob``; or the logit difference, ``logit_diff`` and ``faithfulness_logit_diff``), with CIs
    (exact binomial for accuracy, bootstrap for the rest and the ratios).

    With ``n_random > 0`` also ``n_random`` random circuits of the same group sizes (seeded, layer-matched by
    default), each scored on the prompts ``random_prompts`` (indices into the scorer's records; None: all):
    ``random`` holds their mean figures with intervals resampling draws and items both
    (`control_ratio`), each draw's accuracy (``draws``), each draw's per-prompt
    outcomes (``outcomes``, 0/1 strings over ``prompts``) and the circuit's rank among the draws on those prompts
    (``rank``: `control_rank` on accuracy; on the same prompts faithfulness has
    the same denominator, so the rank is the faithfulness rank too). ``items``: one item id per record (None: each
    prompt its own item).
    """
    shape = scorer.model.shape
    circuit.validate(shape.n_layers, shape.n_heads)
    full, circ, empty = scorer.full(), scorer.keep(circuit.pairs()), scorer.keep(())
    m = scorer.metric
    out = {"full": _figures(full, full, m), "circuit": _figures(circ, full, m), "n_prompts": len(scorer.records)}
    out["empty"] = _figures(empty, full, m)
    out["circuit"].update(normalised_figures(circ, full, empty, m))
    out["outcomes"] = {"full": full.outcomes(), "circuit": circ.outcomes(), "empty": empty.outcomes()}
    if n_random > 0:
        out["random"] = _random_control(scorer, circuit, full, circ, n_random, seed, match, random_prompts, items)
    return out


def normalised_figures(circ: EvalResult, full: EvalResult, empty: EvalResult, metric: str = "prob") -> dict:
    """Faithfulness with the empty circuit subtracted, (m(C) - m(empty)) / (m(M) - m(empty)) (MIB's normalised
    form; the paper's is m(C) / m(M)), for accuracy (``faithfulness_normalised``) and the task's continuous
    metric (``faithfulness_normalised_<metric>``), each with its bootstrap over prompts; NaN where the model is not
    shown above its empty circuit by the paired test (exact McNemar or sign-flip): the ratio is then undefined or
    a ratio of noise."""
    out = {}
    for name, key in (("accuracy", "faithfulness_normalised"), (metric, f"faithfulness_normalised_{metric}")):
        c, f, e = (per_prompt(r, name) for r in (circ, full, empty))
        beats = inf.paired(f, e)  # the model above its empty circuit, by its own paired test
        if beats.interval.value > 0 and beats.p <= inf.ALPHA:
            out[key] = inf.ratio(c - e, f - e).to_dict()
        else:
            out[key] = {"value": float("nan"), "low": float("nan"), "high": float("nan"), "n": int(c.size)}
    return out


def _random_control(
    scorer: Scorer,
    circuit: Circuit,
    full: EvalResult,
    circ: EvalResult,
    n_random: int,
    seed: int,
    match: str,
    prompts: Optional[Sequence[int]],
    items: Optional[Sequence],
) -> dict:
    """`faithfulness`'s ``random``: ``n_random`` random circuits on ``prompts``, against the circuit there."""
    n, shape = len(scorer.records), scorer.model.shape
    prompts = list(range(n)) if prompts is None else sorted(int(i) for i in prompts)
    if not prompts or len(set(prompts)) != len(prompts) or prompts[0] < 0 or prompts[-1] >= n:
        raise ValueError(f"random_prompts must be distinct indices into the {n} scored prompts")
    sub = scorer if len(prompts) == n else scorer.subset(prompts)
    on = None if items is None else [items[i] for i in prompts]
    rng = random.Random(seed)
    draws = [
        sub.keep(random_circuit(circuit, shape.n_layers, shape.n_heads, rng, match).pairs())
        for _ in progress_bar(range(n_random), desc="random circuits", disable=not scorer.progress, leave=False)
    ]
    full_on, circ_on = _rows(full, prompts), _rows(circ, prompts)
    rank = inf.control_rank(circ_on.correct.astype(float), [d.correct.astype(float) for d in draws], on, seed=seed)
    full_acc = float(full_on.correct.mean())
    return {
        **_random_figures(draws, full_on, scorer.metric, on, seed),
        "n_draws": n_random,
        "seed": seed,
        "match": match,
        "draws": [float(d.correct.mean()) for d in draws],
        "prompts": prompts,
        "outcomes": [bits(d.correct) for d in draws],
        "rank": {
            "rank": rank.rank,
            "n_draws": rank.n_draws,
            "p": rank.p,
            "circuit_accuracy": rank.value,
            "full_accuracy": full_acc,
            "q05": rank.quantiles[0],
            "q50": rank.quantiles[1],
            "q95": rank.quantiles[2],
            "draws": rank.draws.to_dict(detail=True),
            "n_prompts": len(prompts),
        },
    }


def _rows(result: EvalResult, rows: Sequence[int]) -> EvalResult:
    """``result`` on the prompts ``rows`` only."""

    def cut(a: Optional[np.ndarray]) -> Optional[np.ndarray]:
        return None if a is None else a[rows]

    return EvalResult(
        result.correct[rows], result.prob[rows], cut(result.logit_diff), cut(result.first), cut(result.rest)
    )


def _random_figures(draws: Sequence[EvalResult], full: EvalResult, metric: str, items, seed: int) -> dict:
    """The draws' mean accuracy, answer probability and faithfulness (and the continuous metric's), each with an
    interval resampling draws and items both (`control_ratio`)."""

    def stacked(name: str) -> np.ndarray:
        return np.stack([per_prompt(d, name) for d in draws])  # type: ignore[arg-type]

    def ratio(num: np.ndarray, den: Optional[np.ndarray] = None) -> dict:
        return inf.control_ratio(num, den, items, seed=seed).to_dict(detail=True)

    acc = stacked("accuracy")
    out = {
        "accuracy": ratio(acc),
        "answer_prob": ratio(stacked("prob")),
        "faithfulness": ratio(acc, per_prompt(full, "accuracy")),
    }
    if metric == "logit_diff":
        out["logit_diff"] = ratio(stacked(metric))
    out[faithfulness_key(metric)] = ratio(stacked(metric), per_prompt(full, metric))  # type: ignore[arg-type]
    return out


def _figures(result: EvalResult, full: EvalResult, metric: str = "prob") -> dict:
    """Accuracy, answer probability, faithfulness, and the continuous faithfulness of ``metric`` (and, for
    ``logit_diff``, the logit difference itself)."""
    acc, prob = per_prompt(result, "accuracy"), per_prompt(result, "prob")
    out = {
        "accuracy": mean_estimate(acc).to_dict(),
        "answer_prob": bootstrap(prob).to_dict(),
        "faithfulness": bootstrap_ratio(acc, per_prompt(full, "accuracy")).to_dict(),
    }
    if metric == "logit_diff":
        out["logit_diff"] = bootstrap(per_prompt(result, metric)).to_dict()
    out[faithfulness_key(metric)] = bootstrap_ratio(per_prompt(result, metric), per_prompt(full, metric)).to_dict()
    return out


# --------------------------------------------------------------------------------------
# Completeness
# --------------------------------------------------------------------------------------


def group_pairs(circuit: Circuit, group: str) -> list[Pair]:
    """The (head, position) pairs of one group."""
    return [(h, circuit.positions[group]) for h in circuit.groups[group]]


def completeness(
    scorer: Scorer,
    circuit: Circuit,
    n_draws: int = 5,
    p: float = 0.5,
    seed: int = 0,
    metric: Metric = "accuracy",
    groups: Optional[Sequence[str]] = None,
) -> dict:
    """|F(C \\ K) - F(M \\ K)| for random K (each pair kept in K with probability ``p``) and each whole group
    (``groups``: those groups only; default every group).

    Random K: mean, std and the per-draw values, with a bootstrap CI over the draws. Per group:
    the signed difference with a bootstrap CI over prompts, and its absolute value.
    """
    pairs = circuit.pairs()
    rng = random.Random(seed)
    diffs = []
    for _ in progress_bar(range(n_draws), desc="completeness draws", disable=not scorer.progress, leave=False):
        k = [pr for pr in pairs if rng.random() < p]
        diffs.append(abs(float(_difference(scorer, pairs, k, metric).mean())))
    out: dict = {"metric": metric, "p": p, "seed": seed, "n_prompts": len(scorer.records)}
    if diffs:
        out["random"] = {
            "mean": float(np.mean(diffs)),
            "std": float(np.std(diffs)),
            "draws": diffs,
            "ci": bootstrap(diffs).to_dict(),
        }
    out["groups"] = {}
    for g in circuit.groups if groups is None else groups:
        if not circuit.groups[g]:  # K empty: F(C) - F(M) says nothing about the group
            out["groups"][g] = {"completeness": None, "difference": None, "size": 0, "note": "n/a: the group is empty"}
            continue
        signed = bootstrap(_difference(scorer, pairs, group_pairs(circuit, g), metric))
        out["groups"][g] = {
            "completeness": abs(signed.value),
            "difference": signed.to_dict(),
            "size": len(circuit.groups[g]),
        }
    return out


def _difference(scorer: Scorer, pairs: Sequence[Pair], k: Sequence[Pair], metric: Metric) -> np.ndarray:
    """Per prompt, F(C \\ K) - F(M \\ K)."""
    without = [pr for pr in pairs if pr not in set(k)]
    return per_prompt(scorer.keep(without), metric) - per_prompt(scorer.ablate(k), metric)


# --------------------------------------------------------------------------------------
# Across models
# --------------------------------------------------------------------------------------


def matrix_rows(
    model_name: str,
    circuits: dict[str, Circuit],
    scorer: Scorer,
    n_random: int = 0,
    seed: int = 0,
    random_for: Optional[Sequence[str]] = None,
    outcomes: Optional[dict] = None,
    random_prompts: int = 0,
    items: Optional[Sequence] = None,
) -> list[dict]:
    """One row per circuit for one model: full and circuit accuracy, faithfulness (and the random
    baseline, for the circuits named in ``random_for``, default all), each as ``x``, ``x_low``, ``x_high``
    columns (see `mechdiff.report.tables`); ``draws``: each random draw's accuracy; ``random_rank``,
    ``random_p`` and ``random_q05/q50/q95``: the circuit's rank among the draws, its +1-corrected p and the draws'
    accuracy quantiles, on the ``random_prompts`` prompts the draws are scored on (`control_prompts`; 0:
    all). ``outcomes`` (a dict): filled with each circuit's per-prompt outcomes, full model and circuit, and for
    the circuits with random draws their per-draw outcomes (``random``: ``prompts`` and ``outcomes``)."""
    rows = []
    prompts = control_prompts(scorer.records, random_prompts, seed) if n_random > 0 and random_prompts else None
    for label, circuit in circuits.items():
        draws = n_random if random_for is None or label in random_for else 0
        res = faithfulness(scorer, circuit, n_random=draws, seed=seed, random_prompts=prompts, items=items)
        if outcomes is not None:
            outcomes[label] = res["outcomes"]
            if "random" in res:
                outcomes[label]["random"] = {"prompts": res["random"]["prompts"], "outcomes": res["random"]["outcomes"]}
        row = {
            "circuit": label,
            "model": model_name,
            "n_heads": len(circuit.heads()),
            "n_pairs": len(circuit.pairs()),
            "n_prompts": res["n_prompts"],
        }
        row.update(_cols("full_accuracy", res["full"]["accuracy"]))
        row.update(_cols("accuracy", res["circuit"]["accuracy"]))
        row.update(_cols("faithfulness", res["circuit"]["faithfulness"]))
        row.update(_cols("empty_accuracy", res["empty"]["accuracy"]))
        for key in (k for k in res["circuit"] if k.startswith("faithfulness_normalised")):
            row.update(_cols(key, res["circuit"][key]))
        row.update(_cols("answer_prob", res["circuit"]["answer_prob"]))
        if "logit_diff" in res["circuit"]:
            row.update(_cols("logit_diff", res["circuit"]["logit_diff"]))
        key = faithfulness_key(scorer.metric)
        row.update(_cols(key, res["circuit"][key]))
        if "random" in res:
            row.update(_random_cols(res["random"], key))
        rows.append(row)
    return rows


def _random_cols(random_res: dict, key: str) -> dict:
    """A matrix row's random-control columns: the draws' figures, their accuracies, and the circuit's rank."""
    rank = random_res["rank"]
    return {
        **_cols("random_accuracy", random_res["accuracy"]),
        **_cols("random_faithfulness", random_res["faithfulness"]),
        **_cols(f"random_{key}", random_res[key]),
        "random_draws": random_res["draws"],
        "random_n_prompts": rank["n_prompts"],
        "random_rank": rank["rank"],
        "random_p": rank["p"],
        "random_circuit_accuracy": rank["circuit_accuracy"],
        "random_q05": rank["q05"],
        "random_q50": rank["q50"],
        "random_q95": rank["q95"],
    }


def _cols(name: str, d: dict) -> dict:
    return {name: d["value"], f"{name}_low": d["low"], f"{name}_high": d["high"]}
