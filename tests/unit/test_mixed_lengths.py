"""Records of several token lengths and templates through every stage: each stage's result on the mixed set
equals what its groups give alone (recombined by hand), in the records' order; mean ablation never averages
across templates; records given only named positions get a partition of position classes."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest
import torch
from conftest import capitals_rows, make_tiny, write_rows

from mechdiff.circuits.circuit import Circuit
from mechdiff.circuits.curve import faithfulness_curve, pair_scores, prompt_attribution, ranking
from mechdiff.circuits.measures import faithfulness, matrix_rows
from mechdiff.circuits.positions import position_scan, task_classes
from mechdiff.circuits.pruning import minimality
from mechdiff.circuits.scoring import Scorer
from mechdiff.common.components import Head
from mechdiff.common.metrics import answer_prob
from mechdiff.patching.ablation import site_means
from mechdiff.patching.core import run
from mechdiff.patching.evaluate import evaluate
from mechdiff.tasks.base import (
    Example,
    batch_tensors,
    check_reference,
    derived_classes,
    get_task,
    group_key,
    grouped_batches,
    pair_batch_tensors,
    take,
)
from mechdiff.tasks.jsonl import ImportErrors, import_pairs

N = 12  # three prompts of each of four templates (5, 8, 8 and 14 tokens), interleaved


def close(a, b) -> None:
    a, b = np.asarray(a, dtype=np.float64), np.asarray(b, dtype=np.float64)
    np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-5 * max(1.0, float(np.abs(b).max())))


@pytest.fixture
def task(smollm2_tokenizer, tmp_path):
    return get_task(
        import_pairs(
            write_rows(tmp_path / "capitals.jsonl", capitals_rows(N)), smollm2_tokenizer, tmp_path / "capitals"
        )
    )


@pytest.fixture
def pairs(task, smollm2_tokenizer):
    return task.discovery_pairs(smollm2_tokenizer, N)


@pytest.fixture
def records(pairs):
    return [p.base for p in pairs]


def by_group(items) -> dict:
    out: dict = {}
    for i, r in enumerate(items):
        out.setdefault(group_key(r), []).append(i)
    return out


def test_grouped_batches_are_of_one_template_and_length(records):
    assert len({len(r.input_ids) for r in records}) == 3 and len({r.template for r in records}) == 4
    batches = grouped_batches(records, 2)
    assert sorted(i for b in batches for i in b) == list(range(N))
    assert all(len({group_key(records[i]) for i in b}) == 1 and len(b) <= 2 and b == sorted(b) for b in batches)
    one = [r for r in records if r.template == "short"]
    assert grouped_batches(one, 2) == [[0, 1], [2]]  # one group: consecutive slices, as before
    with pytest.raises(ValueError, match="different token lengths"):
        batch_tensors(records)


def test_evaluate_keeps_each_prompt_in_place(tiny_llama, records):
    res = evaluate(tiny_llama, records, batch_size=2, progress=False)
    for i, r in enumerate(records):  # each prompt alone
        logits = run(tiny_llama, torch.tensor([r.input_ids])).logits
        close(res.prob[i], answer_prob(logits, torch.tensor([r.answer_id]))[0])
        assert res.correct[i] == (int(logits.argmax(-1)) == r.answer_id)
    assert res.logit_diff is not None and res.logit_diff.shape == (N,)


def test_two_templates_score_as_each_template_alone_then_pooled(tiny_llama, pairs):
    """Two templates of one length (8 tokens): pooled, every prompt scores as in its own template's scorer, whose
    means come from its template only; means pooled across the two templates score differently."""
    two = [p for p in pairs if p.base.template in ("known", "say")]
    assert len({len(p.base.input_ids) for p in two}) == 1
    circuit = [(Head(0, 1), "last"), (Head(1, 2), "country"), (Head(2, 0), "last"), (Head(1, 3), "capital")]
    pooled = Scorer.build(tiny_llama, [p.base for p in two], [p.source for p in two], batch_size=4, progress=False)
    assert set(pooled.means) == {("known", 8), ("say", 8)}
    got = pooled.keep(circuit)
    for template in ("known", "say"):
        rows = [i for i, p in enumerate(two) if p.base.template == template]
        alone = Scorer.build(tiny_llama, [two[i].base for i in rows], [two[i].source for i in rows], progress=False)
        want = alone.keep(circuit)
        close(got.prob[rows], want.prob)
        assert (got.correct[rows] == want.correct).all()
    # the rule matters: one mean over both templates (same length) gives other probabilities
    ids = torch.tensor([p.source.input_ids for p in two])
    mixed = Scorer(tiny_llama, [p.base for p in two], site_means(tiny_llama, [ids]), progress=False)
    assert not np.allclose(mixed.keep(circuit).prob, got.prob, rtol=1e-3)
    f = faithfulness(pooled, Circuit("m", "t", {"last": [Head(0, 1)]}, {"last": "last"}))
    assert f["n_prompts"] == len(two)


def test_a_group_without_reference_prompts_is_refused_before_any_forward_pass(pairs):
    records = [p.base for p in pairs]
    reference = [p.source for p in pairs if p.base.template != "say"]
    with pytest.raises(ValueError, match="no reference prompts for the prompts of template 'say', 8 tokens"):
        Scorer.build(None, records, reference)  # no model: refused before it is touched
    check_reference(records, [p.source for p in pairs])


def test_scoring_stages_on_mixed_lengths(tiny_llama, pairs):
    """Pruning's incremental runs, attribution per prompt, the position scan, the curve and the matrix on
    prompts of three lengths; each group's values are those of the group scored alone."""
    records, reference = [p.base for p in pairs], [p.source for p in pairs]
    scorer = Scorer.build(tiny_llama, records, reference, batch_size=4, progress=False)
    classes = task_classes(scorer)
    assert classes == ["before", "capital", "after_capital", "country", "after_country", "last"]
    circuit = [(Head(0, 1), "last"), (Head(1, 2), "country"), (Head(2, 0), "after_capital")]
    removed = {(Head(1, 2), "country")}
    close(
        scorer.keep_without(circuit, removed).prob,
        Scorer.build(tiny_llama, records, reference, batch_size=4, progress=False).keep(set(circuit) - removed).prob,
    )
    attribution = prompt_attribution(scorer, classes)
    for rows in by_group(records).values():
        alone = Scorer.build(tiny_llama, take(records, rows), [reference[i] for i in rows], progress=False)
        torch.testing.assert_close(attribution[rows], prompt_attribution(alone, classes), rtol=1e-4, atol=1e-6)
        close(scorer.keep(circuit).prob[rows], alone.keep(circuit).prob)
    scan = position_scan(scorer, classes, max_steps=2)
    assert scan["n_prompts"] == N and len(scan["steps"]) == 2
    ranked = ranking(pair_scores(attribution.mean(0), classes))
    curve = faithfulness_curve(scorer, ranked, sizes=[0.1, 1.0])
    # every (head, class) pair kept is the model itself: the classes partition every prompt
    assert curve["rows"][-1]["faithfulness_prob"]["value"] == pytest.approx(1.0)
    c = Circuit(
        "m", "t", {"last": [Head(0, 1), Head(2, 0)], "country": [Head(1, 2)]}, {"last": "last", "country": "country"}
    )
    assert matrix_rows("m", {"c": c}, scorer, n_random=1)[0]["n_prompts"] == N
    assert set(minimality(scorer, c)["pairs"]) == {"L0H1@last", "L2H0@last", "L1H2@country"}


