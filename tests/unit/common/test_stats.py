"""Intervals fit for their quantity, and the paper's scoring rules (exact binomial CIs, paired
differences, layer-matched random circuits, pruning relative to F(C), DCM's tie-break and lambda scale)."""

from __future__ import annotations

import random

import numpy as np
import pytest
import torch
from scipy import stats as sps

from mechdiff.circuits.circuit import Circuit
from mechdiff.circuits.scoring import (Scorer, completeness, faithfulness, minimality, per_prompt, prune,
                                       random_circuit)
from mechdiff.common.components import Head
from mechdiff.methods.dcm import DCMConfig, PairCache, loss_scale, train_mask
from mechdiff.patching.core import run
from mechdiff.common.stats import paired_difference, pooled_proportion, proportion
from mechdiff.tasks.entity_tracking import generate, object_value_pairs, pair_batch_tensors, reference_records

N_BOXES = 3


def clopper_pearson(k: int, n: int, confidence: float = 0.95) -> tuple[float, float]:
    """The textbook Beta-quantile form, independent of scipy's binomtest."""
    a = (1 - confidence) / 2
    low = 0.0 if k == 0 else sps.beta.ppf(a, k, n - k + 1)
    high = 1.0 if k == n else sps.beta.ppf(1 - a, k + 1, n - k)
    return low, high


@pytest.mark.parametrize("k,n", [(0, 40), (3, 40), (20, 40), (40, 40), (1, 1)])
def test_proportion_is_clopper_pearson(k, n):
    est = proportion([1.0] * k + [0.0] * (n - k))
    low, high = clopper_pearson(k, n)
    assert est.value == k / n and est.n == n
    # float64 on both sides (scipy's beta quantiles), not a float32 result
    assert est.low == pytest.approx(low, abs=1e-9) and est.high == pytest.approx(high, abs=1e-9)


def test_zero_successes_do_not_collapse():
    est = proportion(np.zeros(40))
    assert est.low == 0.0 and 0.08 < est.high < 0.1  # 0/40: the upper bound is about 0.088


def test_proportion_refuses_non_binary_and_empty():
    with pytest.raises(ValueError, match="0/1 outcomes"):
        proportion([0.5, 1.0])
    with pytest.raises(ValueError, match="at least one"):
        proportion([])


def test_paired_difference_uses_the_pairing():
    rng = np.random.default_rng(0)
    base = rng.normal(size=200)
    a, b = base + 0.1, base  # a constant shift: unpaired CIs overlap, the paired one is a point
    d = paired_difference(a, b)
    assert d.value == pytest.approx(0.1) and d.low == pytest.approx(0.1) and d.high == pytest.approx(0.1)
    noisy = paired_difference(base + 0.1 + rng.normal(scale=0.05, size=200), base)
    assert 0.08 < noisy.low < 0.1 < noisy.high < 0.12
    with pytest.raises(ValueError, match="same prompts"):
        paired_difference([1, 2], [1, 2, 3])


def test_pooled_proportion_counts_the_spread_between_draws():
    """Draws that either all work or all fail: averaged per prompt first, every prompt scores the same
    and a bootstrap over prompts would give a point; resampling the draws shows the uncertainty."""
    draws = np.array([[1.0] * 50] * 6 + [[0.0] * 50] * 14)  # 6 of 20 random circuits work
    est = pooled_proportion(draws)
    assert est.value == pytest.approx(0.3) and est.n == 50
    assert est.low < 0.15 and est.high > 0.45
    same = pooled_proportion(np.tile(np.r_[np.ones(15), np.zeros(35)], (20, 1)))
    assert same.value == pytest.approx(0.3) and (same.high - same.low) < (est.high - est.low)


