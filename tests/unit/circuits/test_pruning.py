"""Pruning by minimality (mechdiff.circuits.pruning): the greedy rule on a fake scorer and on tiny models, the
paper's pairwise rule on a hand-built table and against a direct computation, and the pruned circuit's record."""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, field

import numpy as np
import pytest

from mechdiff.circuits.circuit import Circuit
from mechdiff.circuits.pruning import minimality, pair_name, pairwise_minimality, paper_ratio, prune
from mechdiff.circuits.scoring import Scorer, per_prompt
from mechdiff.common.components import Head, parse_heads
from mechdiff.patching.evaluate import EvalResult
from mechdiff.tasks.entity_tracking import reference_records
from unit.circuits.conftest import N_BOXES
from unit.circuits.test_scoring import FakeScorer, _or_circuit


def test_minimality_prunes_heads_that_cannot_matter(tiny_llama, records, smollm2_tokenizer):
    model = tiny_llama
    d = model.shape.d_head
    model.model.model.layers[1].self_attn.o_proj.weight[:, 3 * d : 4 * d] = 0  # L1H3 writes nothing
    circuit = Circuit(
        "tiny", "et", {"A": [Head(2, 0), Head(1, 0), Head(1, 3)], "C": [Head(2, 2)]}, {"A": "last", "C": "query_label"}
    )  # L2H2 at a non-final position of the last layer
    scorer = Scorer.build(model, records, reference_records(smollm2_tokenizer, 6, N_BOXES, 1), 6, False)
    res = minimality(scorer, circuit, max_steps=1, n_candidates=None, metric="prob")
    scores = res["pairs"]
    assert scores["L1H3@last"]["contribution"] == 0.0
    assert scores["L2H2@query_label"]["contribution"] == 0.0
    assert scores["L2H0@last"]["contribution"] > 0 and scores["L1H0@last"]["contribution"] > 0
    assert all(len(s["K"]) <= 1 for s in scores.values())
    pruned = prune(circuit, res, threshold=0.0)
    assert pruned.groups == {"A": [Head(2, 0), Head(1, 0)], "C": []}
    meta = pruned.meta["pruned"]
    assert (
        meta["threshold"] == 0.0 and meta["metric"] == "prob" and meta["removed"] == ["L1H3@last", "L2H2@query_label"]
    )
    assert Circuit.from_dict(json.loads(json.dumps(pruned.to_dict()))).meta["pruned"]["threshold"] == 0.0
    with pytest.raises(ValueError, match="no minimality score"):
        prune(Circuit("t", "et", {"B": [Head(0, 0)]}, {"B": "last"}), res)


def test_prune_keeps_pairs_above_the_threshold_and_records_it():
    from mechdiff.circuits.pruning import prune

    c = Circuit(
        "m", "t", {"A": parse_heads(["L1H0", "L1H1"]), "B": parse_heads(["L0H2"])}, {"A": "last", "B": "query_label"}
    )
    result = {
        "metric": "prob",
        "max_steps": 1,
        "n_candidates": 4,
        "seed": 0,
        "n_prompts": 8,
        "full": 0.5,
        "pairs": {
            "L1H0@last": {"relative": 0.2},
            "L1H1@last": {"relative": 0.01},
            "L0H2@query_label": {"relative": -0.3},
        },
    }
    pruned = prune(c, result, threshold=0.01)
    assert pruned.groups == {"A": [Head(1, 0)], "B": []}
    assert pruned.meta["pruned"]["threshold"] == 0.01
    assert pruned.meta["pruned"]["removed"] == ["L0H2@query_label", "L1H1@last"]
    assert pruned.meta["pruned"]["sizes_before"] == {"A": 2, "B": 1}
    assert pruned.scores["minimality"]["L0H2@query_label"] == -0.3
    assert prune(c, result, threshold=-1.0).groups == c.groups


