"""DCM's bookkeeping against direct computations: settings refused with their messages, the desideratum's
options, the split, one training step's loss and move, the history, the result's figures and its record.

Written from the survivors of mutation testing (benchmarks/mutation.md); each test is under a second or two.
"""

from __future__ import annotations

import dataclasses
import logging
import random
import re

import numpy as np
import pytest
import torch

import mechdiff.methods.dcm as dcm
from conftest import make_tiny
from mechdiff.circuits.circuit import Circuit
from mechdiff.common.components import Head, all_heads
from mechdiff.methods.dcm import DCMConfig, DCMResult, PairCache, SemanticResult, dcm_circuit, loss_scale, masked_z_patches, random_pool, run_dcm, semantic_patching, source_z, split_indices, target_accuracy, train_mask
from mechdiff.tasks.desiderata import desideratum_pairs
from mechdiff.common.metrics import answer_logit
from mechdiff.patching.core import run
from mechdiff.common.stats import Estimate, proportion
from mechdiff.tasks.base import get_task, pair_batch_tensors
from mechdiff.tasks.entity_tracking import object_value_pairs

HEADS = [Head(1, 0), Head(2, 1), Head(2, 3)]
VOCABULARY = ["apple", "book", "car", "dog", "egg", "fan", "hat", "key", "lamp", "map", "pen", "cup", "box", "bag"]


@pytest.fixture(scope="module")
def model(smollm2_tokenizer):
    return make_tiny("llama", smollm2_tokenizer, seed=5)


@pytest.fixture(scope="module")
def pairs(smollm2_tokenizer):
    return object_value_pairs(smollm2_tokenizer, 20, n_boxes=3, seed=4)


def _exactly(message: str) -> str:
    return "^" + re.escape(message) + "$"


@pytest.mark.parametrize("settings, message", [
    ({"parameterisation": "l0"}, "parameterisation must be one of ('continuous', 'hard_concrete'), got 'l0'"),
    ({"lam_scale": "relative"}, "lam_scale must be 'loss' or 'absolute', got 'relative'"),
    ({"random_pool": "layer"}, "random_pool must be 'group' or 'all', got 'layer'"),
    ({"split": (0.0, 0.5, 0.5)}, "split must be three positive fractions summing to 1, got (0.0, 0.5, 0.5)"),
    ({"split": (0.5, 0.5)}, "split must be three positive fractions summing to 1, got (0.5, 0.5)"),
    ({"split": (0.6, 0.2, 0.3)}, "split must be three positive fractions summing to 1, got (0.6, 0.2, 0.3)"),
    ({"batch_size": 0}, "batch_size, micro_batch and eval_batch must be at least 1"),
    ({"micro_batch": 0}, "batch_size, micro_batch and eval_batch must be at least 1"),
    ({"eval_batch": 0}, "batch_size, micro_batch and eval_batch must be at least 1"),
])
def test_config_refusals_name_the_setting(settings, message):
    with pytest.raises(ValueError, match=_exactly(message)):
        DCMConfig(**settings)
    DCMConfig(split=(0.98, 0.01, 0.01), batch_size=1, micro_batch=1, eval_batch=1)  # the edges are accepted


def test_desideratum_pairs_pass_boxes_seed_and_vocabulary(smollm2_tokenizer):
    task = get_task("entity-tracking")
    got = desideratum_pairs("object_value", smollm2_tokenizer, 4, n_boxes=3, seed=2, vocabulary=VOCABULARY)
    assert got == task.desideratum("object", smollm2_tokenizer, 4, seed=2, n_boxes=3, vocabulary=VOCABULARY)
    assert got != desideratum_pairs("object", smollm2_tokenizer, 4, n_boxes=4, seed=2, vocabulary=VOCABULARY)
    assert got != desideratum_pairs("object", smollm2_tokenizer, 4, n_boxes=3, seed=2)
    assert got != desideratum_pairs("object", smollm2_tokenizer, 4, n_boxes=3, seed=3, vocabulary=VOCABULARY)
    assert desideratum_pairs("position", smollm2_tokenizer, 2, n_boxes=3) == \
        task.desideratum("positional", smollm2_tokenizer, 2, n_boxes=3)
    assert desideratum_pairs("label", smollm2_tokenizer, 2) == task.desideratum("label", smollm2_tokenizer, 2)
    with pytest.raises(ValueError, match=_exactly(
            "unknown desideratum 'colour'; task entity-tracking defines ['label', 'object', 'positional'] "
            "(or pass your own list of counterfactual pairs)")):
        desideratum_pairs("colour", smollm2_tokenizer, 2)


