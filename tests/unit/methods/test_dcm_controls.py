"""DCM's controls as distributions: random heads matched to the selection's layers and position, each draw's
per-pair outcomes kept, and the paired tests of the patched heads against the floor and the random heads."""

from __future__ import annotations

from collections import Counter
from types import SimpleNamespace

import numpy as np
import pytest
from scipy import stats as sps

from mechdiff.common.components import Head
from mechdiff.common.outcomes import from_bits, read_outcomes, write_outcomes
from mechdiff.methods.dcm import DCMConfig, random_heads, run_dcm, split_pairs
from mechdiff.methods.dcm_cache import target_accuracy
from mechdiff.methods.semantic import semantic_patching
from mechdiff.report.paired import outcome_stages
from mechdiff.report.rows import semantic_rows
from mechdiff.tasks.entity_tracking import object_value_pairs
from unit.methods.planted import PLANTED, planted_case


@pytest.fixture(scope="module")
def planted(smollm2_tokenizer):
    return planted_case(smollm2_tokenizer, object_value_pairs(smollm2_tokenizer, 48, n_boxes=3, seed=0))


def _layers(heads) -> Counter:
    return Counter(h.layer for h in heads)


def test_random_heads_are_drawn_from_the_selected_heads_layers():
    model = SimpleNamespace(shape=SimpleNamespace(n_layers=6, n_heads=8))
    selected = [Head(1, 2), Head(4, 0), Head(4, 5)]
    group = selected + [Head(0, 1), Head(5, 3)]
    draws = random_heads(model, group, selected, DCMConfig(), 50, seed=3)
    assert len(draws) == 50 and all(_layers(d) == _layers(selected) for d in draws)
    assert len({tuple(d) for d in draws}) > 10  # heads differ between draws
    assert draws == random_heads(model, group, selected, DCMConfig(), 50, seed=3)
    anywhere = random_heads(model, group, selected, DCMConfig(random_pool="all"), 50, seed=3)
    assert any(_layers(d) != _layers(selected) for d in anywhere)
    assert random_heads(model, group, [], DCMConfig(), 5, 0) == []


def test_dcm_random_heads_lie_in_the_selections_layers_at_its_position(planted):
    model, pairs = planted
    candidates = [PLANTED, Head(2, 0), Head(0, 1), Head(1, 3)]
    config = DCMConfig(epochs=3, batch_size=8, eval_every=3, n_random=4, seed=0)
    res = run_dcm(model, candidates, "last", pairs, config, desideratum="planted", progress=False)
    assert PLANTED in res.selected and len(res.random_heads) == 4
    test = split_pairs(pairs, config.split, config.seed)[2]
    for heads, outcomes in zip(res.random_heads, res.random_outcomes):
        assert _layers(heads) == _layers(res.selected)
        # patched at the selection's own position: what a plain patched run there gives
        assert outcomes == target_accuracy(model, test, heads, "last").astype(int).tolist()
    stored = res.to_dict()
    assert [from_bits(b).tolist() for b in stored["random_outcomes"]] == res.random_outcomes
    assert res.random.value == pytest.approx(np.mean(res.random_outcomes))


def test_semantic_tests_pair_the_patched_heads_with_the_floor_and_the_random_heads(planted, tmp_path):
    model, pairs = planted
    pairs = pairs[:20]
    selected = [PLANTED, Head(1, 2)]
    (res,) = semantic_patching([model], selected, "last", pairs, batch_size=8, progress=False, n_random=6, seed=2)
    assert len(res.random_outcomes) == 6 and all(_layers(h) == _layers(selected) for h in res.random_heads)
    for heads, outcomes in zip(res.random_heads, res.random_outcomes):
        assert outcomes == target_accuracy(model, pairs, heads, "last").astype(int).tolist()
    row = {"group": "A", "desideratum": "planted", "heads": [h.name for h in selected], **res.to_dict()}
    # patched against the floor: the exact binomial test on the discordant pairs
    a, f = np.array(res.outcomes), np.array(res.floor_outcomes)
    n10, n01 = int(((a == 1) & (f == 0)).sum()), int(((a == 0) & (f == 1)).sum())
    assert n10 + n01 > 0
    assert row["vs_floor"]["p"] == pytest.approx(sps.binomtest(n10, n10 + n01, 0.5).pvalue)
    assert row["vs_floor"]["estimate"] == pytest.approx((n10 - n01) / len(pairs))
    share = np.mean(res.random_outcomes, 0)
    assert row["vs_random"]["estimate"] == pytest.approx(a.mean() - share.mean())
    (table,) = semantic_rows([row])
    assert table["floor_p"] == row["vs_floor"]["p"] and table["minus_random"] == row["vs_random"]["estimate"]
    # floor and draws reach outcomes.json and come back
    dcm = SimpleNamespace(result={"semantic": [row]})
    write_outcomes(tmp_path, outcome_stages({}, {}, dcm))
    back = read_outcomes(tmp_path)["semantic"][f"A/planted in {model.name}"]
    assert from_bits(back["floor"]).tolist() == res.floor_outcomes
    assert [from_bits(b).tolist() for b in back["random"]] == res.random_outcomes
    assert from_bits(back["correct"]).tolist() == res.outcomes


def test_encodes_rests_on_the_paired_tests_of_the_dcm_models_semantic_row():
    """The paired exact test decides (in the family "what the heads encode", here of one test), not two separate
    intervals: 6 discordant pairs all one way (p = 0.031) is "encodes" where the intervals overlap; 4 (p = 0.125)
    is "not shown"."""
    from mechdiff.common.inference import proportion
    from mechdiff.methods.semantic import SemanticResult
    from mechdiff.studies.circuits.report.dcm import dcm_findings, dcm_tests

    def record(n_up: int) -> SimpleNamespace:
        patched, floor = [1] * n_up + [0] * 36, [0] * (n_up + 36)
        sem = SemanticResult("base", proportion(patched), proportion(floor), patched, floor)
        dcm = {"group": "A", "desideratum": "object", "selected": ["L2H1"], "heads": ["L2H1"]}
        dcm |= {"test_accuracy": sem.accuracy.to_dict(), "floor": sem.floor.to_dict(), "random": None}
        return SimpleNamespace(result={"model": "base", "dcm": [dcm], "semantic": [{**dcm, **sem.to_dict()}]})

    few, many = (dcm_findings(r, dcm_tests(r, "base")) for r in (record(4), record(6)))
    assert proportion([1] * 6 + [0] * 36).low < proportion([0] * 42).high  # the intervals overlap
    assert "is not shown to encode" in few and "p = 0.12" in few
    assert "group A encodes **object**" in many and "p = 0.031" in many
