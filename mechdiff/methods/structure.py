"""Structure against function along a trajectory (`mechdiff.methods.trajectory`): the within-checkpoint null of a
circuit's top pairs (two discoveries of one model on disjoint halves of the ranking prompts), the spread-corrected
overlap of two checkpoints with its interval and decision, the structure record the tables are written from, and the
compact store of the attributions behind it.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Mapping, Optional, Sequence

import numpy as np
import torch

from ..circuits.curve import selection_stability
from ..circuits.pruning import pair_name
from ..common.inference import ALPHA, cluster_resamples, jackknife, recentred
from ..runs.seeds import derive

#: A pair is robustly in a checkpoint's top-n where its bootstrap selection frequency is at least this, robustly
#: out where it is at most ``1 - STABLE``; only a move from one to the other is a change of the pair.
STABLE = 0.95
#: Random disjoint splits of the structural comparison, and bootstrap resamples of the selection frequencies.
STRUCTURE_DRAWS = 200
#: Resamples of the ranking prompts behind each structure interval, and random splits of each resample into halves.
STRUCTURE_RESAMPLES = 1000
RESAMPLE_SPLITS = 5
#: Equivalence margin (Jaccard): "no change" between two checkpoints is written only where the 90% interval of
#: (null - cross overlap) lies inside (-MARGIN, MARGIN); neither that nor a change: "not shown".
MARGIN = 0.05
#: Accuracies at which runs of one recipe are compared, each run at its first step read at or above it.
MATCHED_LEVELS = (0.5, 0.8)


def splits(n: int, draws: int, seed: int) -> list[tuple[np.ndarray, np.ndarray]]:
    """``draws`` random splits of ``range(n)`` into two disjoint halves (sizes ``n // 2`` and ``n - n // 2``),
    each a fresh seeded permutation: no prompt is drawn twice, inside a half or across the two (the halves
    `half_weights` gives the sample itself with the same seed)."""
    _check_split(n, draws)
    perm = _orders(draws, n, seed)
    return [(np.sort(p[: n // 2]), np.sort(p[n // 2 :])) for p in perm]


def _orders(rows: int, n: int, seed: int) -> np.ndarray:
    """A fresh random order of ``range(n)`` per row, seeded."""
    return np.argsort(np.random.default_rng(seed).random((rows, n)), axis=1)


def _check_split(n: int, draws: int) -> None:
    if n < 4:
        raise ValueError(f"the within-checkpoint null needs at least 4 ranking prompts, got {n}")
    if draws < 1:
        raise ValueError(f"the within-checkpoint null needs at least one split, got {draws}")


def half_weights(counts: np.ndarray, draws: int, seed: int) -> tuple[np.ndarray, np.ndarray]:
    """``draws`` random splits of each resample (a row of item counts, `cluster_resamples`) into two
    halves, as weights ``(resample * draw, item)``: the items in a fresh random order, half A those whose copies
    fit in the first ``n // 2`` draws, half B the rest, so every copy of a prompt lies in one half and the halves
    share none. A row of ones is the sample itself: its halves are those of `splits` with the same seed."""
    counts = np.atleast_2d(np.asarray(counts, dtype=float))
    n_res, n = counts.shape
    _check_split(n, draws)
    order = _orders(n_res * draws, n, seed)
    drawn = np.take_along_axis(np.repeat(counts, draws, axis=0), order, axis=1)
    in_a = np.cumsum(drawn, axis=1) <= n // 2
    wa, wb = np.zeros(order.shape), np.zeros(order.shape)
    np.put_along_axis(wa, order, np.where(in_a, drawn, 0.0), axis=1)
    np.put_along_axis(wb, order, np.where(in_a, 0.0, drawn), axis=1)
    return wa, wb


def top_pairs(attribution: np.ndarray, rows: np.ndarray, n: int) -> frozenset[int]:
    """The ``n`` pairs (flat ``class layer head`` indices) of largest |mean attribution| over ``rows``
    (as `selection_stability` selects)."""
    mean = attribution.reshape(attribution.shape[0], -1)[rows].astype(np.float64).mean(0)
    return frozenset(np.flatnonzero(_top_n(np.abs(mean)[None], n)[0]).tolist())


def jaccard(a: frozenset, b: frozenset) -> float:
    """|a & b| / |a | b| (1 for two empty sets)."""
    return len(a & b) / len(a | b) if a | b else 1.0


def top_masks(flat: np.ndarray, weights: np.ndarray, n: int) -> np.ndarray:
    """Per weight row, the top ``n`` pairs by |weighted sum of the prompts' attribution| (the top-n of the
    weighted mean) as a bit mask ``(row, pair)``."""
    return _top_n(np.abs(weights @ flat), n)


def _top_n(h: np.ndarray, n: int) -> np.ndarray:
    """Per row of ``h``, a mask of its ``n`` largest values, ties at the n-th value broken by the lower index: the
    selection depends on the values alone. (``argpartition`` breaks ties by the other values of the row, so a row
    whose unselected values were zeroed, as the committed store keeps them, could select another of two equal
    float16 sums.)"""
    kth = _nth_largest(h, n)
    above = h > kth
    tied = h == kth
    need = n - np.count_nonzero(above, axis=1, keepdims=True)
    mask = above | tied
    over = np.flatnonzero(np.count_nonzero(tied, axis=1) > need[:, 0])  # rows with more ties than places
    if over.size:
        mask[over] = above[over] | (tied[over] & (np.cumsum(tied[over], axis=1) <= need[over]))
    return mask


def _nth_largest(h: np.ndarray, n: int, rows: int = 64) -> np.ndarray:
    """Per row of ``h``, its ``n``-th largest value ``(row, 1)``, exactly; partitioning, ``rows`` rows at a time,
    only the columns that can hold it (`_narrowed`). Three times faster than partitioning every column on the
    structure stage's shapes; the same values."""
    if h.shape[0] < 2 or 4 * n >= h.shape[1]:  # no rows to share a bound, or too few columns to leave out
        return _partitioned(h, n)
    return np.vstack([_partitioned(_narrowed(h[lo : lo + rows], n), n) for lo in range(0, h.shape[0], rows)])


