"""DCM's and CMAP's paired tests count items, not rows, where an imported task's pairs share items: the tests the
report writes (`semantic_rows`, `cmap_paired_rows`, the families' `encodes_family` and `cmap_family`) against a
sign-flip test enumerated here by hand over the items."""

from __future__ import annotations

import itertools
from types import SimpleNamespace

import numpy as np

from mechdiff.common import inference as inf
from mechdiff.methods.dcm import split_indices
from mechdiff.report.claims import cmap_family, encodes_family
from mechdiff.report.rows import cmap_items, cmap_paired_rows, semantic_rows

# 8 items of 4 rows each: the patched heads right on every row of items 0-5, the floor right on none, so the
# 32 rows look like 24 discordant pairs (exact McNemar p ~ 1e-7) where there are 6 discordant items
ITEMS = np.repeat(np.arange(8), 4)
PATCHED = (ITEMS < 6).astype(int)
FLOOR = np.zeros(32, dtype=int)


def bits(x: np.ndarray) -> str:
    return "".join(str(int(v)) for v in x)


def by_hand(diff: np.ndarray, items: np.ndarray) -> float:
    """The exact two-sided sign-flip p over items, every sign pattern enumerated."""
    sums = np.array([diff[items == i].sum() for i in np.unique(items)])
    sums = sums[sums != 0]
    stats = [abs(np.dot(s, sums)) for s in itertools.product((1, -1), repeat=sums.size)]
    return float(np.mean([t >= abs(sums.sum()) - 1e-12 for t in stats]))


def test_the_row_test_is_far_smaller_than_the_item_test():
    rows = inf.paired(PATCHED, FLOOR).p
    items = by_hand(PATCHED - FLOOR, ITEMS)
    assert items == 2 / 2**6 and rows < 1e-6  # why counting rows as items overstates


def test_semantic_rows_cluster_the_floor_and_random_tests_by_item():
    draws = [bits((np.arange(32) % 5 == k).astype(int)) for k in range(3)]
    record = {
        "group": "last",
        "desideratum": "swapped",
        "model": "m",
        "heads": ["L1H0"],
        "accuracy": {"value": PATCHED.mean(), "low": 0.5, "high": 0.9, "n": 32},
        "floor": {"value": 0.0, "low": 0.0, "high": 0.1, "n": 32},
        "outcomes": {"correct": bits(PATCHED)},
        "floor_outcomes": bits(FLOOR),
        "random_outcomes": draws,
        "vs_floor": {"estimate": 0.75, "low": 0.6, "high": 0.9, "p": 1e-7},  # the stage's row-level test
    }
    row = semantic_rows([record], {"last/swapped": ITEMS})[0]
    assert np.isclose(row["floor_p"], by_hand(PATCHED - FLOOR, ITEMS))
    random_mean = np.mean([[int(c) for c in d] for d in draws], axis=0)
    assert np.isclose(row["random_p"], by_hand(PATCHED - random_mean, ITEMS))
    assert semantic_rows([record])[0]["floor_p"] == 1e-7  # no items: the stage's own test, as before


def test_encodes_family_reads_the_test_items():
    row = {
        "group": "last",
        "desideratum": "swapped",
        "selected": ["L1H0"],
        "test_accuracy": {"value": PATCHED.mean(), "n": 32},
        "test_outcomes": {"correct": bits(PATCHED)},
        "floor_outcomes": bits(FLOOR),
    }
    clustered = encodes_family([{**row, "test_items": ITEMS}])[("last", "swapped", "floor")]
    assert np.isclose(clustered.p, by_hand(PATCHED - FLOOR, ITEMS)) and clustered.interval.n_items == 8
    assert encodes_family([row])[("last", "swapped", "floor")].p < 1e-6


def test_cmap_items_follow_the_random_controls_prompts():
    on = [1, 5, 9, 13, 17, 21, 25, 29]  # one prompt of each item
    result = {
        "outcomes": {"last/z": PATCHED.tolist(), "base": FLOOR.tolist(), "random:last/z": [0.5] * 8},
        "random_prompts": on,
        "rows": [{"scope": "last", "kind": "z"}],
    }
    assert cmap_items(result, "last/z", "base", ITEMS) == ITEMS.tolist()
    assert cmap_items(result, "last/z", "random:last/z", ITEMS) == ITEMS[on].tolist()
    assert cmap_items(result, "last/z", "base", None) is None
    table = {(r["first"], r["second"]): r["p"] for r in cmap_paired_rows(result, ITEMS)}
    assert np.isclose(table[("last/z", "base")], by_hand(PATCHED - FLOOR, ITEMS))
    assert np.isclose(table[("last/z", "random:last/z")], by_hand(PATCHED[on] - 0.5, ITEMS[on]))
    fam = cmap_family({"ft": SimpleNamespace(result=result)}, {"ft": ITEMS})
    assert np.isclose(fam[("ft", "last/z", "base")].p, by_hand(PATCHED - FLOOR, ITEMS))
    assert cmap_family({"ft": SimpleNamespace(result=result)})[("ft", "last/z", "base")].p < 1e-6