def test_path_patching_and_attribution_pool_groups_as_one_ratio_of_means(tiny_llama, pairs):
    from mechdiff.patching.attribution import attribution_scores
    from mechdiff.patching.path import Receivers, path_patch
    from mechdiff.patching.path_pairs import PairBatches, prepare

    senders = [Head(0, 0), Head(0, 3), Head(1, 1)]
    receivers = Receivers((Head(2, 1),), "q", "last")
    batch = prepare(tiny_llama, pairs)
    assert isinstance(batch, PairBatches) and len(batch.parts) == 4 and len(batch) == N
    for recv in (None, receivers):
        exact = path_patch(tiny_llama, batch, senders, "country", recv, progress=False)
        estimate = attribution_scores(tiny_llama, batch, "country", recv, senders)
        want_exact, want_estimate, total = dict.fromkeys(senders, 0.0), dict.fromkeys(senders, 0.0), 0.0
        for rows in by_group(pairs).values():  # each group alone, recombined: sum_g c_g s_g / sum_g c_g
            part = prepare(tiny_llama, take(pairs, rows))
            c = float(part.p_clean.sum())
            total += c
            for h, s in path_patch(tiny_llama, part, senders, "country", recv, progress=False).items():
                want_exact[h] += c * s
            for h, s in attribution_scores(tiny_llama, part, "country", recv, senders).items():
                want_estimate[h] += c * s
        close([exact[h] for h in senders], [want_exact[h] / total for h in senders])
        close([estimate[h] for h in senders], [want_estimate[h] / total for h in senders])


