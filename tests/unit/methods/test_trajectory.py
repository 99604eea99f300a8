"""The trajectory measures on a tiny trajectory (three checkpoints of a tiny llama trained in the test, ``tiny_run``),
each checked against a direct computation on the checkpoint loaded by itself (``load_model(f"{run}@{step}")``);
the within-checkpoint null and the formed-at rule on constructed data."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest
import torch
from scipy import stats
from tolerances import approx32

from mechdiff.circuits.circuit import Circuit
from mechdiff.circuits.curve import prompt_attribution
from mechdiff.circuits.positions import task_classes
from mechdiff.circuits.scoring import Scorer
from mechdiff.common import inference
from mechdiff.common.components import Head, parse_heads
from mechdiff.common.stats import bootstrap_ratio
from mechdiff.methods.checkpoints import Checkpoints, TrajectoryError, trajectory_specs
from mechdiff.methods.semantic import semantic_patching
from mechdiff.methods.structure import splits, structure
from mechdiff.methods.trajectory import (
    against_first,
    checkpoint_accuracy,
    circuits_scored,
    cmap_gain,
    decode_array,
    membership,
    own_circuit,
    semantic,
)
from mechdiff.models.loading import load_model
from mechdiff.patching.evaluate import evaluate
from mechdiff.report.figures import band_figure
from mechdiff.studies.trajectory.report_function import membership_figure
from mechdiff.studies.trajectory.report_structure import overlap_figure
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
    # full-weight checkpoints of one architecture are a trajectory (tests/unit/studies/test_trajectory_any.py); the
    # base twice is two checkpoints of one architecture, the first standing as the base
    first, specs = trajectory_specs([str(base), str(base) + "/"])
    assert first == specs[0] and [s.kind for s in specs] == ["local", "local"]
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
    # each pair's selection frequency: how often it is in the top n_pairs when the ranking prompts are resampled
    # (numpy's generator, seeded as documented), recomputed here by sorting
    flat, n = attribution.reshape(attribution.shape[0], -1).numpy(), own["n_pairs"]
    rng, counts = np.random.default_rng(0), np.zeros(flat.shape[1])
    for _ in range(20):
        counts[np.argsort(-np.abs(flat[rng.integers(0, len(flat), len(flat))].mean(0)), kind="stable")[:n]] += 1
    _, n_layers, n_heads = attribution.shape[1:]
    flat_names = [f"L{la}H{h}@{c}" for c in classes for la in range(n_layers) for h in range(n_heads)]
    assert own["stability"] == {p: counts[flat_names.index(p)] / 20 for p in own["stability"]}
    assert set(own["stability"]) == {f"{h.name}@{pos}" for h, pos in circuit.pairs()}

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
        # accuracy faithfulness: kept over full, undefined (nan) where the whole model answers no prompt (the tiny
        # checkpoint here); the probability faithfulness is always a number: both against the outcomes computed here
        want = np.mean(kept) / np.mean(full) if np.mean(full) else np.nan
        assert row["faithfulness"] == pytest.approx(want, rel=1e-12, nan_ok=True)
        p_kept, p_full = ref_scorer.keep(c.pairs()).prob, ref_scorer.full().prob
        # the swapped adapter and the loaded checkpoint sum in another order on some kernels: float32's tolerance
        assert row["faithfulness_prob"] == approx32(p_kept.mean() / p_full.mean())
        ratio = bootstrap_ratio(p_kept, p_full)  # circuit over model, prompts resampled jointly
        assert [row["faithfulness_prob_low"], row["faithfulness_prob_high"]] == pytest.approx(
            [ratio.low, ratio.high], rel=1e-9
        )


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
        test = inference.paired(patched, direct_first)  # the exact McNemar test, its interval and p
        iv = test.interval
        assert gain == {"value": iv.value, "low": iv.low, "high": iv.high, "n": iv.n_rows, "p": test.p}
        assert gain["value"] == pytest.approx(patched.mean() - np.mean(direct_first), abs=1e-12)
    # the group at the last token patched with plain hooks: the other checkpoint's z of L2H0 and L2H3 written into
    # the first's o_proj input at the last position, one prompt at a time. Its top-1 token becomes each prompt's
    # answer, so CMAP's patched first checkpoint answers every prompt, the unpatched one only some
    top = z_patched(direct(names[0]).model, direct(names[2]).model, prompts["records"], [Head(2, 0), Head(2, 3)])
    relabelled = [dataclasses.replace(r, answer_id=t) for r, t in zip(prompts["records"], top)]
    res = cmap_gain(first, other, circuit, relabelled, ("z",), batch_size=8, progress=False)
    assert res["outcomes"]["last/z"] == [1] * len(relabelled)
    assert 0 < sum(res["outcomes"]["base"]) < len(relabelled)


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


def z_patched(first, other, records, heads: list[Head]) -> list[int]:
    """The top-1 token of ``first`` with ``heads``' outputs (o_proj inputs) at the last token taken from
    ``other``'s run on the same prompt."""
    cfg = first.config
    d = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
    layers = sorted({h.layer for h in heads})
    out = []
    for r in records:
        ids, captured = torch.tensor([r.input_ids]), {}

        def grab(layer):
            return lambda mod, args: captured.__setitem__(layer, args[0][0, -1].clone())

        def put(layer):
            def hook(mod, args):
                z = args[0].clone()
                for h in (h for h in heads if h.layer == layer):
                    z[0, -1, h.head * d : (h.head + 1) * d] = captured[layer][h.head * d : (h.head + 1) * d]
                return (z,)

            return hook

        with torch.no_grad():
            hooks = [other.model.layers[la].self_attn.o_proj.register_forward_pre_hook(grab(la)) for la in layers]
            other(ids)
            hooks += [first.model.layers[la].self_attn.o_proj.register_forward_pre_hook(put(la)) for la in layers]
            out.append(int(first(ids).logits[0, -1].argmax()))
            for hk in hooks:
                hk.remove()
    return out