def test_minimality_grows_k_to_expose_redundant_heads():
    from mechdiff.circuits.pruning import minimality

    circuit, scorer, (a, b, c) = _or_circuit()
    acc_full = float(np.mean([i % 5 != 0 for i in range(12)]))
    res = minimality(scorer, circuit, max_steps=1, n_candidates=None, seed=3, metric="accuracy")
    assert res["full"] == pytest.approx(acc_full) and res["metric"] == "accuracy" and res["n_prompts"] == 12
    assert (res["max_steps"], res["n_candidates"], res["seed"]) == (1, None, 3)
    # alone, removing a changes nothing (b covers it); with K = {b} removing a breaks the task
    assert res["pairs"]["L2H0@last"] == {
        "contribution": pytest.approx(acc_full),
        "relative": pytest.approx(1.0),
        "relative_full": pytest.approx(1.0),
        "K": ["L2H1@last"],
        "searched": True,
    }
    assert res["pairs"]["L2H1@last"]["K"] == ["L2H0@last"]
    assert res["pairs"]["L0H3@query_label"]["contribution"] == 0.0  # c never matters: K stays empty
    assert res["pairs"]["L0H3@query_label"]["K"] == []
    default = minimality(scorer, circuit, max_steps=1, n_candidates=None)  # accuracy, seed 0 by default
    assert (default["metric"], default["seed"]) == ("accuracy", 0) and default["pairs"] == res["pairs"]
    none = minimality(scorer, circuit, max_steps=0, metric="accuracy")
    assert none["pairs"]["L2H0@last"]["contribution"] == 0.0 and none["pairs"]["L2H0@last"]["K"] == []


def test_minimality_threshold_skips_only_searches_that_cannot_change_pruning():
    """A pair already above the threshold at K = {} keeps its place whatever K adds, so skipping its search
    prunes the same circuit with fewer evaluations; the searched pairs get the same K as without skipping."""
    from mechdiff.circuits.pruning import minimality, prune

    a, b, c = (Head(2, 0), "last"), (Head(2, 1), "last"), (Head(0, 3), "query_label")
    circuit = Circuit("m", "t", {"A": [a[0], b[0]], "B": [c[0]]}, {"A": "last", "B": "query_label"})
    rule = lambda kept: b in kept and (a in kept or c in kept)  # noqa: E731 - b needed, a and c redundant
    full_search, skipping = FakeScorer([a, b, c], rule), FakeScorer([a, b, c], rule)
    want = minimality(full_search, circuit, max_steps=1, n_candidates=None, seed=1)
    got = minimality(skipping, circuit, max_steps=1, n_candidates=None, seed=1, threshold=0.01)
    assert got["threshold"] == 0.01 and want["threshold"] is None
    assert got["pairs"]["L2H1@last"]["searched"] is False and got["pairs"]["L2H1@last"]["K"] == []
    assert got["pairs"]["L2H1@last"]["relative"] > 0.01
    for name in ("L2H0@last", "L0H3@query_label"):  # below the threshold alone: searched, as without skipping
        assert got["pairs"][name] == want["pairs"][name] and got["pairs"][name]["K"]
    assert prune(circuit, got, 0.01).to_dict()["groups"] == prune(circuit, want, 0.01).to_dict()["groups"]
    assert len(skipping.calls) < len(full_search.calls)  # the skipped search evaluated nothing
    # the threshold is relative to F(C) = 0.75: L2H1's contribution 0.75 is 1.0 of it, above 0.8
    high = minimality(FakeScorer([a, b, c], rule), circuit, max_steps=1, n_candidates=None, seed=1, threshold=0.8)
    assert high["circuit"] == 0.75 and high["pairs"]["L2H1@last"]["searched"] is False