def test_scan_averages_each_group_by_its_size(tiny_llama, pairs):
    from mechdiff.patching.scan import scan, scan_pairs

    mixed = scan_pairs(tiny_llama, pairs, "z", "country", per_pass=8)
    want = torch.zeros_like(mixed.effects, dtype=torch.float64)
    for rows in by_group(pairs).values():
        t = pair_batch_tensors(take(pairs, rows))
        one = scan(
            tiny_llama,
            t["base"]["input_ids"],
            t["source"]["input_ids"],
            t["target_ids"],
            "z",
            t["base"]["positions"]["country"],
            per_pass=8,
        )
        want += one.effects.double() * len(rows) / N
    close(mixed.effects, want)
    with pytest.raises(ValueError, match="lengths \\[5, 8, 14\\]"):
        scan_pairs(tiny_llama, pairs, "resid", None)


def test_dcm_cache_on_mixed_lengths_equals_each_pair_alone(tiny_llama, task, smollm2_tokenizer):
    from mechdiff.methods.dcm_cache import PairCache, masked_z_patches, source_z

    pairs = task.desideratum("counterfactual", smollm2_tokenizer, N)
    heads = [Head(1, 0), Head(2, 3)]
    cache = PairCache.build(tiny_llama, pairs, [(heads, "country")], batch_size=3)
    rows = [7, 0, 11, 4, 2, 9]  # any order, groups mixed
    mask = torch.tensor([0.25, 0.0])
    logits, target = cache.logits(tiny_llama, rows, heads, mask, "country")
    for j, i in enumerate(rows):
        b = pair_batch_tensors([pairs[i]])
        values = source_z(tiny_llama, b, [1, 2], "country")
        plain = run(
            tiny_llama,
            b["base"]["input_ids"],
            masked_z_patches(tiny_llama, heads, mask, values, b["base"]["positions"]["country"]),
        ).logits
        close(logits[j], plain[0])
        assert int(target[j]) == pairs[i].target_id
        unpatched = run(tiny_llama, b["base"]["input_ids"]).logits.argmax(-1)
        assert cache.floor[i] == (int(unpatched) == pairs[i].target_id)


def test_cmap_on_mixed_lengths_keeps_each_prompt_in_place(tiny_llama, smollm2_tokenizer, records):
    from mechdiff.methods.cmap import run_cmap

    finetune = make_tiny("llama", smollm2_tokenizer, seed=1)
    circuit = Circuit("m", "t", {"last": [Head(2, 1)], "country": [Head(1, 0)]}, {"last": "last", "country": "country"})
    res = run_cmap(tiny_llama, finetune, circuit, records, ["z", "qk"], batch_size=2, progress=False)
    assert res.settings["n_prompts"] == N
    for rows in by_group(records).values():
        alone = run_cmap(tiny_llama, finetune, circuit, take(records, rows), ["z", "qk"], progress=False)
        for key, values in alone.outcomes.items():
            assert [res.outcomes[key][i] for i in rows] == values