def test_within_checkpoint_null_on_the_tiny_trajectory_is_the_overlap_of_two_disjoint_discoveries(trajectory, prompts):
    names, cp = trajectory
    attribution, classes = {}, None
    for name in names:
        s = scorer(cp.model(name), prompts)
        classes = classes or task_classes(s)
        attribution[name] = prompt_attribution(s, classes).float().numpy()
    check_structure(attribution, classes, n=12, draws=30, seed=5)


def top(x: np.ndarray, rows, n: int) -> set:
    """The top ``n`` pairs of |mean attribution| over ``rows``, by sorting (not topk)."""
    mean = np.abs(x.reshape(x.shape[0], -1)[rows].astype(np.float64).mean(0))
    return set(np.argsort(-mean, kind="stable")[:n].tolist())


def overlap(a: set, b: set) -> float:
    return len(a & b) / len(a | b)


def check_structure(attribution: dict, classes, n: int, draws: int, seed: int) -> dict:
    """:func:`structure` against the overlaps recomputed here split by split: the null, the cross overlaps
    (consecutive and against the final), their spread-corrected differences, the matrix; every point estimate
    inside its range."""
    names = list(attribution)
    res = structure(attribution, classes, n, draws=draws, seed=seed)
    cuts = splits(len(next(iter(attribution.values()))), draws, seed)
    tops = [{c: (top(x, a, n), top(x, b, n)) for c, x in attribution.items()} for a, b in cuts]
    null = {c: [overlap(*t[c]) for t in tops] for c in names}

    def cross(s, t):
        return [(overlap(d[s][0], d[t][1]) + overlap(d[t][0], d[s][1])) / 2 for d in tops]

    def same(got: dict, values: list) -> None:
        assert got["value"] == pytest.approx(np.mean(values), abs=1e-12) and got["n"] == draws
        spread = [got["spread_low"], got["spread_high"]]
        assert spread == pytest.approx(np.percentile(values, [2.5, 97.5]), abs=1e-12)
        assert got["low"] <= got["value"] <= got["high"]  # the interval over prompts, re-centred on the value

    for c in names:
        same(res["null"][c], null[c])
    pairs = [(r, s, t) for r, (s, t) in zip(res["consecutive"], zip(names, names[1:]))]
    pairs += [(r, r["checkpoint"], names[-1]) for r in res["against_final"]]
    assert [r["checkpoint"] for r in res["against_final"]] == names[:-1]
    for row, s, t in pairs:
        same(row["cross"], cross(s, t))
        same(row["null_minus_cross"], [(x + y) / 2 - c for x, y, c in zip(null[s], null[t], cross(s, t))])
        assert row["changed"] == (row["null_minus_cross"]["low"] > 0)
        d = row["null_minus_cross"]
        assert row["same"] == (-res["margin"] < d["low90"] and d["high90"] < res["margin"])
        assert d["low"] <= d["low90"] <= d["high90"] <= d["high"]
    want = [[np.mean(null[s] if s == t else cross(s, t)) for t in names] for s in names]
    assert res["matrix"]["checkpoints"] == names
    assert np.allclose(res["matrix"]["overlap"], want, atol=1e-12, rtol=0)
    return res