def test_minimality_prob_metric_and_candidates():
    from mechdiff.circuits.pruning import minimality

    circuit, scorer, _ = _or_circuit()
    res = minimality(scorer, circuit, max_steps=2, n_candidates=1, seed=0, metric="prob")
    full = float(np.mean(scorer.base + 0.3))
    assert res["full"] == pytest.approx(full)
    for r in res["pairs"].values():  # removing one more pair lowers every prompt's probability by 0.1
        assert r["contribution"] == pytest.approx(0.1) and r["relative"] == pytest.approx(0.1 / full)
        assert r["K"] == []  # no K raises a contribution that is the same for every K


def test_minimality_draws_candidates_with_its_seed():
    """With fewer candidates than other pairs, the candidates are a seeded draw: K comes from that draw."""
    from mechdiff.circuits.pruning import minimality

    pairs = [(Head(2, h), "last") for h in range(4)]
    circuit = Circuit("m", "t", {"A": [p[0] for p in pairs]}, {"A": "last"})
    # the task works while any of the four is kept: removing v matters only once the other three are in K
    scorer = FakeScorer(pairs, lambda kept: bool(kept & frozenset(pairs)))
    exhaustive = minimality(scorer, circuit, max_steps=3, n_candidates=None, metric="accuracy")
    for r in exhaustive["pairs"].values():
        assert r["contribution"] == 0.0 and r["K"] == []  # no single step raises it: greedy stops at once
    two = FakeScorer(pairs[:2], lambda kept: bool(kept & frozenset(pairs[:2])))
    c2 = Circuit("m", "t", {"A": [pairs[0][0], pairs[1][0]]}, {"A": "last"})
    for n_candidates in (1, 2, None):  # one other pair: every candidate count finds it
        r = minimality(two, c2, max_steps=1, n_candidates=n_candidates, metric="accuracy")
        assert r["pairs"]["L2H0@last"]["K"] == ["L2H1@last"] and r["pairs"]["L2H0@last"]["contribution"] > 0
    chain = FakeScorer(pairs, lambda kept: pairs[0] in kept and (pairs[1] in kept or pairs[2] in kept))
    seen = set()
    for seed in range(12):
        r = minimality(chain, circuit, max_steps=1, n_candidates=1, seed=seed, metric="accuracy")
        k = r["pairs"]["L2H1@last"]["K"]
        assert k in ([], ["L2H2@last"])  # only H2 raises H1's contribution; a draw of H0 or H3 does not
        seen.add(tuple(k))
        again = minimality(chain, circuit, max_steps=1, n_candidates=1, seed=seed, metric="accuracy")
        assert again["pairs"] == r["pairs"]  # seeded
    assert seen == {(), ("L2H2@last",)}  # the draw depends on the seed


def _four():
    pairs = [(Head(2, h), "last") for h in range(4)]
    return pairs, Circuit("m", "t", {"A": [p[0] for p in pairs]}, {"A": "last"})


def test_minimality_takes_the_first_best_candidate_and_its_value():
    """H1 matters only once H2 or H3 (a tie) is removed with it: greedy K is the first of the tied
    candidates in circuit order, and the stop test compares the best candidate's value, not the last pair's."""
    from mechdiff.circuits.pruning import minimality

    pairs, circuit = _four()
    h0, h1, h2, h3 = pairs
    tie = FakeScorer(pairs, lambda kept: h1 in kept and not (h2 in kept and h3 in kept))
    for seed in range(8):  # three candidates for three other pairs: no draw, the same K for every seed
        r = minimality(tie, circuit, max_steps=1, n_candidates=3, seed=seed, metric="accuracy")
        assert r["pairs"]["L2H1@last"]["K"] == ["L2H2@last"], seed
    only_h2 = FakeScorer(pairs, lambda kept: h0 in kept and (h1 in kept or h2 in kept))
    r = minimality(only_h2, circuit, max_steps=1, n_candidates=None, metric="accuracy")
    assert r["pairs"]["L2H1@last"]["K"] == ["L2H2@last"]  # the last pair (H3) raises nothing