def _partitioned(x: np.ndarray, n: int) -> np.ndarray:
    """Per row of ``x``, its ``n``-th largest value ``(row, 1)`` by a partition of every column."""
    last = x.shape[1] - n  # the n-th largest is the (size - n)-th smallest: no negated copies
    return np.partition(x, last, axis=1)[:, last : last + 1]


def _narrowed(x: np.ndarray, n: int) -> np.ndarray:
    """The columns of ``x`` that can hold a row's ``n``-th largest, or ``x`` itself where they are half or more of
    them or a value is NaN (a partition takes NaN above every number). A row's n-th largest within any ``n`` or
    more of its columns is at most its own, so every value at or above its own lies at or above that bound: the
    n-th largest over the columns where some row reaches its bound is each row's own. The bound's columns: the
    ``n + n // 2`` of largest sum over the rows (rows drawn from one checkpoint rank its pairs alike, so few other
    columns reach it)."""
    width, many = x.shape[1], n + n // 2
    top = np.argpartition(x.sum(0), width - many)[width - many :]
    bound = _partitioned(x[:, top], n)
    cols = np.flatnonzero((x >= bound).any(0))
    return x[:, cols] if cols.size < width // 2 and not np.isnan(x).any() else x


def _overlap(a: np.ndarray, b: np.ndarray, n: int) -> np.ndarray:
    """Row by row Jaccard of two top-n masks (both of size ``n``)."""
    inter = np.count_nonzero(a & b, axis=1).astype(float)
    return inter / (2 * n - inter)


#: Rows (splits) of top-n masks held at once.
CHUNK = 500