def test_the_reconstructed_test_split_is_the_stages():
    """`dcm_test_items` splits the set's item ids again with the record's split and seed; the integer ids give
    the split the stage made from the task's own item keys (strings), since only which rows share an item counts."""
    keys = [f"prompt {i}" for i in ITEMS]
    stage = split_indices(32, [0.25, 0.125, 0.625], 3, keys)[2]
    again = split_indices(32, [0.25, 0.125, 0.625], 3, ITEMS.tolist())[2]
    assert stage == again and len({keys[i] for i in stage} & {keys[i] for i in range(32) if i not in stage}) == 0


def test_the_accuracy_table_counts_items_where_rows_share_them():
    from scipy.stats import binomtest

    from mechdiff.studies.circuits.report.accuracy import _accuracy_over_items

    stage = {"accuracy": {"value": 0.75, "low": 0.6, "high": 0.86, "n": 32}, "answer_prob": {}}
    result = {**stage, "outcomes": {"correct": bits(PATCHED), "prob": list(PATCHED * 0.5 + 0.2)}}
    got = _accuracy_over_items(result, ITEMS)["accuracy"]
    exact = binomtest(6, 8).proportion_ci()  # 6 of 8 items right, each item's rows alike
    assert got["items"] == 8 and got["low"] <= exact.low + 1e-12 and got["high"] >= exact.high - 1e-12
    assert _accuracy_over_items(result, None)["accuracy"] == stage["accuracy"]  # one row an item: the stage's


def test_dcm_arms_are_shown_over_the_test_pairs_items():
    from mechdiff.runs.stages import StageRecord
    from mechdiff.studies.circuits.report.dcm import _dcm_over_items, dcm_test_items

    ids = np.repeat(np.arange(12), 4)  # the dcm set: 48 pairs in 12 items
    split, seed = [0.25, 0.125, 0.625], 1
    test = split_indices(48, split, seed, ids.tolist())[2]
    patched = (ids[test] % 3 != 0).astype(int)  # right on the pairs of two items in three
    est = {"value": patched.mean(), "low": 0.0, "high": 1.0, "n": len(test)}
    floor = np.zeros(len(test), dtype=int)
    row = {"group": "last", "desideratum": "swapped", "selected": ["L1H0"], "test_accuracy": est, "config": {}}
    row.update(n_train=48 - len(test) - len(split_indices(48, split, seed, ids.tolist())[1]))
    row.update(n_val=len(split_indices(48, split, seed, ids.tolist())[1]), n_test=len(test))
    row["config"] = {"split": split, "seed": seed}
    sem = {
        "group": "last",
        "desideratum": "swapped",
        "model": "base",
        "heads": ["L1H0"],
        "accuracy": est,
        "floor": {**est, "value": 0.0},
        "outcomes": {"correct": bits(patched)},
        "floor_outcomes": bits(floor),
    }
    study = SimpleNamespace(task=SimpleNamespace(items=list(range(48))), set_items=lambda name: ids)
    dcm = StageRecord("dcm", "k", {"dcm": [row], "semantic": [sem]}, 0.0, True)
    assert np.array_equal(dcm_test_items(study, dcm)["last/swapped"], ids[test])
    shown = _dcm_over_items(study, dcm, "base").result
    want = inf.proportion(patched, ids[test])
    got = shown["dcm"][0]["test_accuracy"]
    assert (got["low"], got["high"], got["items"]) == (want.low, want.high, len(set(ids[test].tolist())))
    assert shown["semantic"][0]["accuracy"]["items"] == got["items"]


def test_normalised_faithfulness_over_items_reads_the_metrics_outcomes():
    from mechdiff.studies.circuits.report.matrix import _normalised_over_items

    rng = np.random.default_rng(0)
    full, empty = rng.normal(5, 1, 32), rng.normal(1, 1, 32)
    circ = empty + 0.8 * (full - empty)
    kept = {
        "full": {"correct": bits(np.ones(32)), "logit_diff": full.tolist()},
        "circuit": {"correct": bits(PATCHED), "logit_diff": circ.tolist()},
        "empty": {"correct": bits(FLOOR), "logit_diff": empty.tolist()},
    }
    row = {"faithfulness_normalised": 0.75, "faithfulness_normalised_logit_diff": 0.8}
    got = _normalised_over_items(row, kept, ITEMS)
    by_hand = (circ.mean() - empty.mean()) / (full.mean() - empty.mean())
    assert np.isclose(got["faithfulness_normalised_logit_diff"], by_hand)
    assert np.isclose(got["faithfulness_normalised"], 0.75)  # accuracy: 24 of 32 kept, none in the empty circuit
    assert got["faithfulness_normalised_logit_diff_low"] <= by_hand <= got["faithfulness_normalised_logit_diff_high"]
    undefined = _normalised_over_items({"faithfulness_normalised_logit_diff": float("nan")}, kept, ITEMS)
    assert undefined == {}  # the stage's NaN (the model not above its empty circuit) stays undefined