def test_split_indices_are_the_seeded_shuffle_cut_by_the_fractions():
    order = list(range(10))
    random.Random(7).shuffle(order)
    assert split_indices(10, (0.6, 0.2, 0.2), 7) == (order[:6], order[6:8], order[8:])
    assert [len(p) for p in split_indices(3, (0.9, 0.05, 0.05), 0)] == [1, 1, 1]
    assert [len(p) for p in split_indices(5, (0.2, 0.6, 0.2), 0)] == [1, 3, 1]
    with pytest.raises(ValueError, match=_exactly("DCM needs at least 3 pairs (train/validation/test), got 2")):
        split_indices(2, (0.6, 0.2, 0.2), 0)


def _estimate(v: float) -> Estimate:
    return Estimate(v, v - 0.1, v + 0.1, 10)


def test_result_and_semantic_records_field_by_field():
    result = DCMResult("object", "last", [Head(1, 0), Head(2, 1)], [0.9, 0.1], [Head(2, 1)], _estimate(0.6),
                       _estimate(0.2), _estimate(0.7), None, (6, 2, 3), 4, [{"step": 0}], "A", {"lr": 0.1})
    assert result.to_dict() == {
        "group": "A", "desideratum": "object", "position": "last", "heads": ["L1H0", "L2H1"], "mask": [0.9, 0.1],
        "selected": ["L2H1"], "test_accuracy": _estimate(0.6).to_dict(), "floor": _estimate(0.2).to_dict(),
        "full_group": _estimate(0.7).to_dict(), "random": None, "n_train": 6, "n_val": 2, "n_test": 3,
        "best_step": 4, "history": [{"step": 0}], "config": {"lr": 0.1}}
    assert dataclasses.replace(result, random=_estimate(0.3)).to_dict()["random"] == _estimate(0.3).to_dict()
    assert SemanticResult("m", _estimate(0.5), _estimate(0.25)).to_dict() == {
        "model": "m", "accuracy": _estimate(0.5).to_dict(), "floor": _estimate(0.25).to_dict()}


def _mean_target_logit(model, pairs, heads, mask, absolute: bool = False) -> float:
    """Mean target logit (or mean |target logit|) of full-length runs with ``heads`` mixed under ``mask``
    (no cache, no suffix run)."""
    batch = pair_batch_tensors(pairs)
    values = source_z(model, batch, sorted({h.layer for h in heads}), "last")
    patches = masked_z_patches(model, heads, mask, values, batch["base"]["positions"]["last"])
    with torch.no_grad():
        logits = run(model, batch["base"]["input_ids"], patches).logits
    logit = answer_logit(logits, batch["target_ids"])
    return float((logit.abs() if absolute else logit).mean())


def test_loss_scale_is_the_unpatched_mean_absolute_target_logit_of_the_first_micro_batch(model, pairs):
    cache = PairCache.build(model, pairs, [(HEADS, "last")])
    train = [5, 2, 9, 11, 0]
    config = DCMConfig(micro_batch=3)
    expected = _mean_target_logit(model, [pairs[i] for i in train[:3]], HEADS, torch.ones(3), absolute=True)
    assert loss_scale(model, HEADS, "last", cache, train, config) == pytest.approx(expected, rel=1e-5)
    assert loss_scale(model, HEADS, "last", cache, train, dataclasses.replace(config, lam_scale="absolute")) == 1.0
    assert loss_scale(model, HEADS, "last", cache, [], config) == 1.0


@pytest.mark.parametrize("lam_scale", ["absolute", "loss"])
def test_one_step_reports_its_loss_and_history_its_validation(model, pairs, lam_scale):
    """One optimiser step on every training pair: the history's loss is -(mean target logit) + lam * scale *
    sum(1 - m) at the initial mask, computed here from full-length runs; each validation's accuracy and
    selection are those of the mask it validated; the mask moves by Adam's first step, lr * sign(gradient)."""
    cache = PairCache.build(model, pairs, [(HEADS, "last")])
    train, val = list(range(8)), list(range(8, 14))
    config = DCMConfig(lam=0.5, lam_scale=lam_scale, lr=0.3, epochs=1, batch_size=8, micro_batch=3,
                       eval_every=1, init=0.8)
    init = torch.full((3,), 0.8)
    scale = 1.0 if lam_scale == "absolute" else _mean_target_logit(model, [pairs[i] for i in train[:3]], HEADS,
                                                                   torch.ones(3), absolute=True)
    lam = 0.5 * scale
    expected_loss = -_mean_target_logit(model, [pairs[i] for i in train], HEADS, init) + lam * float((1 - init).sum())
    mask = init.clone().requires_grad_()
    objective = -_mean_target_logit_grad(model, [pairs[i] for i in train], HEADS, mask) + lam * (1 - mask).sum()
    (grad,) = torch.autograd.grad(objective, mask)
    values, best_step, history = train_mask(model, HEADS, "last", cache, train, val, config, progress=False)
    assert [h["step"] for h in history] == [0, 1]
    assert np.isnan(history[0]["loss"]) and history[1]["loss"] == pytest.approx(expected_loss, rel=1e-4)
    moved = (init - 0.3 * torch.sign(grad)).clamp(0, 1)
    for entry, m in zip(history, [init, moved]):
        chosen = [h for h, v in zip(HEADS, m.tolist()) if v < 0.5]
        assert entry["n_selected"] == len(chosen)
        direct = target_accuracy(model, [pairs[i] for i in val], chosen, "last") if chosen else cache.floor[val]
        assert entry["val_accuracy"] == pytest.approx(float(np.mean(direct)))
    best = max(range(2), key=lambda i: (history[i]["val_accuracy"], history[i]["n_selected"], -i))
    assert best_step == best
    torch.testing.assert_close(values, [init, moved][best], atol=1e-4, rtol=0)