def test_random_circuit_is_layer_matched():
    circuit = Circuit("t", "et", {"A": [Head(5, 1), Head(5, 2), Head(9, 0)], "B": [Head(2, 3)]},
                      {"A": "last", "B": "query_label"})
    rng = random.Random(0)
    draws = [random_circuit(circuit, 12, 8, rng) for _ in range(30)]
    for d in draws:
        assert [h.layer for h in d.groups["A"]] == [5, 5, 9] and [h.layer for h in d.groups["B"]] == [2]
        assert len(set(d.groups["A"])) == 3 and d.positions == circuit.positions
    assert len({tuple(d.groups["A"]) for d in draws}) > 5  # not the same heads every time
    anywhere = [random_circuit(circuit, 12, 8, rng, match="all") for _ in range(30)]
    assert any({h.layer for h in d.groups["A"]} - {5, 9} for d in anywhere)
    with pytest.raises(ValueError, match="match must be"):
        random_circuit(circuit, 12, 8, rng, match="group")


@pytest.fixture
def scorer(tiny_llama, smollm2_tokenizer) -> Scorer:
    records = generate(smollm2_tokenizer, 6, n_boxes=N_BOXES, seed=0)
    return Scorer.build(tiny_llama, records, reference_records(smollm2_tokenizer, 6, N_BOXES, 1), 6, False)


def test_random_baseline_lists_its_draws(scorer):
    circuit = Circuit("t", "et", {"A": [Head(2, 0), Head(1, 1)]}, {"A": "last"})
    res = faithfulness(scorer, circuit, n_random=4, seed=0)
    rnd = res["random"]
    assert rnd["match"] == "layer" and len(rnd["draws"]) == 4
    assert rnd["accuracy"]["value"] == pytest.approx(np.mean(rnd["draws"]))


def test_pruning_is_relative_to_the_circuits_own_performance(scorer):
    circuit = Circuit("t", "et", {"A": [Head(2, 0), Head(1, 0), Head(1, 3)]}, {"A": "last"})
    res = minimality(scorer, circuit, max_steps=1, n_candidates=None, metric="prob")
    f_c = float(per_prompt(scorer.keep(circuit.pairs()), "prob").mean())
    f_m = float(per_prompt(scorer.full(), "prob").mean())
    assert res["relative_to"] == "F(C)" and res["circuit"] == pytest.approx(f_c)
    for r in res["pairs"].values():
        assert r["relative"] == pytest.approx(r["contribution"] / f_c)
        assert r["relative_full"] == pytest.approx(r["contribution"] / f_m)
    # a threshold between two heads' relative contributions keeps exactly the heads above it
    rel = sorted(r["relative"] for r in res["pairs"].values())
    cut = (rel[0] + rel[1]) / 2
    pruned = prune(circuit, res, threshold=cut)
    assert len(pruned.heads()) == 2 and pruned.meta["pruned"]["relative_to"] == "F(C)"


def test_completeness_is_not_defined_for_an_empty_group(scorer):
    circuit = Circuit("t", "et", {"A": [Head(2, 0)], "D": []}, {"A": "last", "D": "query_label"})
    comp = completeness(scorer, circuit, n_draws=1, metric="prob")
    assert comp["groups"]["D"]["completeness"] is None and comp["groups"]["D"]["size"] == 0
    assert comp["groups"]["A"]["completeness"] is not None


@pytest.fixture
def pair_cache(tiny_llama, smollm2_tokenizer):
    pairs = object_value_pairs(smollm2_tokenizer, 12, n_boxes=N_BOXES, seed=0)
    heads = [Head(2, h) for h in range(4)]
    return tiny_llama, heads, pairs, PairCache.build(tiny_llama, pairs, [(heads, "last")], 12, False)


def test_lambda_scale_is_the_unpatched_target_logit(pair_cache):
    model, heads, pairs, cache = pair_cache
    batch = pair_batch_tensors(pairs[:4])
    with torch.no_grad():
        logits = run(model, batch["base"]["input_ids"]).logits
    expected = logits.gather(1, batch["target_ids"][:, None]).abs().mean().item()
    config = DCMConfig(micro_batch=4)
    assert loss_scale(model, heads, "last", cache, [0, 1, 2, 3], config) == pytest.approx(expected, rel=1e-5)
    assert loss_scale(model, heads, "last", cache, [0, 1], DCMConfig(lam_scale="absolute")) == 1.0
    with pytest.raises(ValueError, match="lam_scale"):
        DCMConfig(lam_scale="relative")