def constructed(strong: list[int], n_prompts: int = 40, seed: int = 0, noise: float = 0.1) -> np.ndarray:
    """Attribution ``"prompt class layer head"`` (2 classes, 3 layers, 4 heads): the ``strong`` flat pairs at 1,
    the rest noise."""
    rng = np.random.default_rng(seed)
    x = rng.normal(0, noise, (n_prompts, 24))
    x[:, strong] += 1.0
    return x.reshape(n_prompts, 2, 3, 4).astype(np.float32)


def point(est: dict) -> tuple:
    """An estimate's value, interval over prompts and split spread."""
    return est["value"], est["low"], est["high"], est["spread_low"], est["spread_high"]


def test_structure_changes_only_beyond_the_within_checkpoint_spread():
    classes = ["last", "query_label"]
    same = constructed([0, 5, 9])
    moved = constructed([0, 5, 17], seed=1)  # pair 9 (last L2H1) out, pair 17 (query_label L1H1) in
    res = structure({"s": same, "t": same.copy(), "u": moved}, classes, n=3, draws=50, seed=0)
    assert res["null"]["s"]["value"] == 1.0 and res["null"]["s"]["low"] == 1.0  # a clear top 3: both halves agree
    same_row, moved_row = res["consecutive"]
    # the same model twice: cross = null on every split of every resample, so the difference is exactly 0: no change
    # is called, and sameness within the margin is shown
    assert point(same_row["null_minus_cross"]) == (0.0, 0.0, 0.0, 0.0, 0.0)
    assert not same_row["changed"] and same_row["same"] and same_row["entered"] == [] and same_row["left"] == []
    assert moved_row["cross"]["value"] == 0.5  # 2 shared of 4
    assert moved_row["null_minus_cross"]["low"] == 0.5 and moved_row["changed"] and not moved_row["same"]
    assert moved_row["entered"] == ["L1H1@query_label"] and moved_row["left"] == ["L2H1@last"]
    # noise as large as the signal: a different top set on each half, and no pair robustly in or out
    noisy = {"s": constructed([0, 5, 9], noise=3.0, seed=2), "t": constructed([0, 5, 17], noise=3.0, seed=3)}
    res = structure(noisy, classes, n=3, draws=50, seed=0)
    assert res["null"]["s"]["value"] < 1 and res["consecutive"][0]["entered"] == []
    assert not res["consecutive"][0]["changed"]


def test_splits_are_disjoint_random_halves_with_no_prompt_drawn_twice():
    cuts = splits(13, 50, seed=2)
    for a, b in cuts:
        assert (len(a), len(b)) == (6, 7) and len(set(a.tolist())) == 6 and len(set(b.tolist())) == 7
        assert sorted([*a.tolist(), *b.tolist()]) == list(range(13))
    assert len({tuple(a.tolist()) for a, _ in cuts}) > 40  # a fresh split each draw
    assert [a.tolist() for a, _ in splits(13, 50, seed=2)] == [a.tolist() for a, _ in cuts]
    with pytest.raises(ValueError, match="at least 4 ranking prompts"):
        splits(3, 5, 0)