def _mean_target_logit_grad(model, pairs, heads, mask) -> torch.Tensor:
    batch = pair_batch_tensors(pairs)
    values = source_z(model, batch, sorted({h.layer for h in heads}), "last")
    patches = masked_z_patches(model, heads, mask, values, batch["base"]["positions"]["last"])
    logits = run(model, batch["base"]["input_ids"], patches, grad=True).logits
    return answer_logit(logits, batch["target_ids"]).mean()


def test_run_dcm_reports_the_accuracies_of_what_it_selected(model, pairs):
    config = DCMConfig(lam=0.0, lr=0.5, epochs=2, batch_size=4, eval_every=4, init=0.4, n_random=2,
                       random_pool="group", seed=3)
    res = run_dcm(model, HEADS, "last", pairs, config, desideratum="object", group="B", progress=False)
    train, val, test = split_indices(len(pairs), config.split, config.seed)
    tested = [pairs[i] for i in test]
    assert res.n_split == (len(train), len(val), len(test)) == (12, 4, 4)
    assert [h["step"] for h in res.history] == [0, 4, 6]  # every eval_every steps, and the last (3 an epoch)
    assert res.selected == [h for h, m in zip(HEADS, res.mask) if m < 0.5] and res.selected
    assert res.mask == [round(m, 4) for m in res.mask]
    assert res.test_accuracy.value == pytest.approx(target_accuracy(model, tested, res.selected, "last").mean())
    assert res.full_group.value == pytest.approx(target_accuracy(model, tested, HEADS, "last").mean())
    assert res.test_accuracy.n == res.floor.n == res.full_group.n == len(test)
    unpatched = [_mean_target_logit_top1(model, p) for p in tested]
    assert res.floor.value == pytest.approx(np.mean(unpatched))
    rng = random.Random(config.seed + 1)
    draws = [target_accuracy(model, tested, rng.sample(HEADS, len(res.selected)), "last") for _ in range(2)]
    assert res.random.value == pytest.approx(np.mean(draws))
    assert (res.desideratum, res.group, res.position, res.heads) == ("object", "B", "last", HEADS)
    assert res.config == dataclasses.asdict(config)
    assert res.test_accuracy == proportion(target_accuracy(model, tested, res.selected, "last"))
    with pytest.raises(ValueError, match=_exactly("DCM needs at least one head")):
        run_dcm(model, [], "last", pairs, config)


def _mean_target_logit_top1(model, pair) -> float:
    batch = pair_batch_tensors([pair])
    with torch.no_grad():
        logits = run(model, batch["base"]["input_ids"]).logits
    return float(logits.argmax(-1).item() == batch["target_ids"].item())


def test_random_pool_and_no_baseline(model):
    config = DCMConfig()
    assert random_pool(model, HEADS, config) == all_heads(model.shape.n_layers, model.shape.n_heads)
    assert random_pool(model, HEADS, dataclasses.replace(config, random_pool="group")) == HEADS
    assert random_pool(model, HEADS, dataclasses.replace(config, n_random=0)) == HEADS


def test_patched_runs_resume_at_the_group_and_read_the_base_keys_and_values(model, pairs, monkeypatch):
    """The cache's patched runs skip the blocks below the group's first layer and the positions before the
    patched one (cost, not values: the values are checked against full runs in test_dcm.py)."""
    cache = PairCache.build(model, pairs[:4], [(HEADS, "last")])
    calls = []

    def spy(*args, **kwargs):
        calls.append(kwargs)
        return run(*args, **kwargs)

    monkeypatch.setattr(dcm, "run", spy)
    cache.logits(model, [0, 2], HEADS, torch.ones(3), "last")
    (kwargs,) = calls
    assert kwargs["resume"].layer == 1 and kwargs["resume"].hidden.shape[0] == 2
    assert kwargs["prefix"] is not None and kwargs["prefix"].keys[0].shape[0] == 2
    assert kwargs["grad"] is False


