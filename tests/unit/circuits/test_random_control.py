"""The matrix's random-circuit control as a distribution: each draw's per-prompt outcomes kept, the circuit's rank
among the draws on a stratified subset of the prompts, and the outcomes committed through ``outcomes.json``."""

from __future__ import annotations

import random
from collections import Counter
from types import SimpleNamespace

import numpy as np
import pytest

from mechdiff.circuits.circuit import Circuit
from mechdiff.circuits.measures import control_prompts, faithfulness, matrix_rows, random_circuit
from mechdiff.common import inference as inf
from mechdiff.common.components import Head
from mechdiff.common.outcomes import from_bits, read_outcomes, write_outcomes
from mechdiff.patching.evaluate import EvalResult
from mechdiff.report.paired import outcome_stages
from mechdiff.tasks.base import group_key
from mechdiff.tasks.entity_tracking import generate


class DrawScorer:
    """A scorer whose prompt ``i`` is right under the kept pairs ``kept`` when ``(code(kept) + i) % 3 == 0`` or
    ``i % 4 == 0``: draws of one circuit differ from each other and prompt by prompt. ``subset`` keeps the prompts'
    own indices, as a real scorer keeps its records."""

    metric = "prob"

    def __init__(self, records: list[int]):
        self.model = SimpleNamespace(shape=SimpleNamespace(n_layers=3, n_heads=4))
        self.records, self.progress, self.seen = records, False, []

    def _result(self, kept: frozenset) -> EvalResult:
        code = sum(7 * h.layer + h.head for h, _ in kept)
        i = np.asarray(self.records)
        return EvalResult(((code + i) % 3 == 0) | (i % 4 == 0), 0.1 + 0.01 * ((code + i) % 5))

    def full(self) -> EvalResult:
        return EvalResult(np.ones(len(self.records), dtype=bool), np.full(len(self.records), 0.2))

    def keep(self, pairs) -> EvalResult:
        self.seen.append(len(self.records))
        return self._result(frozenset(pairs))

    def subset(self, rows) -> "DrawScorer":
        sub = DrawScorer([self.records[i] for i in rows])
        sub.seen = self.seen
        return sub


CIRCUIT = Circuit("m", "t", {"A": [Head(2, 1), Head(1, 0)], "B": [Head(0, 3)]}, {"A": "last", "B": "query_label"})


def test_the_rank_is_a_direct_count_over_the_stored_per_draw_outcomes():
    scorer = DrawScorer(list(range(30)))
    prompts = [1, 4, 5, 8, 13, 17, 20, 22, 26, 29]
    res = faithfulness(scorer, CIRCUIT, n_random=25, seed=3, random_prompts=prompts)["random"]
    assert res["prompts"] == prompts and len(res["outcomes"]) == 25
    assert set(scorer.seen[2:]) == {len(prompts)}  # every draw on the subset only (after the circuit and the empty one)
    # each stored draw is the random circuit the seed draws, scored on those prompts
    rng = random.Random(3)
    for stored in res["outcomes"]:
        drawn = scorer._result(frozenset(random_circuit(CIRCUIT, 3, 4, rng).pairs())).correct[prompts]
        assert np.array_equal(from_bits(stored), drawn)
    circuit = scorer._result(frozenset(CIRCUIT.pairs())).correct[prompts].mean()
    draws = [from_bits(b).mean() for b in res["outcomes"]]
    rank = sum(d >= circuit for d in draws)
    assert 0 < rank < 25  # the fake's draws fall on both sides of the circuit
    assert res["rank"]["rank"] == rank and res["rank"]["p"] == pytest.approx((1 + rank) / 26)
    assert res["draws"] == pytest.approx(draws)
    assert res["rank"]["q50"] == pytest.approx(np.quantile(draws, 0.5))
    assert res["accuracy"]["value"] == pytest.approx(np.mean(draws))
    assert res["faithfulness"]["value"] == pytest.approx(np.mean(draws))  # the full model is always right here