@dataclass
class _Overlaps:
    """Per split (row), the null of every checkpoint and the cross overlap of every pair asked for; ``kept``: per
    checkpoint, every pair some row selected."""

    null: dict[str, np.ndarray]
    cross: dict[tuple[str, str], np.ndarray]
    kept: dict[str, np.ndarray]

    def between(self, runs: Sequence[str]) -> np.ndarray:
        """Per row, the mean cross overlap of every two of ``runs`` (one step of several runs of one recipe)."""
        return np.mean([self.cross[(s, t)] for i, s in enumerate(runs) for t in runs[i + 1 :]], axis=0)


def overlaps(
    attribution: Mapping[str, np.ndarray], wa: np.ndarray, wb: np.ndarray, n: int, pairs: Sequence[tuple[str, str]]
) -> _Overlaps:
    """The overlaps of `_Overlaps` on the halves ``wa``/``wb`` (`half_weights`): a checkpoint's null is
    the Jaccard of its top-n on half A and on half B; the cross overlap of ``(s, t)`` is that of ``s`` on one half
    and ``t`` on the other, both ways, averaged."""
    flat = {c: a.reshape(a.shape[0], -1).astype(np.float64) for c, a in attribution.items()}
    null: dict[str, list] = {c: [] for c in flat}
    cross: dict[tuple[str, str], list] = {p: [] for p in pairs}
    kept = {c: np.zeros(x.shape[1], dtype=bool) for c, x in flat.items()}
    for lo in range(0, wa.shape[0], CHUNK):
        a = {c: top_masks(x, wa[lo : lo + CHUNK], n) for c, x in flat.items()}
        b = {c: top_masks(x, wb[lo : lo + CHUNK], n) for c, x in flat.items()}
        for c in flat:
            null[c].append(_overlap(a[c], b[c], n))
            kept[c] |= a[c].any(0) | b[c].any(0)
        for s, t in pairs:
            cross[(s, t)].append((_overlap(a[s], b[t], n) + _overlap(a[t], b[s], n)) / 2)
    return _Overlaps(
        {c: np.concatenate(v) for c, v in null.items()}, {p: np.concatenate(v) for p, v in cross.items()}, kept
    )


def spread(values: Sequence[float], confidence: float = 0.95) -> dict:
    """The mean over splits with the percentile range of the splits' values (a spread of one sample's splits,
    not an interval over prompts)."""
    arr = np.asarray(values, dtype=float)
    alpha = (1 - confidence) / 2
    low, high = np.quantile(arr, [alpha, 1 - alpha])
    return {"value": float(arr.mean()), "low": float(low), "high": float(high), "n": int(arr.size)}


def estimate(split_values: np.ndarray, resampled: np.ndarray, n_prompts: int, confidence: float = 0.95) -> dict:
    """An overlap (or difference of overlaps): the mean over the sample's splits, its interval over prompts (the
    statistic recomputed on each resample of the prompts, halves drawn inside it: `recentred`), the 90%
    interval an equivalence test reads, and the spread of the sample's splits (``spread_low``/``spread_high``)."""
    sp = spread(split_values, confidence)
    value = sp["value"]
    low, high = recentred(resampled, value, confidence)
    low90, high90 = recentred(resampled, value, 1 - 2 * ALPHA)
    return {
        "value": value,
        "low": low,
        "high": high,
        "n": sp["n"],
        "prompts": n_prompts,
        "resamples": int(np.size(resampled)),
        "low90": low90,
        "high90": high90,
        "spread_low": sp["low"],
        "spread_high": sp["high"],
    }


def decided(diff: dict, margin: float) -> dict:
    """What a difference of overlaps shows: ``changed`` where its interval over prompts lies above 0; ``same``
    where its 90% interval lies inside (-margin, margin) (two one-sided tests at 0.05: no change beyond the margin
    shown); neither: not shown."""
    return {"changed": diff["low"] > 0, "same": -margin < diff["low90"] and diff["high90"] < margin}