def test_minimality_defaults_and_a_model_that_is_never_right():
    from mechdiff.circuits.pruning import minimality

    pairs, circuit = _four()
    never = FakeScorer(pairs, lambda kept: False)
    r = minimality(never, circuit, metric="accuracy")
    assert (r["max_steps"], r["n_candidates"], r["seed"], r["full"]) == (1, 4, 0, 0.0)
    assert all(math.isnan(p["relative"]) and p["contribution"] == 0.0 for p in r["pairs"].values())


def test_prune_records_every_setting_and_keeps_the_circuit_identity():
    from mechdiff.circuits.pruning import prune

    c = Circuit(
        "m", "t", {"A": parse_heads(["L1H0", "L1H1"])}, {"A": "last"}, names={"A": "fetchers"}, meta={"source": "x"}
    )
    result = {
        "metric": "prob",
        "max_steps": 2,
        "n_candidates": 3,
        "seed": 5,
        "n_prompts": 8,
        "full": 0.5,
        "pairs": {"L1H0@last": {"relative": 0.011}, "L1H1@last": {"relative": 0.009}},
    }
    pruned = prune(c, result)  # threshold 0.01 by default
    assert pruned.groups == {"A": [Head(1, 0)]}
    assert (pruned.model, pruned.task, pruned.names, pruned.positions) == ("m", "t", {"A": "fetchers"}, {"A": "last"})
    assert pruned.meta == {
        "source": "x",
        "pruned": {
            "rule": "greedy",
            "threshold": 0.01,
            "relative_to": "F(M)",
            "metric": "prob",
            "max_steps": 2,
            "n_candidates": 3,
            "seed": 5,
            "n_prompts": 8,
            "removed": ["L1H1@last"],
            "sizes_before": {"A": 2},
        },
    }
    with pytest.raises(ValueError, match="no minimality score for L1H1@last"):
        prune(c, {**result, "pairs": {"L1H0@last": {"relative": 1.0}}})


@dataclass
class TableScorer:
    """A scorer whose F(C \\ S) is read from a table (answer probability, one prompt), for hand-written ratios."""

    pairs: list
    table: dict  # frozenset(removed pair names) -> F
    full_value: float = 1.0
    records: list = field(default_factory=lambda: [None])
    progress: bool = False
    asked: list = field(default_factory=list)

    def _result(self, value: float) -> EvalResult:
        return EvalResult(np.array([value > 0.5]), np.array([value]))

    def full(self) -> EvalResult:
        return self._result(self.full_value)

    def keep(self, pairs) -> EvalResult:
        removed = frozenset(pair_name(p) for p in self.pairs if p not in set(pairs))
        self.asked.append(removed)
        return self._result(self.table[removed])

    def keep_without(self, pairs, removed) -> EvalResult:
        return self.keep([p for p in pairs if p not in set(removed)])


def test_paper_ratio_is_signed_and_relative_to_the_smaller_circuit():
    assert paper_ratio(0.5, 0.4) == pytest.approx(0.5 / 0.4 - 1)  # removing v drops F: +0.25
    assert paper_ratio(0.4, 0.5) == pytest.approx(-0.2)  # removing v raises F: negative, never kept
    assert paper_ratio(0.3, 0.0) == math.inf and paper_ratio(0.0, 0.0) == 0.0