def test_the_null_of_a_noisy_checkpoint_lies_inside_its_own_range():
    """Two discoveries of one checkpoint on disjoint halves, noise as large as the signal: the null (the mean over
    random disjoint splits) lies strictly inside the range of the splits, and so does every cross overlap; each
    is what the splits give, recomputed here."""
    classes = ["last", "query_label"]
    attribution = {
        "s": constructed([0, 5, 9, 13], noise=1.5, seed=2, n_prompts=32),
        "t": constructed([0, 5, 9, 17], noise=1.5, seed=3, n_prompts=32),
        "u": constructed([0, 5, 17, 20], noise=1.5, seed=4, n_prompts=32),
    }
    res = check_structure(attribution, classes, n=4, draws=100, seed=1)
    for est in [*res["null"].values(), *(r["cross"] for r in res["consecutive"] + res["against_final"])]:
        assert est["low"] < est["value"] < est["high"]


def test_each_checkpoint_against_the_final_one_and_the_overlap_matrix(tmp_path):
    classes = ["last", "query_label"]
    same = constructed([0, 5, 9])
    moved = constructed([0, 5, 17], seed=1)
    res = structure({"s": same, "t": same.copy(), "u": moved}, classes, n=3, draws=50, seed=0)
    assert [r["checkpoint"] for r in res["against_final"]] == ["s", "t"]
    for row in res["against_final"]:  # both share 2 of 4 pairs with the final, beyond a null of 1 in every split
        assert point(row["cross"]) == (0.5,) * 5
        assert row["null_minus_cross"]["low"] == 0.5 and row["changed"]
    assert res["matrix"]["overlap"] == [[1.0, 1.0, 0.5], [1.0, 1.0, 0.5], [0.5, 0.5, 1.0]]
    path = overlap_figure([0, 5, 10], res["matrix"]["overlap"], tmp_path / "m.png", "overlap")
    assert path.stat().st_size > 0


def test_between_run_null_calls_a_change_only_beyond_what_another_run_gives():
    """Two other runs of the recipe at step "u": one has the same top set as this run there, one a different one.
    The between-run overlap is the mean cross overlap of every two runs, split by split (recomputed here); a
    change into "u" is beyond the runs only where it is larger than the runs' disagreement."""
    classes = ["last", "query_label"]
    same, moved = constructed([0, 5, 9]), constructed([0, 5, 17], seed=1)
    agree = {"r1": constructed([0, 5, 17], seed=5), "r2": constructed([0, 5, 17], seed=6)}
    res = structure({"s": same, "t": same.copy(), "u": moved}, classes, n=3, draws=50, seed=0, runs={"u": agree})
    (between,) = res["between_runs"]
    assert between["checkpoint"] == "u" and between["runs"] == ["u", "r1", "r2"]
    assert point(between["overlap"]) == (1.0,) * 5  # the runs agree at "u"
    assert between["null"]["value"] == 1.0
    into_u = res["consecutive"][1]
    assert into_u["beyond_runs"]["at"] == "u"
    # the runs agree (1.0) and t -> u shares 2 of 4 pairs (0.5): beyond the runs by 0.5 in every split
    assert point(into_u["beyond_runs"]["runs_minus_cross"]) == (0.5,) * 5
    assert into_u["beyond_runs"]["changed"]
    assert "beyond_runs" not in res["consecutive"][0]  # s -> t: no other run read at s or t
    assert all(r["beyond_runs"]["at"] == "u" for r in res["against_final"])
    # runs sharing 2 of 4 pairs with u and agreeing with each other: (0.5 + 0.5 + 1) / 3 against t -> u's 0.5
    partly = {"r1": constructed([0, 5, 9], seed=5), "r2": constructed([0, 5, 9], seed=6)}
    res = structure({"s": same, "t": same.copy(), "u": moved}, classes, n=3, draws=50, seed=0, runs={"u": partly})
    assert res["between_runs"][0]["overlap"]["value"] == pytest.approx(2 / 3)
    assert res["consecutive"][1]["beyond_runs"]["runs_minus_cross"]["value"] == pytest.approx(2 / 3 - 0.5)
    # runs sharing no pair with u nor with each other: the change t -> u is well within what runs differ by
    apart = {"r1": constructed([1, 2, 3], seed=5), "r2": constructed([10, 11, 12], seed=6)}
    res = structure({"s": same, "t": same.copy(), "u": moved}, classes, n=3, draws=50, seed=0, runs={"u": apart})
    assert res["between_runs"][0]["overlap"]["value"] == 0.0
    assert res["consecutive"][1]["beyond_runs"]["runs_minus_cross"]["value"] == -0.5
    assert not res["consecutive"][1]["beyond_runs"]["changed"] and res["consecutive"][1]["changed"]
    with pytest.raises(ValueError, match="not checkpoints of the trajectory"):
        structure({"s": same, "t": same}, classes, n=3, draws=5, seed=0, runs={"x": agree})