def structure(
    attribution: dict[str, np.ndarray],
    classes: Sequence[str],
    n: int,
    draws: int = STRUCTURE_DRAWS,
    seed: int = 0,
    stable: float = STABLE,
    runs: Optional[Mapping[str, Mapping[str, np.ndarray]]] = None,
    resamples: int = STRUCTURE_RESAMPLES,
    resample_splits: int = RESAMPLE_SPLITS,
    margin: float = MARGIN,
    matched: Optional[Mapping[str, Sequence[str]]] = None,
) -> dict:
    """The within-checkpoint null and the structural changes between checkpoints (module docstring).

    ``attribution``: checkpoint (in order) -> per-prompt attribution ``"prompt class layer head"`` on the same
    ranking prompts; ``n``: the number of pairs each discovery keeps. Each of ``draws`` splits cuts the ranking
    prompts into two disjoint random halves (`splits`); every overlap is the mean over splits. Its interval
    resamples the prompts: ``resamples`` cluster resamples (`cluster_resamples`), each cut ``resample_splits``
    times into halves that keep every copy of a prompt together (`half_weights`), the statistic the mean
    over those; `estimate` gives it with the splits' own spread beside it. Returns per checkpoint the null
    overlap and the selection frequency of every pair ever robustly in; per consecutive pair of checkpoints and
    per checkpoint against the final one the cross overlap, the difference ``(null_s + null_t) / 2 - cross`` with
    ``changed`` and ``same`` (`decided`, equivalence within ``margin``); the pairs that changed between
    consecutive checkpoints (robustly in at one, out at the other); the matrix of mean overlaps of every two
    checkpoints (the null on its diagonal, no interval); and ``kept``: per checkpoint, the flat pairs any top-n
    of the stage selected (a split, a resample's half, a selection-frequency resample), all a recomputation needs.

    ``runs``: the between-run null, checkpoint -> {a checkpoint of another run of the same recipe at the same step ->
    its attribution on the same prompts}. Each such step gets the mean cross overlap of every two runs (the
    ``between_runs`` rows); a consecutive change into such a step, and each checkpoint against the final one where
    the final step has other runs, get ``beyond_runs``: (between-run overlap - cross), decided as above (the two
    checkpoints differ more than two runs of the recipe do at that step, or as little within the margin). Each
    ``between_runs`` row (and each ``matched`` row: a label -> one checkpoint of each run, e.g. each run's first step
    at an accuracy, rows of ``matched_runs``) also tests "within a run minus between runs" split by split
    (`_between`)."""
    names = list(attribution)
    runs = {c: dict(r) for c, r in (runs or {}).items() if r}
    unknown = [c for c in runs if c not in attribution]
    if unknown:
        raise ValueError(f"other runs given at {unknown}, which are not checkpoints of the trajectory")
    every = {**attribution, **{o: a for r in runs.values() for o, a in r.items()}}
    n_prompts = {a.shape[0] for a in every.values()}
    if len(n_prompts) != 1:
        raise ValueError(f"every checkpoint must be ranked on the same prompts; got prompt counts {n_prompts}")
    k = n_prompts.pop()
    groups = {c: [c, *r] for c, r in runs.items()}
    matched = {label: list(g) for label, g in (matched or {}).items() if len(g) >= 2}
    stray = sorted({c for g in matched.values() for c in g} - set(every))
    if stray:
        raise ValueError(f"matched runs name {stray}, which are neither checkpoints nor other runs' checkpoints")
    wanted = list(zip(names, names[1:])) + [(c, names[-1]) for c in names[:-1]]
    wanted += [(s, t) for g in [*groups.values(), *matched.values()] for i, s in enumerate(g) for t in g[i + 1 :]]
    wanted = list(dict.fromkeys(wanted))
    matrix_pairs = [(s, t) for i, s in enumerate(names) for t in names[i + 1 :]]
    point = overlaps(every, *half_weights(np.ones((1, k)), draws, seed), n, list(dict.fromkeys(wanted + matrix_pairs)))
    counts = cluster_resamples(k, resamples, derive(seed, "structure-resamples"))
    boot = overlaps(every, *half_weights(counts, resample_splits, derive(seed, "structure-halves")), n, wanted)

    def est(stat: Any) -> dict:
        return estimate(stat(point), stat(boot).reshape(resamples, resample_splits).mean(1), k)

    freq = {
        c: selection_stability(torch.from_numpy(a.astype(np.float64)), classes, n, draws, seed)
        for c, a in attribution.items()
    }
    steps = []
    for s, t in zip(names, names[1:]):
        entered = sorted(pair_name(p) for p, f in freq[t].items() if f >= stable and freq[s][p] <= 1 - stable)
        left = sorted(pair_name(p) for p, f in freq[s].items() if f >= stable and freq[t][p] <= 1 - stable)
        beyond = _beyond(est, groups, s, t, t if t in groups else s, margin)
        steps.append({"from": s, "to": t, **_against(est, s, t, margin), **beyond, "entered": entered, "left": left})
    final = [
        {
            "checkpoint": c,
            **_against(est, c, names[-1], margin),
            **_beyond(est, groups, c, names[-1], names[-1], margin),
        }
        for c in names[:-1]
    ]
    robust = sorted(
        {p for f in freq.values() for p, v in f.items() if v >= stable}, key=lambda p: (p[1], p[0].layer, p[0].head)
    )
    return {
        "n_pairs": n,
        "draws": draws,
        "seed": seed,
        "stable": stable,
        "prompts": k,
        "resamples": resamples,
        "resample_splits": resample_splits,
        "margin": margin,
        "interval": INTERVAL,
        "null": {c: est(lambda o, c=c: o.null[c]) for c in names},
        "consecutive": steps,
        "against_final": final,
        "matrix": {"checkpoints": names, "overlap": _matrix(point, names)},
        "between_runs": [{"checkpoint": c, **_between(est, point, g, margin)} for c, g in groups.items()],
        "matched_runs": [{"level": label, **_between(est, point, g, margin)} for label, g in matched.items()],
        "frequency": {c: {pair_name(p): freq[c][p] for p in robust} for c in names},
        "kept": _kept(point, boot, freq, classes, every),
    }