def test_the_draws_interval_resamples_draws_and_items_as_the_rank_does():
    rng = np.random.default_rng(0)
    draws = (rng.random((30, 40)) < rng.random((30, 1))).astype(float)
    rank = inf.control_rank(draws[0], draws[1:], seed=5)
    iv = inf.control_ratio(draws[1:], None, seed=5)
    assert (iv.value, iv.low, iv.high) == pytest.approx((rank.draws.value, rank.draws.low, rank.draws.high))
    # the spread between draws widens the interval beyond what resampling prompts of the pooled mean gives
    pooled = inf.mean(draws[1:].mean(0))
    assert iv.high - iv.low > pooled.high - pooled.low
    half = inf.control_ratio(draws[1:], np.full(40, 0.5), seed=5)
    assert half.value == pytest.approx(2 * iv.value) and half.low == pytest.approx(2 * iv.low)


def test_control_prompts_are_a_seeded_subset_stratified_by_group(smollm2_tokenizer):
    records = generate(smollm2_tokenizer, 60, n_boxes=3, seed=0) + generate(smollm2_tokenizer, 30, n_boxes=4, seed=1)
    chosen = control_prompts(records, 30, seed=2)
    assert len(chosen) == 30 == len(set(chosen)) and chosen == sorted(chosen)
    assert chosen == control_prompts(records, 30, seed=2) and chosen != control_prompts(records, 30, seed=3)
    whole, part = Counter(group_key(r) for r in records), Counter(group_key(records[i]) for i in chosen)
    assert {g: whole[g] / 3 for g in whole} == {g: part[g] for g in whole}  # a third of every group
    assert control_prompts(records, 0, 2) == list(range(90)) == control_prompts(records, 500, 2)


def test_per_draw_outcomes_round_trip_through_outcomes_json(tmp_path):
    scorer = DrawScorer(list(range(24)))
    kept: dict = {}
    other = Circuit("m2", "t", {"A": [Head(1, 1)]}, {"A": "last"})
    rows = matrix_rows("m", {"m": CIRCUIT, "m2": other}, scorer, n_random=12, seed=1, random_for=["m"], outcomes=kept)
    assert "random" in kept["m"] and "random" not in kept["m2"]
    record = SimpleNamespace(result={"rows": rows, "outcomes": kept})
    write_outcomes(tmp_path, outcome_stages({}, {"m": record}, None))
    stages = read_outcomes(tmp_path)
    drawn = stages["matrix_random:m"]["m"]
    assert drawn == kept["m"]["random"] and list(stages["matrix_random:m"]) == ["m"]
    # the rank restated from the committed files is the table's
    circuit = from_bits(stages["matrix:m"]["m"]["correct"])[drawn["prompts"]]
    restated = inf.control_rank(circuit, [from_bits(b) for b in drawn["outcomes"]])
    assert (restated.rank, restated.p) == (rows[0]["random_rank"], rows[0]["random_p"])
    assert rows[0]["random_n_prompts"] == 24 and "random_rank" not in rows[1]


def test_random_prompts_must_index_the_scored_prompts():
    with pytest.raises(ValueError, match="distinct indices into the 6 scored prompts"):
        faithfulness(DrawScorer(list(range(6))), CIRCUIT, n_random=2, random_prompts=[0, 6])


def test_the_findings_sentence_gives_the_rank_among_the_draws():
    from mechdiff.studies.circuits.report.claims import _rank_clause

    rows = matrix_rows("m", {"m": CIRCUIT}, DrawScorer(list(range(24))), n_random=9, seed=1)
    row = rows[0]
    clause = _rank_clause(row)
    assert f"on 24 of the prompts, {row['random_rank']} of 9 draws are at least as accurate" in clause
    assert f"rank p = {row['random_p']:.2g}" in clause
    assert _rank_clause({"random_faithfulness": 0.2}) == ""  # a record made before ranks were kept