def test_between_run_overlap_is_every_two_runs_cross_overlap_split_by_split():
    """Noisy runs: the between-run overlap and the runs' mean null are what the splits give (recomputed here),
    each point estimate inside its range; the within-run rows are those of the study without other runs."""
    classes = ["last", "query_label"]
    attribution = {
        "s": constructed([0, 5, 9, 13], noise=1.5, seed=2, n_prompts=32),
        "t": constructed([0, 5, 9, 17], noise=1.5, seed=3, n_prompts=32),
    }
    runs = {"t": {"r1": constructed([0, 5, 9, 20], noise=1.5, seed=7, n_prompts=32)}}
    res = structure(attribution, classes, n=4, draws=80, seed=3, runs=runs)
    plain = structure(attribution, classes, n=4, draws=80, seed=3)
    assert res["null"] == plain["null"] and res["matrix"] == plain["matrix"]
    assert [{k: v for k, v in r.items() if k != "beyond_runs"} for r in res["consecutive"]] == plain["consecutive"]
    cuts = splits(32, 80, 3)
    both = {**attribution, **runs["t"]}
    tops = [{c: (top(x, a, 4), top(x, b, 4)) for c, x in both.items()} for a, b in cuts]
    cross = [(overlap(d["t"][0], d["r1"][1]) + overlap(d["r1"][0], d["t"][1])) / 2 for d in tops]
    null = [(overlap(*d["t"]) + overlap(*d["r1"])) / 2 for d in tops]
    got = res["between_runs"][0]
    assert got["overlap"]["value"] == pytest.approx(np.mean(cross), abs=1e-12)
    spread = [got["overlap"]["spread_low"], got["overlap"]["spread_high"]]
    assert spread == pytest.approx(np.percentile(cross, [2.5, 97.5]))
    assert got["null"]["value"] == pytest.approx(np.mean(null), abs=1e-12)
    assert got["overlap"]["low"] < got["overlap"]["value"] < got["overlap"]["high"]


def test_against_first_is_a_paired_difference():
    """The later checkpoint is right on every prompt the first is, and on 3 more of 30: every resampled mean of
    the paired differences is >= 0 and at most a few prompts' worth, which unpaired intervals would not give."""
    rng = np.random.default_rng(0)
    first = (rng.random(30) < 0.5).astype(int)
    later = first.copy()
    later[np.flatnonzero(first == 0)[:3]] = 1
    got = against_first([first.tolist(), later.tolist(), None])
    assert got[0] is None and got[2] is None
    assert got[1]["value"] == pytest.approx(0.1, abs=1e-12) and got[1]["n"] == 30
    assert 0 <= got[1]["low"] < 0.1 < got[1]["high"] <= 0.25


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