#: How the structure intervals are made, as the stage record states it.
INTERVAL = (
    "cluster bootstrap over the ranking prompts: the overlap recomputed on each resample (mean over its random "
    "halves, each prompt's copies in one half), percentile interval re-centred on the estimate"
)


def _cross(o: _Overlaps, s: str, t: str) -> np.ndarray:
    return o.cross[(s, t)] if (s, t) in o.cross else o.cross[(t, s)]


def _against(est: Any, s: str, t: str, margin: float) -> dict:
    """Cross overlap of ``s`` and ``t`` and the difference ``(null_s + null_t) / 2 - cross`` (per split, paired:
    the same split for both), decided by its interval over prompts (`decided`)."""
    diff = est(lambda o: (o.null[s] + o.null[t]) / 2 - _cross(o, s, t))
    return {"cross": est(lambda o: _cross(o, s, t)), "null_minus_cross": diff, **decided(diff, margin)}


def _beyond(est: Any, groups: Mapping[str, list[str]], s: str, t: str, at: str, margin: float) -> dict:
    """``beyond_runs`` of checkpoints ``s`` and ``t`` against the between-run overlap at ``at`` (``{}`` where ``at``
    has no other run): (between - cross) per split, decided by its interval over prompts."""
    if at not in groups:
        return {}
    diff = est(lambda o: o.between(groups[at]) - _cross(o, s, t))
    return {"beyond_runs": {"at": at, "runs_minus_cross": diff, **decided(diff, margin)}}