def test_validation_ties_go_to_the_larger_head_set(pair_cache, monkeypatch):
    """With every validation accuracy equal, the best step is the one that patches the most heads."""
    model, heads, pairs, cache = pair_cache
    monkeypatch.setattr(PairCache, "accuracy", lambda self, *a, **k: np.ones(3))
    config = DCMConfig(epochs=4, batch_size=4, eval_every=1, lam=0.0, lr=0.5, seed=0)
    values, best_step, history = train_mask(model, heads, "last", cache, list(range(8)), [8, 9, 10], config,
                                            progress=False)
    most = max(h["n_selected"] for h in history)
    assert most > 0  # the target-logit gradient opened some heads during training
    chosen = next(h for h in history if h["step"] == best_step)
    assert chosen["n_selected"] == most
    assert int((values < 0.5).sum()) == most


def test_position_classes_partition_every_prompt(smollm2_tokenizer):
    from mechdiff.tasks.entity_tracking.positions import CLASSES, position_classes

    records = generate(smollm2_tokenizer, 8, n_boxes=4, seed=2)
    masks = position_classes(records, len(records[0].input_ids))
    assert set(masks) == set(CLASSES)
    assert torch.equal(sum(m.int() for m in masks.values()), torch.ones(8, len(records[0].input_ids), dtype=torch.int))
    for row, r in enumerate(records):
        assert masks["query_object"][row].nonzero()[:, 0].tolist() == [r.positions["objects"][r.query_index]]
        assert masks["query_label_context"][row].nonzero()[:, 0].tolist() == [r.positions["query_label_context"]]
        assert masks["last"][row].nonzero()[:, 0].tolist() == [r.positions["last"]]


def test_position_scan_ends_at_the_full_model_and_classes_equal_named_positions(scorer):
    from mechdiff.circuits.positions import every_head_at, position_scan
    from mechdiff.tasks.entity_tracking.positions import CLASSES

    shape = scorer.model.shape
    # a class holding one named position is that position
    by_class = per_prompt(scorer.keep(every_head_at(shape.n_layers, shape.n_heads, ["last", "query_label"])), "prob")
    from mechdiff.common.components import all_heads
    named = [(h, p) for p in ("last", "query_label") for h in all_heads(shape.n_layers, shape.n_heads)]
    assert np.array_equal(by_class, per_prompt(scorer.keep(named), "prob"))
    res = position_scan(scorer, CLASSES, metric="prob")
    last = res["steps"][-1]
    assert sorted(last["classes"]) == sorted(CLASSES)
    assert last["faithfulness_prob"]["value"] == pytest.approx(1.0)  # every class kept: the model itself
    values = [s["candidates"][s["added"]] for s in res["steps"]]
    assert all(s["candidates"][s["added"]] == max(s["candidates"].values()) for s in res["steps"])
    assert len(values) == len(CLASSES)
    short = position_scan(scorer, CLASSES, metric="prob", max_steps=2)
    assert [s["added"] for s in short["steps"]] == [s["added"] for s in res["steps"][:2]]


def test_report_states_an_ordering_only_when_the_paired_interval_excludes_zero():
    from mechdiff.report.study_report import _ordering

    clear = {"outcomes": {"circuit/v": [1] * 30 + [0] * 10, "circuit/qk": [1] * 20 + [0] * 20}}
    assert "the first is larger" in _ordering(clear, "circuit/v", "circuit/qk")
    assert "the second is larger" in _ordering(clear, "circuit/qk", "circuit/v")
    close = {"outcomes": {"circuit/v": [1] * 21 + [0] * 19, "circuit/qk": [1] * 20 + [0] * 20}}
    assert "neither is shown to be larger" in _ordering(close, "circuit/v", "circuit/qk")
    assert _ordering({}, "circuit/v", "circuit/qk") == ""


def test_pooled_proportion_of_all_zeros_keeps_an_exact_upper_bound():
    zeros = pooled_proportion([[0.0] * 200] * 5)
    assert (zeros.value, zeros.low, zeros.n) == (0.0, 0.0, 200)
    assert zeros.high == pytest.approx(proportion([0.0] * 200).high) and 0.017 < zeros.high < 0.019
    ones = pooled_proportion([[1.0] * 40] * 3)
    assert ones.high == 1.0 and ones.low == pytest.approx(proportion([1.0] * 40).low) and ones.low < 0.92
