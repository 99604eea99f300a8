"""The trajectory measures on a tiny trajectory (three checkpoints of a tiny llama trained in the test, ``tiny_run``),
each checked against a direct computation on the checkpoint loaded by itself (``load_model(f"{run}@{step}")``);
the within-checkpoint null and the formed-at rule on constructed data."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from scipy import stats

from mechdiff.circuits.circuit import Circuit
from mechdiff.circuits.curve import prompt_attribution
from mechdiff.circuits.positions import task_classes
from mechdiff.circuits.scoring import Scorer
from mechdiff.common.components import Head, parse_heads
from mechdiff.common.stats import paired_difference
from mechdiff.methods.dcm import semantic_patching
from mechdiff.methods.trajectory import (
    Checkpoints,
    TrajectoryError,
    against_first,
    checkpoint_accuracy,
    circuits_scored,
    cmap_gain,
    decode_array,
    formed_at,
    halves,
    jaccard,
    membership,
    own_circuit,
    semantic,
    structure,
    trajectory_specs,
)
from mechdiff.models.loading import load_model
from mechdiff.patching.evaluate import evaluate
from mechdiff.report.trajectory import band_figure, membership_figure
from mechdiff.tasks.base import get_task
from mechdiff.tasks.desiderata import desideratum_pairs

STEPS = (0, 2, 4)
TASK = get_task("entity-tracking")


@pytest.fixture(scope="module")
def trajectory(tiny_run) -> tuple[list[str], Checkpoints]:
    _, run = tiny_run
    names = [f"{run}@{s}" for s in STEPS]
    return names, Checkpoints(names)


@pytest.fixture(scope="module")
def prompts(smollm2_tokenizer) -> dict:
    return {
        "records": TASK.records(smollm2_tokenizer, 24, seed=1, n_boxes=3),
        "reference": TASK.reference_records(smollm2_tokenizer, 32, seed=3, n_boxes=3),
    }


def scorer(lm, prompts) -> Scorer:
    return Scorer.build(lm, prompts["records"], prompts["reference"], batch_size=8, progress=False)


def direct(name: str):
    """The checkpoint loaded by itself: its base loaded and the adapter merged (the path every study takes)."""
    return load_model(name)


def test_swapped_checkpoints_are_the_loaded_checkpoints_bit_for_bit(trajectory):
    """Every checkpoint served by swapping adapters in one peft model has load_model's fingerprint and logits
    (exact: the same merge of the same tensors, the same kernels), in any order of swaps."""
    names, cp = trajectory
    ids = torch.randint(0, 1000, (2, 9), generator=torch.Generator().manual_seed(0))
    for name in [*names[::-1], *names]:
        lm, ref = cp.model(name), direct(name)
        assert cp.fingerprint(name) == ref.fingerprint
        with torch.no_grad():
            assert torch.equal(lm.model(ids).logits, ref.model(ids).logits)
    assert len({cp.fingerprint(n) for n in names}) == 3
    stale = cp.model(names[1])
    cp.model(names[2])
    with pytest.raises(RuntimeError, match="not the active checkpoint"):
        evaluate(stale, TASK.records(stale.tokenizer, 2, seed=0, n_boxes=3), progress=False)


def test_not_a_trajectory_is_refused_before_loading(tiny_run):
    base, run = tiny_run
    with pytest.raises(TrajectoryError, match="at least two distinct"):
        trajectory_specs([f"{run}@2"])
    with pytest.raises(TrajectoryError, match="at least two distinct"):
        trajectory_specs([f"{run}@2", f"{run}@2"])
    with pytest.raises(TrajectoryError, match="no checkpoint .* is a LoRA adapter"):
        trajectory_specs([str(base), str(base) + "/"])
    with pytest.raises(TrajectoryError, match="neither a LoRA adapter nor the adapters' base"):
        trajectory_specs(["smollm2-et@0", f"{run}@2"])


def test_accuracy_is_each_checkpoints_top1_with_its_exact_interval(trajectory, prompts):
    names, cp = trajectory
    for name in names:
        res = checkpoint_accuracy(cp.model(name), prompts["records"], batch_size=8, progress=False)
        model = direct(name).model
        with torch.no_grad():  # one prompt at a time, a plain transformers forward
            want = [
                int(model(torch.tensor([r.input_ids])).logits[0, -1].argmax() == r.answer_id)
                for r in prompts["records"]
            ]
        assert res["correct"] == want
        k, n = sum(want), len(want)
        ci = stats.binomtest(k, n).proportion_ci(method="exact")
        assert res["accuracy"]["value"] == k / n
        assert res["accuracy"]["low"] == pytest.approx(ci.low, abs=1e-12)
        assert res["accuracy"]["high"] == pytest.approx(ci.high, abs=1e-12)


def test_own_circuit_and_circuits_scored_match_the_loaded_checkpoint(trajectory, prompts):
    names, cp = trajectory
    last = names[-1]
    sizes, target = (0.05, 0.2, 1.0), 0.8
    swapped = scorer(cp.model(last), prompts)
    classes = task_classes(swapped)
    own = own_circuit(swapped, swapped, classes, sizes, target, "value", draws=20, seed=0, task=TASK.name)
    ref_scorer = scorer(direct(last), prompts)
    attribution = prompt_attribution(ref_scorer, classes)
    assert np.array_equal(decode_array(own["attribution"]), attribution.float().numpy())
    # the size: the smallest whose faithfulness reaches the target (the largest where none does)
    reached = [r for r in own["curve"]["rows"] if r["faithfulness"]["value"] >= target]
    assert own["n_pairs"] == (reached[0] if reached else own["curve"]["rows"][-1])["n_pairs"]
    circuit = Circuit.from_dict(own["circuit"])
    assert len(circuit.pairs()) == own["n_pairs"] and own["n_heads"] == len(circuit.heads())
    assert all(0 <= f <= 1 for f in own["stability"].values()) and len(own["stability"]) == own["n_pairs"]

    first_trained = Circuit(
        "x",
        TASK.name,
        {"last": [Head(2, 0), Head(1, 3)], "query_label": [Head(0, 1)]},
        {"last": "last", "query_label": "query_label"},
    )
    scored = circuits_scored(swapped, {"own": circuit, "first trained": first_trained})
    for label, c in (("own", circuit), ("first trained", first_trained)):
        kept = ref_scorer.keep(c.pairs()).correct.astype(int).tolist()
        full = ref_scorer.full().correct.astype(int).tolist()
        assert scored["outcomes"][label] == kept and scored["full"] == full
        row = scored["rows"][label]
        assert row["accuracy"] == np.mean(kept) and row["full_accuracy"] == np.mean(full)
        if np.mean(full):
            assert row["faithfulness"] == pytest.approx(np.mean(kept) / np.mean(full), rel=1e-12)
            assert row["faithfulness_low"] <= row["faithfulness"] <= row["faithfulness_high"]


def test_cmap_gain_is_the_paired_difference_of_patched_and_first(trajectory, prompts):
    names, cp = trajectory
    circuit = Circuit(
        "x",
        TASK.name,
        {"last": [Head(2, 0), Head(2, 3)], "query_label": [Head(1, 1)]},
        {"last": "last", "query_label": "query_label"},
    )
    first, other = cp.first(), cp.model(names[2])
    res = cmap_gain(first, other, circuit, prompts["records"], ("z", "v"), batch_size=8, progress=False)
    direct_first = evaluate(direct(names[0]), prompts["records"], 8, progress=False).correct.astype(int).tolist()
    direct_other = evaluate(direct(names[2]), prompts["records"], 8, progress=False).correct.astype(int).tolist()
    assert res["outcomes"]["base"] == direct_first and res["outcomes"]["finetune"] == direct_other
    assert set(res["gain"]) == {f"{s}/{k}" for s in ("last", "query_label", "circuit") for k in ("z", "v")}
    for key, gain in res["gain"].items():
        patched = np.array(res["outcomes"][key], dtype=float)
        assert gain == paired_difference(patched, direct_first).to_dict()
        assert gain["value"] == pytest.approx(patched.mean() - np.mean(direct_first), abs=1e-12)
    # every head of every layer at every position: z from the other checkpoint, read out by the first's o_proj
    # (exactly the other checkpoint where o_proj is untouched by the adapter: not here, so only a sanity check)
    assert all(-1 <= g["low"] <= g["value"] <= g["high"] <= 1 for g in res["gain"].values())


def test_semantic_patching_matches_the_loaded_checkpoint(trajectory, smollm2_tokenizer):
    """Two selections of one desideratum share one pair cache; each gives what semantic_patching gives on the
    checkpoint loaded by itself."""
    names, cp = trajectory
    pairs = desideratum_pairs("positional", smollm2_tokenizer, 16, n_boxes=3, seed=4)
    labels = [
        {"group": "last", "desideratum": "positional", "position": "last", "selected": ["L2H1", "L1H0"]},
        {"group": "last", "desideratum": "object_value", "position": "last", "selected": []},
        {"group": "query_label", "desideratum": "positional", "position": "query_label", "selected": ["L0H2", "L1H3"]},
    ]
    for name in names:
        got = semantic(cp.model(name), labels, {"positional": pairs}, batch_size=8, progress=False)
        assert [g["group"] for g in got] == ["last", "query_label"]  # an empty selection is not patched
        for g, lab in zip(got, (labels[0], labels[2])):
            want = semantic_patching([direct(name)], parse_heads(lab["selected"]), lab["position"], pairs, 8, False)[0]
            assert g["outcomes"] == want.outcomes and len(want.outcomes) == 16
            assert g["accuracy"] == want.accuracy.to_dict() and g["floor"] == want.floor.to_dict()
            assert g["accuracy"]["value"] == np.mean(want.outcomes)


def test_within_checkpoint_null_on_the_tiny_trajectory_is_the_overlap_of_two_disjoint_discoveries(trajectory, prompts):
    names, cp = trajectory
    attribution, classes = {}, None
    for name in names:
        s = scorer(cp.model(name), prompts)
        classes = classes or task_classes(s)
        attribution[name] = prompt_attribution(s, classes).float().numpy()
    n = 12
    res = structure(attribution, classes, n, draws=30, seed=5)
    a, b = halves(len(prompts["records"]), 5)
    assert not set(a) & set(b) and len(a) + len(b) == len(prompts["records"])

    def top(x: np.ndarray, rows) -> set:  # by sorting, not topk
        mean = np.abs(x.reshape(x.shape[0], -1)[rows].astype(np.float64).mean(0))
        return set(np.argsort(-mean, kind="stable")[:n].tolist())

    for name in names:
        ta, tb = top(attribution[name], a), top(attribution[name], b)
        assert res["null"][name]["value"] == len(ta & tb) / len(ta | tb)
        assert 0 <= res["null"][name]["low"] <= res["null"][name]["high"] <= 1
    for row, (s, t) in zip(res["consecutive"], zip(names, names[1:])):
        cross = (
            jaccard(frozenset(top(attribution[s], a)), frozenset(top(attribution[t], b)))
            + jaccard(frozenset(top(attribution[t], a)), frozenset(top(attribution[s], b)))
        ) / 2
        assert row["cross"]["value"] == cross
        assert row["null_minus_cross"]["value"] == pytest.approx(
            (res["null"][s]["value"] + res["null"][t]["value"]) / 2 - cross, abs=1e-12
        )
        assert row["changed"] == (row["null_minus_cross"]["low"] > 0)


def constructed(strong: list[int], n_prompts: int = 40, seed: int = 0, noise: float = 0.1) -> np.ndarray:
    """Attribution ``"prompt class layer head"`` (2 classes, 3 layers, 4 heads): the ``strong`` flat pairs at 1,
    the rest noise."""
    rng = np.random.default_rng(seed)
    x = rng.normal(0, noise, (n_prompts, 24))
    x[:, strong] += 1.0
    return x.reshape(n_prompts, 2, 3, 4).astype(np.float32)


def test_structure_changes_only_beyond_the_within_checkpoint_spread():
    classes = ["last", "query_label"]
    same = constructed([0, 5, 9])
    moved = constructed([0, 5, 17], seed=1)  # pair 9 (last L2H1) out, pair 17 (query_label L1H1) in
    res = structure({"s": same, "t": same.copy(), "u": moved}, classes, n=3, draws=50, seed=0)
    assert res["null"]["s"]["value"] == 1.0 and res["null"]["s"]["low"] == 1.0  # a clear top 3: both halves agree
    same_row, moved_row = res["consecutive"]
    # the same model twice: cross = null on every draw, so the difference is exactly 0 and no change is called
    assert same_row["null_minus_cross"] == {"value": 0.0, "low": 0.0, "high": 0.0, "n": 50}
    assert not same_row["changed"] and same_row["entered"] == [] and same_row["left"] == []
    assert moved_row["cross"]["value"] == 0.5  # 2 shared of 4
    assert moved_row["null_minus_cross"]["low"] == 0.5 and moved_row["changed"]
    assert moved_row["entered"] == ["L1H1@query_label"] and moved_row["left"] == ["L2H1@last"]
    # noise as large as the signal: a different top set on each half, and no pair robustly in or out
    noisy = {"s": constructed([0, 5, 9], noise=3.0, seed=2), "t": constructed([0, 5, 17], noise=3.0, seed=3)}
    res = structure(noisy, classes, n=3, draws=50, seed=0)
    assert res["null"]["s"]["value"] < 1 and res["consecutive"][0]["entered"] == []
    assert not res["consecutive"][0]["changed"]


def test_formed_at_needs_the_interval_to_exclude_zero_from_that_step_on():
    def iv(low: float, high: float) -> dict:
        return {"value": (low + high) / 2, "low": low, "high": high, "n": 10}

    steps = [0, 5, 10, 15, 20, 30]
    seq = [None, iv(-0.1, 0.2), iv(0.1, 0.3), iv(-0.05, 0.1), iv(0.2, 0.4), iv(0.3, 0.5)]
    assert formed_at(steps, seq) == {"step": 20, "sign": 1}  # 10 excludes 0, 15 does not: from 20 on
    assert formed_at(steps, [None] + [iv(0.1, 0.2)] * 5) == {"step": 5, "sign": 1}
    assert formed_at(steps, [None, iv(0.1, 0.2), iv(-0.3, -0.1), iv(-0.3, -0.1), iv(-0.2, -0.01), iv(-0.4, -0.2)]) == {
        "step": 10,
        "sign": -1,
    }
    assert formed_at(steps, [None, iv(0.1, 0.2), iv(0.1, 0.2), iv(0.1, 0.2), iv(0.1, 0.2), iv(0.0, 0.2)]) is None
    assert formed_at(steps, [None, *([iv(0.1, 0.2)] * 4), iv(-0.3, -0.2)]) == {"step": 30, "sign": -1}
    with pytest.raises(ValueError, match="6 steps but 2 intervals"):
        formed_at(steps, seq[:2])


def test_against_first_is_the_paired_difference_and_none_for_the_first():
    rng = np.random.default_rng(0)
    outcomes = [rng.integers(0, 2, 30).tolist() for _ in range(3)]
    got = against_first(outcomes)
    assert got[0] is None
    for o, g in zip(outcomes[1:], got[1:]):
        assert g == paired_difference(o, outcomes[0]).to_dict()
        assert g["value"] == pytest.approx(np.mean(o) - np.mean(outcomes[0]), abs=1e-12)


def test_membership_counts_pairs_by_class_and_layer(tmp_path):
    a = Circuit("a", "t", {"last": [Head(1, 0), Head(1, 2), Head(2, 0)]}, {"last": "last"})
    b = Circuit(
        "b",
        "t",
        {"last": [Head(1, 0)], "query_label": [Head(0, 3), Head(1, 0)]},
        {"last": "last", "query_label": "query_label"},
    )
    assert membership([a, b]) == {
        ("last", 1): [2, 1],
        ("last", 2): [1, 0],
        ("query_label", 0): [0, 1],
        ("query_label", 1): [0, 1],
    }
    assert membership_figure([0, 5], [a, b], tmp_path / "m.png").stat().st_size > 0
    iv = {"value": 0.5, "low": 0.4, "high": 0.6, "n": 10}
    assert band_figure([0, 5], {"x": [None, iv]}, tmp_path / "b.png", zero=True).stat().st_size > 0