def test_paper_pruning_decision_on_a_hand_built_circuit():
    """Group A = {a, b, c, d} (K: at most ceil(0.3 * 4) = 2 heads), group C = {e}. Every F(C \\ S) is
    written out; the decisions follow F(C\\K) / F(C\\(K+v)) - 1 >= 0.01 and differ from the greedy rule."""
    a, b, c, d, e = Head(2, 0), Head(2, 1), Head(1, 0), Head(1, 1), Head(0, 0)
    circuit = Circuit("t", "et", {"A": [a, b, c, d], "C": [e]}, {"A": "last", "C": "query_label"})
    pairs = circuit.pairs()
    n = {h: pair_name((h, pos)) for h, pos in pairs}
    F = {
        frozenset(): 0.80,
        frozenset({n[a]}): 0.70,
        frozenset({n[b]}): 0.75,
        frozenset({n[c]}): 0.78,
        frozenset({n[d]}): 0.85,
        frozenset({n[e]}): 0.40,
    }
    pair_values = {(a, b): 0.50, (a, c): 0.69, (a, d): 0.70, (b, c): 0.74, (b, d): 0.76, (c, d): 0.80}
    for (u, v), value in pair_values.items():
        F[frozenset({n[u], n[v]})] = value
    # the K + v sets the rule reaches (derived below; a set the rule asks for and the table lacks fails the test)
    F[frozenset({n[a], n[b], n[d]})] = 0.51
    F[frozenset({n[a], n[c], n[d]})] = 0.69
    scorer = TableScorer(pairs, F)
    res = pairwise_minimality(scorer, circuit, metric="prob", threshold=0.01)
    r = res["pairs"]
    # v = a: scores of u = F(C\u) - F(C\{u,a}): b 0.75-0.50=0.25, c 0.78-0.69=0.09, d 0.85-0.70=0.15
    # -> top 2 = {b, d}; F(C\{b,d}) = 0.76, F(C\{a,b,d}) = 0.51: 0.76/0.51 - 1 = 0.490 -> kept
    assert r[n[a]]["K"] == sorted([n[b], n[d]])
    assert r[n[a]]["score"] == pytest.approx(0.76 / 0.51 - 1) and r[n[a]]["kept"]
    # v = d: b 0.75-0.76=-0.01, a 0.70-0.70=0, c 0.78-0.80=-0.02: no positive score, K = {}
    # F(C) / F(C\d) - 1 = 0.80/0.85 - 1 = -0.059 -> removed (the greedy rule keeps it: |0.85-0.80|/0.80 > 0.01)
    assert r[n[d]]["K"] == [] and r[n[d]]["score"] == pytest.approx(0.80 / 0.85 - 1) and not r[n[d]]["kept"]
    # v = b: a 0.70-0.50=0.20, c 0.78-0.74=0.04, d 0.85-0.76=0.09 -> K = {a, d}: 0.70/0.51 - 1 = 0.373 -> kept
    assert r[n[b]]["K"] == sorted([n[a], n[d]]) and r[n[b]]["score"] == pytest.approx(0.70 / 0.51 - 1)
    # v = c: a 0.70-0.69=0.01, b 0.75-0.74=0.01, d 0.85-0.80=0.05 -> top 2 = {d, a} (a before b: circuit order)
    # F(C\{a,d}) = 0.70, F(C\{a,c,d}) = 0.69: 0.70/0.69 - 1 = 0.0145 -> kept
    assert r[n[c]]["K"] == sorted([n[a], n[d]]) and r[n[c]]["score"] == pytest.approx(0.70 / 0.69 - 1)
    assert r[n[c]]["kept"]
    # group C has one head: ceil(0.3) = 1 slot but no other head, K = {}; 0.80/0.40 - 1 = 1 -> kept
    assert r[n[e]]["K"] == [] and r[n[e]]["score"] == pytest.approx(1.0)
    # only removals within a group are asked for: no set mixes e with A's heads
    assert not any(n[e] in s and len(s) > 1 for s in scorer.asked)
    pruned = prune(circuit, res, threshold=0.01)
    kept_a = [h for h in (a, b, c, d) if r[n[h]]["kept"]]
    assert pruned.groups == {"A": kept_a, "C": [e]} and d not in kept_a
    assert pruned.meta["pruned"]["rule"] == "paper" and pruned.meta["pruned"]["share"] == 0.3
    # the same scores at a threshold above c's 0.0145 drop c
    assert c not in prune(circuit, res, threshold=0.02).groups["A"]