def _between(est: Any, point: _Overlaps, g: Sequence[str], margin: float) -> dict:
    """One checkpoint of each of several runs of a recipe (``g``): their mean overlap on opposite halves
    (``overlap``), their mean null (``null``) and "within a run minus between runs" (``null_minus_between``: the
    runs' mean null less their mean cross overlap, paired by split), decided over prompts (`decided`: ``changed``,
    the runs differ beyond what one run's halves differ by; ``same``, within the margin). Those intervals hold the
    runs fixed; ``over_runs`` treats them as a sample of seeds: the leave-one-run-out jackknife of the same two
    statistics on the splits' means (`jackknife`, t on runs - 1 degrees of freedom; none for two runs), and each
    run's own null less its mean cross overlap with the others (``per_run``)."""
    g = list(g)

    def null(o: _Overlaps, runs: Sequence[str]) -> np.ndarray:
        return np.mean([o.null[r] for r in runs], axis=0)

    diff = est(lambda o: null(o, g) - o.between(g))
    per_run = {
        r: float(np.mean(point.null[r] - np.mean([_cross(point, r, x) for x in g if x != r], axis=0))) for r in g
    }
    return {
        "runs": g,
        "overlap": est(lambda o: o.between(g)),
        "null": est(lambda o: null(o, g)),
        "null_minus_between": diff,
        **decided(diff, margin),
        "over_runs": {
            "null_minus_between": jackknife(lambda rs: float(np.mean(null(point, rs) - point.between(rs))), g),
            "overlap": jackknife(lambda rs: float(np.mean(point.between(rs))), g),
            "per_run": per_run,
        },
    }


def _matrix(point: _Overlaps, names: Sequence[str]) -> list[list[float]]:
    """Mean overlap over splits of every two checkpoints on opposite halves; the diagonal is the null."""
    return [[float(np.mean(point.null[s] if s == t else _cross(point, s, t))) for t in names] for s in names]


def _kept(point: _Overlaps, boot: _Overlaps, freq: Mapping, classes: Sequence[str], every: Mapping) -> dict:
    """Per checkpoint, the flat pairs some top-n of the stage selected: a split's, a resample's half's, or (those
    with a frequency above 0) a selection-frequency resample's."""
    out = {}
    for c, a in every.items():
        keep = point.kept[c] | boot.kept[c]
        if c in freq:
            _, n_layers, n_heads = a.shape[1:]
            for (head, cls), f in freq[c].items():
                if f > 0:
                    keep[(classes.index(cls) * n_layers + head.layer) * n_heads + head.head] = True
        out[c] = np.flatnonzero(keep).tolist()
    return out


def structure_record(
    attribution: Mapping[str, np.ndarray],
    names: Sequence[str],
    runs: Mapping[str, Sequence[str]],
    classes: Sequence[str],
    n_pairs: int,
    ranking_n: int,
    settings: Mapping[str, Any],
    seed: int,
    dense: Optional[Mapping[str, np.ndarray]] = None,
    matched: Optional[Mapping[str, Sequence[str]]] = None,
) -> dict:
    """The structure stage's record: `structure` of the trajectory's checkpoints ``names`` (with the other
    runs ``runs``: checkpoint -> other runs' checkpoints at its step) on the first ``ranking_n`` prompts, which every
    checkpoint has; and, where the steps read by the between-run null have more (``runs_n``), the same at those steps
    alone on all they share (``dense``). ``settings``: ``[structure]`` (draws, stable, resamples, resample_splits,
    margin). ``dense``: the attributions that second comparison reads, where they are not ``attribution`` (the
    store keeps the two apart: `read_attributions`). ``matched``: a label -> one checkpoint of each run (the runs
    compared at a matched accuracy, `matched_runs`), compared in both."""
    keys = ("draws", "stable", "resamples", "resample_splits", "margin")
    opts = dict(zip(keys, (settings[k] for k in keys)))
    dense = dense or attribution

    def run(source: Mapping[str, np.ndarray], mine: Sequence[str], rows: int) -> dict:
        other = {c: {o: source[o][:rows] for o in os} for c, os in runs.items()}
        cut = {c: source[c][:rows] for c in mine}
        return structure(
            cut, classes, n_pairs, opts["draws"], seed, opts["stable"], other, *list(opts.values())[2:], matched=matched
        )

    out = run(attribution, names, ranking_n)
    read = [c for c in names if c in runs]
    rows = min((dense[c].shape[0] for c in [*read, *(o for os in runs.values() for o in os)]), default=0)
    if rows > ranking_n:
        out["dense"] = run(dense, read, rows)
    return out