def test_store_captures_mixed_lengths_at_a_named_position(tiny_llama, records, tmp_path):
    from mechdiff.patching.store import ActivationStore, capture_sites

    store = ActivationStore(tmp_path / "acts.h5")
    entry = store.get_or_compute(tiny_llama, records, "z", "country", batch_size=2, progress=False)
    for i, r in enumerate(records):
        close(entry.read(1, [i])[0], capture_sites(tiny_llama, [r], "z", "country")[1][0])
    with pytest.raises(ValueError, match="cannot share one array of every position"):
        store.get_or_compute(tiny_llama, records, "z", "all", progress=False)
    with pytest.raises(ValueError, match="one group"):
        store.means(tiny_llama, records, "z", progress=False)


def test_records_with_only_named_positions_get_a_partition_of_classes():
    ids = tuple(range(100, 112))
    a = Example("p", ids, " x", 1, {"S": 2, "IO": (5, 6), "END": 11, "last": 11})
    b = dataclasses.replace(a, positions={"S": 7, "IO": (3, 4), "END": 11, "last": 11})
    masks = derived_classes([a, b], 12)
    assert list(masks) == ["before", "S", "after_S", "IO", "after_IO", "END", "after_END", "last"]
    where = {k: [m[row].nonzero().flatten().tolist() for row in range(2)] for k, m in masks.items()}
    assert where["before"] == [[0, 1], [0, 1, 2]]
    assert where["S"] == [[2], [7]] and where["after_S"] == [[3, 4], [8, 9, 10]]
    assert where["IO"] == [[5, 6], [3, 4]] and where["after_IO"] == [[7, 8, 9, 10], [5, 6]]
    assert where["last"] == [[11], [11]] and where["END"] == [[], []]  # the last token is "last"'s
    assert (torch.stack(list(masks.values())).sum(0) == 1).all()  # a partition of every prompt
    assert set(batch_tensors([a, b])["position_classes"]) == set(masks)


def test_jsonl_classes_of_a_row_are_the_batch_classes(smollm2_tokenizer, tmp_path):
    task = get_task(
        import_pairs(
            write_rows(tmp_path / "c.jsonl", capitals_rows(4, classes=True)), smollm2_tokenizer, tmp_path / "task"
        )
    )
    records = task.records(smollm2_tokenizer, 4)
    for r in records:
        assert r.classes["words"] == tuple(range(r.positions["capital"], r.positions["country"] + 1))
        masks = batch_tensors([r])["position_classes"]
        assert sorted(masks) == ["last", "rest", "words"]  # `last` always; `rest`: the tokens no class covers
        for name in masks:
            assert masks[name][0].nonzero().flatten().tolist() == list(r.classes[name])
        assert r.classes["last"] == (len(r.input_ids) - 1,)
        assert sorted(sum((list(r.classes[c]) for c in masks), [])) == list(range(len(r.input_ids)))
    rows = capitals_rows(4, classes=True)
    rows[1]["classes"] = {"other": rows[1]["classes"]["words"]}
    first = rows[2]["clean"].split()[0]
    rows[2]["classes"] = {"words": [[0, len(first) - 1]]}  # half a word: not on token boundaries
    rows[3]["classes"] = {"words": [[0, len(rows[3]["clean"].split()[0])]]}  # a whole word is fine
    with pytest.raises(ImportErrors) as err:
        import_pairs(write_rows(tmp_path / "bad.jsonl", rows), smollm2_tokenizer, tmp_path / "bad")
    text = str(err.value)
    assert "bad.jsonl:2: classes ['other'] differ from line 1's ['words']" in text
    assert "bad.jsonl:3: position 'class words'" in text and "not on token boundaries" in text
    assert "bad.jsonl:4" not in text and "bad.jsonl:1" not in text and not (tmp_path / "bad").exists()