def test_a_circuit_builds_one_cache_per_desideratum(model, pairs, monkeypatch, caplog):
    built = []
    original = PairCache.build

    def count(*args, **kwargs):
        built.append(1)
        return original(*args, **kwargs)

    monkeypatch.setattr(PairCache, "build", count)
    circuit = Circuit("tiny", "entity-tracking", {"A": [Head(1, 0)], "B": [Head(2, 1)], "C": []},
                      {"A": "last", "B": "last", "C": "last"})
    config = DCMConfig(epochs=1, batch_size=8, eval_every=1, n_random=1)
    with caplog.at_level(logging.INFO, logger="mechdiff.methods.dcm"):
        results = dcm_circuit(model, circuit, {"one": pairs[:8], "two": pairs[8:16]}, config, progress=False)
    assert len(built) == 2
    assert "DCM group B (1 heads at last), desideratum two" in caplog.messages
    assert [(r.group, r.desideratum) for r in results] == [("A", "one"), ("A", "two"), ("B", "one"), ("B", "two")]
    with pytest.raises(ValueError, match=_exactly("group 'D' is not in the circuit (groups: ['A', 'B', 'C'])")):
        dcm_circuit(model, circuit, {"one": pairs[:8]}, config, groups=["D"], progress=False)


def test_a_circuit_holds_one_desideratum_cache_at_a_time(model, pairs, monkeypatch):
    """Each desideratum's cache (every layer's keys and values of its pairs: about 6 GB for 2000 SmolLM2 pairs)
    is released before the next is built: two alive at once ran the paper-form study out of 24 GB."""
    import gc
    import weakref

    alive_at_build, built = [], []
    original = PairCache.build

    def build(*args, **kwargs):
        gc.collect()
        alive_at_build.append(sum(ref() is not None for ref in built))
        cache = original(*args, **kwargs)
        built.append(weakref.ref(cache))
        return cache

    monkeypatch.setattr(PairCache, "build", build)
    circuit = Circuit("tiny", "entity-tracking", {"A": [Head(1, 0)]}, {"A": "last"})
    config = DCMConfig(epochs=1, batch_size=8, eval_every=1, n_random=1)
    dcm_circuit(model, circuit, {"one": pairs[:8], "two": pairs[8:16], "three": pairs[:8]}, config, progress=False)
    assert alive_at_build == [0, 0, 0]


def test_semantic_patching_refuses_an_empty_selection(model, pairs):
    with pytest.raises(ValueError, match=_exactly(
            "semantic patching needs at least one head (the DCM selection was empty)")):
        semantic_patching([model], [], "last", pairs)
    (res,) = semantic_patching([model], [Head(2, 1)], "last", pairs[:6], batch_size=4)
    assert res.accuracy.value == pytest.approx(target_accuracy(model, pairs[:6], [Head(2, 1)], "last").mean())
    assert res.floor.value == pytest.approx(np.mean([_mean_target_logit_top1(model, p) for p in pairs[:6]]))


def test_a_mask_at_one_half_selects_nothing(model, pairs):
    """Selected heads are those with m < 0.5: a mask that never leaves 0.5 (learning rate 0) selects none, so
    the test accuracy is the floor and there is no random baseline of size 0."""
    config = DCMConfig(lr=0.0, init=0.5, epochs=1, batch_size=12, eval_every=1, n_random=2)
    res = run_dcm(model, HEADS, "last", pairs, config, progress=False)
    assert res.mask == [0.5, 0.5, 0.5] and res.selected == [] and res.random is None
    assert res.test_accuracy == res.floor
    assert [h["n_selected"] for h in res.history] == [0, 0]


def test_a_position_absent_from_a_source_prompt_is_refused(model, pairs):
    batch = pair_batch_tensors(pairs[:2])
    batch["source"]["positions"]["last"] = torch.tensor([5, -1])
    with pytest.raises(ValueError, match=_exactly(
            "position 'last' is absent from some source prompts (e.g. path-patching sources); DCM needs the "
            "group's position in both prompts of every pair")):
        source_z(model, batch, [1], "last")


def test_a_quiet_dcm_prints_nothing(model, pairs, capsys):
    """``progress=False``: no bar from the cache, training, validation or evaluation."""
    circuit = Circuit("tiny", "entity-tracking", {"A": [Head(1, 0), Head(2, 1)]}, {"A": "last"})
    dcm_circuit(model, circuit, {"one": pairs[:9]}, DCMConfig(epochs=1, batch_size=3, eval_every=1, n_random=1),
                progress=False)
    semantic_patching([model], [Head(2, 1)], "last", pairs[:3], progress=False)
    assert capsys.readouterr().err == ""
    semantic_patching([model], [Head(2, 1)], "last", pairs[:3])  # the default shows its bars
    assert "dcm cache" in capsys.readouterr().err