def committed_structure(run_dir: str | Path) -> dict:
    """A trajectory run's structure record recomputed from its committed ``attributions.h5`` alone
    (`read_attributions`, the settings in its meta): what the structure stage recorded."""
    store = read_attributions(Path(run_dir) / ATTRIBUTIONS)
    meta = store.meta
    return structure_record(
        store.attribution,
        list(meta["steps"]),
        meta["runs"],
        store.classes,
        meta["n_pairs"],
        meta["ranking_n"],
        meta["structure"],
        meta["seed"],
        store.dense,
        matched=meta.get("matched"),
    )


# --------------------------------------------------------------------------------------
# The attributions behind the structure tables, compact
# --------------------------------------------------------------------------------------

#: The committed per-prompt attributions of a trajectory run (float16, gzip), beside its tables.
ATTRIBUTIONS = "attributions.h5"
#: Bytes the committed attributions of both trajectories may take together (#51 item 3).
ATTRIBUTIONS_BOUND = 20_000_000


def attributions_over_bound(results: str | Path, bound: int = ATTRIBUTIONS_BOUND) -> Optional[str]:
    """Where the `ATTRIBUTIONS` stores of every study under ``results`` (each trajectory's directory) take more
    than ``bound`` bytes together, what they take, each named; else None."""
    stores = sorted(Path(results).glob(f"*/{ATTRIBUTIONS}"))
    sizes = {p.parent.name: p.stat().st_size for p in stores}
    if sum(sizes.values()) <= bound:
        return None
    each = ", ".join(f"{name} {size / 1e6:.1f} MB" for name, size in sizes.items())
    total = sum(sizes.values()) / 1e6
    return f"the attributions under {results} take {total:.1f} MB ({each}), more than {bound / 1e6:.0f} MB"


def to_half(a: np.ndarray) -> np.ndarray:
    """An attribution as the store keeps it (float16), back in float64: what the structure stage computes on, so
    the tables recompute exactly from the store."""
    return np.asarray(a, dtype=np.float16).astype(np.float64)


def store_layout(record: Mapping[str, Any]) -> dict[str, dict[str, Any]]:
    """What the store keeps of each checkpoint, read off the structure stage's ``record``: the first
    ``record["prompts"]`` rows (the comparison of every checkpoint) at ``pairs``, the pairs some top-n of either
    comparison selected there; where the checkpoint is in the comparison of the steps read on their own prompts
    (``record["dense"]``), its rows up to ``dense_rows`` at ``dense_pairs``, the pairs some top-n of that
    comparison selected. No other value enters a top-n the tables count (`write_attributions`)."""
    dense = record.get("dense", {})
    out = {}
    for c, kept in record["kept"].items():
        inner = dense.get("kept", {}).get(c)
        pairs = sorted(set(kept) | set(inner or ()))
        out[c] = {"rows": record["prompts"], "pairs": pairs}
        if inner is not None:
            out[c] |= {"dense_rows": dense["prompts"], "dense_pairs": sorted(inner)}
    return out