def test_paper_pruning_matches_a_direct_computation_on_a_tiny_model(tiny_llama, records, smollm2_tokenizer):
    reference = reference_records(smollm2_tokenizer, 6, N_BOXES, 1)
    circuit = Circuit(
        "tiny",
        "et",
        {"A": [Head(2, 0), Head(1, 0), Head(1, 3), Head(2, 3)], "C": [Head(2, 2)]},
        {"A": "last", "C": "query_label"},
    )
    res = pairwise_minimality(Scorer.build(tiny_llama, records, reference, 6, False), circuit, metric="prob")
    direct = Scorer.build(tiny_llama, records, reference, 6, False)  # full runs, its own cache
    pairs = circuit.pairs()

    def F(removed) -> float:
        return float(direct.keep([p for p in pairs if p not in set(removed)]).prob.mean())

    for g in circuit.groups:
        members = [(h, circuit.positions[g]) for h in circuit.groups[g]]
        size = math.ceil(0.3 * len(members))
        for v in members:
            scores = [(F([u]) - F([u, v]), u) for u in members if u != v]
            ranked = sorted(scores, key=lambda t: -t[0])
            k = [u for s, u in ranked[:size] if s > 0]
            before, after = F(k), F([*k, v])
            got = res["pairs"][pair_name(v)]
            assert got["K"] == sorted(pair_name(u) for u in k)
            assert got["before"] == pytest.approx(before, rel=1e-4) and got["after"] == pytest.approx(after, rel=1e-4)
            assert got["score"] == pytest.approx(before / after - 1, rel=1e-3, abs=1e-5)
            if abs(before / after - 1 - 0.01) > 1e-3:
                assert got["kept"] == (before / after - 1 >= 0.01)


def test_pruning_is_relative_to_the_circuits_own_performance(llama_scorer):
    circuit = Circuit("t", "et", {"A": [Head(2, 0), Head(1, 0), Head(1, 3)]}, {"A": "last"})
    res = minimality(llama_scorer, circuit, max_steps=1, n_candidates=None, metric="prob")
    f_c = float(per_prompt(llama_scorer.keep(circuit.pairs()), "prob").mean())
    f_m = float(per_prompt(llama_scorer.full(), "prob").mean())
    assert res["relative_to"] == "F(C)" and res["circuit"] == pytest.approx(f_c)
    for r in res["pairs"].values():
        assert r["relative"] == pytest.approx(r["contribution"] / f_c)
        assert r["relative_full"] == pytest.approx(r["contribution"] / f_m)
    # a threshold between two heads' relative contributions keeps exactly the heads above it
    rel = sorted(r["relative"] for r in res["pairs"].values())
    cut = (rel[0] + rel[1]) / 2
    pruned = prune(circuit, res, threshold=cut)
    assert len(pruned.heads()) == 2 and pruned.meta["pruned"]["relative_to"] == "F(C)"


def test_the_papers_disjoint_groups_take_a_shared_head_out_of_the_earlier_group():
    """The paper prunes A minus B: a head that A and B both hold at the last token stays in B only, so it is scored
    once (without the rule, pairwise_minimality scores the shared pair in A and again in B, the second overwriting
    the first). A head shared across positions is two pairs and stays in both groups."""
    from mechdiff.circuits.pruning import disjoint_groups
    from mechdiff.studies.circuits.spec import ScoringSection, load_spec, section_inputs

    shared, a, b, c = Head(2, 1), Head(1, 0), Head(3, 0), Head(0, 2)
    circuit = Circuit(
        "t",
        "et",
        {"A": [a, shared], "B": [shared, b], "C": [shared, c]},
        {"A": "last", "B": "last", "C": "query_label"},
        meta={"source": "x"},
    )
    out = disjoint_groups(circuit)
    assert out.groups == {"A": [a], "B": [shared, b], "C": [shared, c]}
    assert out.meta == {"source": "x", "disjoint": ["L2H1@last from A"]}
    assert out.positions == circuit.positions and disjoint_groups(out).groups == out.groups  # idempotent

    memberships = lambda c: sum(len(heads) for heads in c.groups.values())  # noqa: E731
    before = pairwise_minimality(FakeScorer(circuit.pairs(), lambda kept: True), circuit, metric="prob")["pairs"]
    after = pairwise_minimality(FakeScorer(out.pairs(), lambda kept: True), out, metric="prob")["pairs"]
    assert (memberships(circuit), len(before)) == (6, 5) and before["L2H1@last"]["group"] == "B"  # A's overwritten
    assert (memberships(out), len(after)) == (5, 5) and after["L2H1@last"]["group"] == "B"  # each pair once
    assert load_spec("tasks/entity_tracking_llama7b.toml").scoring.prune_disjoint is True
    assert "prune_disjoint" not in section_inputs("scoring", ScoringSection())  # committed prune keys unchanged