def write_attributions(
    path: str | Path,
    attribution: Mapping[str, np.ndarray],
    record: Mapping[str, Any],
    classes: Sequence[str],
    meta: Mapping[str, Any],
) -> Path:
    """The per-prompt attributions (``"prompt class layer head"``) behind the structure stage's ``record``,
    float16, gzip with byte shuffling, at `store_layout`: each checkpoint's rows on the prompts every checkpoint
    shares at the pairs some top-n there selected, and the further rows of the steps read on their own prompts
    only at the pairs some top-n of that comparison selected (far fewer: more prompts, less noise at the top-n's
    edge). Every other value is left out: it reads back as 0 (`read_attributions`), so its weighted sum over any
    half is 0, no larger than that of a pair the top-n took there, and every top-n, and so every table, is the same
    (an exact tie at 0 aside). ``meta`` (the structure settings) as JSON in the attributes."""
    import h5py

    layout = store_layout(record)
    held = {
        c: (attribution[c].shape[0] if c in attribution else 0, lay.get("dense_rows", lay["rows"]))
        for c, lay in layout.items()
    }
    short = {c: rows for c, rows in held.items() if rows[0] < rows[1]}
    if short:
        raise ValueError(
            f"the structure record reads more prompts than the attributions given hold (checkpoint: (held, read)): "
            f"{short}; pass the attributions the structure stage computed on"
        )
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(".tmp.h5")
    with h5py.File(tmp, "w") as f:
        f.attrs["classes"] = json.dumps(list(classes))
        f.attrs["meta"] = json.dumps(dict(meta))
        f.attrs["order"] = json.dumps(list(record["kept"]))
        for i, (c, lay) in enumerate(layout.items()):
            flat = np.asarray(attribution[c], dtype=np.float16).reshape(attribution[c].shape[0], -1)
            g = f.create_group(f"c{i}")
            g.attrs["checkpoint"] = c
            g.attrs["pair_shape"] = list(attribution[c].shape[1:])
            _block(g, "", flat[: lay["rows"]], lay["pairs"])
            if "dense_rows" in lay:
                _block(g, "dense_", flat[lay["rows"] : lay["dense_rows"]], lay["dense_pairs"])
    tmp.replace(path)
    return path


def _block(g: Any, prefix: str, rows: np.ndarray, pairs: Sequence[int]) -> None:
    cols = np.asarray(pairs, dtype=np.int32)
    g.create_dataset(f"{prefix}pairs", data=cols, compression="gzip", shuffle=True)
    g.create_dataset(f"{prefix}attribution", data=rows[:, cols], compression="gzip", compression_opts=9, shuffle=True)


@dataclass
class StoredAttributions:
    """The store `write_attributions` wrote, float64, every value left out at 0: ``attribution``, each checkpoint
    on the prompts every checkpoint shares (what the comparison of all checkpoints reads); ``dense``, the steps
    read on their own prompts (what their comparison reads); the classes and the meta."""

    attribution: dict[str, np.ndarray]
    dense: dict[str, np.ndarray]
    classes: list[str]
    meta: dict


def read_attributions(path: str | Path) -> StoredAttributions:
    """The store `write_attributions` wrote (`StoredAttributions`)."""
    import h5py

    main, dense = {}, {}
    with h5py.File(path, "r") as f:
        classes, meta = json.loads(f.attrs["classes"]), json.loads(f.attrs["meta"])
        for i, _ in enumerate(json.loads(f.attrs["order"])):
            g = f[f"c{i}"]
            c, shape = str(g.attrs["checkpoint"]), [int(x) for x in g.attrs["pair_shape"]]
            pairs, head = g["pairs"][()], g["attribution"][()].astype(np.float64)
            main[c] = _spread(head, pairs, shape)
            if "dense_pairs" in g:
                inner = g["dense_pairs"][()]
                rest = g["dense_attribution"][()].astype(np.float64)
                dense[c] = _spread(np.vstack([head[:, np.searchsorted(pairs, inner)], rest]), inner, shape)
    return StoredAttributions(main, dense, classes, meta)


def _spread(values: np.ndarray, pairs: np.ndarray, shape: Sequence[int]) -> np.ndarray:
    """``values`` (``prompt stored-pair``) back at their flat ``pairs``, 0 elsewhere: ``"prompt class layer head"``."""
    full = np.zeros((values.shape[0], int(np.prod(shape))), dtype=np.float64)
    full[:, pairs] = values
    return full.reshape(values.shape[0], *shape)