def test_each_model_prunes_with_its_own_seed(tiny_family, tmp_path, monkeypatch):
    """[scoring.models.NAME] seed (the paper's minimality seed per model: LLaMA 10, Goat 56, FLoAT 10) draws that
    model's pruning reference and greedy candidates; a model not named prunes with the study's, and its prune key
    stays what it was without the option. The paper's task file selects the paper's seeds."""
    from mechdiff.runs.seeds import prompt_seed
    from mechdiff.runs.stages import StageRecord
    from mechdiff.studies.circuits.spec import load_spec
    from mechdiff.studies.circuits.study import CircuitsStudy
    from mechdiff.studies.spec import SpecError

    base, ft = tiny_family
    head = f'[models]\nbase = "{base}"\nfinetunes = ["{ft}"]\n\n[task]\nname = "entity-tracking"\nn_boxes = 3\n'
    plain = head + "\n[scoring]\nprune_n = 4\nreference_n = 6\n"
    (tmp_path / "plain.toml").write_text(plain)
    (tmp_path / "own.toml").write_text(plain + f'\n[scoring.models."{ft}"]\nseed = 4\n')
    study = CircuitsStudy.from_file(tmp_path / "own.toml", out=str(tmp_path / "run"), progress=False)
    before = CircuitsStudy.from_file(tmp_path / "plain.toml", out=str(tmp_path / "run"), progress=False)
    assert study._prune_inputs(base, "k") == before._prune_inputs(base, "k")
    assert study._prune_inputs(ft, "k")["scoring"]["models"] == {ft: {"seed": 4}}
    references = []
    original = Scorer.build.__func__
    monkeypatch.setattr(
        Scorer, "build", classmethod(lambda cls, *a, **kw: references.append(a[2]) or original(cls, *a, **kw))
    )
    circuit = Circuit("m", "entity-tracking", {"A": [Head(1, 0), Head(1, 2)]}, {"A": "last"})
    found = StageRecord("circuit", "key", {"circuit": circuit.to_dict()}, 0.0, False)
    seeds = {n: study.pruned(n, found).result["minimality"]["seed"] for n in (base, ft)}
    assert seeds == {base: study.seed("prune"), ft: prompt_seed(4, "prune")}
    task, options = study.task, study.options(prompts="reference")
    drawn = [
        task.reference_records(study.tokenizer, 6, s, **options)
        for s in (study.seed("reference"), prompt_seed(4, "reference"))
    ]
    assert references == drawn and drawn[0] != drawn[1]
    paper = load_spec("tasks/entity_tracking_llama7b.toml").scoring.models
    assert paper == {"llama-7b": {"seed": 10}, "goat-7b": {"seed": 56}, "float-7b": {"seed": 10}}
    (tmp_path / "bad.toml").write_text(plain + f'\n[scoring.models."{ft}"]\nprune_n = 3\n')
    with pytest.raises(SpecError, match=r"bad.toml:13: \[scoring.models.*\] may set seed"):
        load_spec(tmp_path / "bad.toml")
