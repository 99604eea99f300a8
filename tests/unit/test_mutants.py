"""Tests written to kill mutants the rest of the suite let live (benchmarks/mutation.sh): the DCM
hard-concrete gate against its distribution, the knowledge forward's attention-sink means against
an independent average, and the scoring helpers against direct computations. Seconds, no real weights."""

from __future__ import annotations

import math
import random

import numpy as np
import pytest
import torch

from conftest import make_tiny
from mechdiff.circuits.circuit import Circuit
from mechdiff.common.components import Head, parse_heads
from mechdiff.methods.dcm import DCMConfig, _Mask
from mechdiff.patching.evaluate import EvalResult

BETA, GAMMA, ZETA = 2 / 3, -0.1, 1.1  # Louizos et al. (2018), written out independently of mechdiff.methods.dcm


def _hard_concrete(n: int, log_alpha: float, init: float = 1.0) -> _Mask:
    mask = _Mask(n, DCMConfig(parameterisation="hard_concrete", init=init), torch.device("cpu"))
    with torch.no_grad():
        mask.param.fill_(log_alpha)
    return mask


@pytest.mark.parametrize("log_alpha", [-3.0, -0.7, 0.0, 1.2, 3.0])
def test_hard_concrete_penalty_is_the_expected_number_of_open_gates(log_alpha):
    """L0 penalty = sum of P(gate > 0), measured on 200k sampled gates (4.5 standard errors of tolerance)."""
    n = 200_000
    mask = _hard_concrete(n, log_alpha)
    torch.manual_seed(0)
    gate = 1 - mask.sample()
    assert float(mask.penalty()) / n == pytest.approx(float((gate > 0).float().mean()), abs=0.005)
    # and the closed form: P(s > -gamma / (zeta - gamma)) with s a binary concrete of temperature beta
    t = -GAMMA / (ZETA - GAMMA)
    closed = 1 / (1 + math.exp(-(log_alpha - BETA * math.log(t / (1 - t)))))
    assert float(mask.penalty()) / n == pytest.approx(closed, rel=1e-5)


@pytest.mark.parametrize("log_alpha", [-1.0, 0.5, 2.0])
def test_hard_concrete_sample_is_the_stretched_binary_concrete(log_alpha):
    """P(gate = 1) and P(gate = 0) of the stretched, clipped binary concrete, and the gate's mean."""
    n = 200_000
    mask = _hard_concrete(n, log_alpha)
    torch.manual_seed(1)
    gate = 1 - mask.sample()
    assert float(gate.min()) >= 0 and float(gate.max()) <= 1

    def p_s_above(x: float) -> float:  # s = sigmoid((logit(u) + log_alpha) / beta), u ~ U(0, 1)
        return 1 / (1 + math.exp(-(log_alpha - BETA * math.log(x / (1 - x)))))

    assert float((gate == 1).float().mean()) == pytest.approx(p_s_above((1 - GAMMA) / (ZETA - GAMMA)), abs=0.005)
    assert float((gate == 0).float().mean()) == pytest.approx(1 - p_s_above(-GAMMA / (ZETA - GAMMA)), abs=0.005)
    u = torch.rand(n, generator=torch.Generator().manual_seed(2)).clamp(1e-6, 1 - 1e-6)
    s = torch.sigmoid((torch.log(u / (1 - u)) + log_alpha) / BETA)
    direct = (s * (ZETA - GAMMA) + GAMMA).clamp(0, 1)
    assert float(gate.mean()) == pytest.approx(float(direct.mean()), abs=0.005)


def test_hard_concrete_penalty_gradient_opens_gates():
    mask = _hard_concrete(3, 0.0)
    mask.penalty().backward()
    grad = mask.param.grad
    p = 1 / (1 + math.exp(BETA * math.log(-GAMMA / ZETA)))
    assert torch.allclose(grad, torch.full((3,), p * (1 - p)), atol=1e-6)


@pytest.mark.parametrize("init,expected", [(1.0, 0.5), (0.2, 0.2), (0.0, 0.05), (0.4, 0.4)])
def test_hard_concrete_starts_at_the_configured_mask(init, expected):
    """The deterministic mask starts at ``init``, with the gate at least half and at most 0.95 open."""
    mask = _Mask(4, DCMConfig(parameterisation="hard_concrete", init=init), torch.device("cpu"))
    torch.testing.assert_close(mask.values(), torch.full((4,), expected), atol=1e-6, rtol=0)
    la = float(mask.param[0])
    assert float(mask.values()[0]) == pytest.approx(1 - min(1, max(0, (1 / (1 + math.exp(-la))) * (ZETA - GAMMA) + GAMMA)),
                                                    abs=1e-6)


def test_continuous_mask_penalty_values_and_clamp():
    mask = _Mask(3, DCMConfig(parameterisation="continuous", init=0.7), torch.device("cpu"))
    assert float(mask.penalty()) == pytest.approx(3 * 0.3)
    assert mask.sample() is mask.param
    with torch.no_grad():
        mask.param.copy_(torch.tensor([-0.5, 0.4, 1.5]))
    mask.after_step()
    torch.testing.assert_close(mask.values(), torch.tensor([0.0, 0.4, 1.0]))
    assert not mask.values().requires_grad


def test_hard_concrete_after_step_leaves_log_alpha_unclamped():
    mask = _hard_concrete(2, 4.0)
    mask.after_step()
    assert torch.equal(mask.param.detach(), torch.full((2,), 4.0))


# ----------------------------------------------------------------------------------- knowledge forward
@pytest.fixture(scope="module")
def tiny_graph():
    from mechdiff.methods.knowledge.graph import Graph

    model = make_tiny("llama", None, seed=3)
    ids = torch.randint(0, 2000, (4, 7), generator=torch.Generator().manual_seed(5))
    return model, Graph.from_shape(model.shape), ids


def test_mean_ablation_keeps_the_sink_mean_apart(tiny_graph):
    """Position 0's mean and the later positions' mean, each averaged independently from the clean outputs."""
    from mechdiff.methods.knowledge.forward import Ablation, edge_forward, mean_ablation

    model, graph, ids = tiny_graph
    batches = [type("B", (), {"ids": ids[:2]})(), type("B", (), {"ids": ids[2:]})()]
    abl = mean_ablation(model, graph, batches)
    with torch.no_grad():
        outs = edge_forward(model, graph, ids, None, keep_outputs=True).outputs.double()  # s b p d
    torch.testing.assert_close(abl.means[:, 0].double(), outs[:, :, 0].mean(1), atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(abl.means[:, 1].double(), outs[:, :, 1:].mean((1, 2)), atol=1e-5, rtol=1e-5)
    assert not torch.allclose(abl.means[:, 0], abl.means[:, 1])  # the sink differs: a swap would show
    vals = Ablation("mean", abl.means).values(5)  # sender 1 pos d
    assert vals.shape == (graph.n_senders, 1, 5, model.shape.d_model)
    torch.testing.assert_close(vals[:, 0, 0], abl.means[:, 0])
    for p in range(1, 5):
        torch.testing.assert_close(vals[:, 0, p], abl.means[:, 1])


def test_empty_circuit_under_mean_ablation_reads_the_later_positions_means(tiny_graph):
    """With every edge removed the logits read only the senders' ablated values: at the last position the
    sum of the non-sink means, through the final norm and the unembedding."""
    from mechdiff.methods.knowledge.forward import edge_forward, mean_ablation

    model, graph, ids = tiny_graph
    batches = [type("B", (), {"ids": ids})()]
    abl = mean_ablation(model, graph, batches)
    with torch.no_grad():
        outs = edge_forward(model, graph, ids, None, keep_outputs=True).outputs
        rest = outs[:, :, 1:].float().mean((1, 2))  # sender d, averaged here, not by mean_ablation
        expected = model.model.lm_head(model.model.model.norm(rest.sum(0)))
        empty = edge_forward(model, graph, ids, np.zeros(graph.n_edges, dtype=bool), abl).logits
    for row in empty:
        torch.testing.assert_close(row, expected, atol=1e-4, rtol=1e-4)


# ----------------------------------------------------------------------------------- scoring helpers
def _result(correct: list[bool], prob: list[float]) -> EvalResult:
    return EvalResult(correct=np.array(correct), prob=np.array(prob))


def test_per_prompt_metrics():
    from mechdiff.circuits.scoring import per_prompt

    r = _result([True, False, True], [0.9, 0.2, 0.6])
    assert per_prompt(r, "accuracy").tolist() == [1.0, 0.0, 1.0]
    assert per_prompt(r, "prob").tolist() == pytest.approx([0.9, 0.2, 0.6])


def test_random_circuit_keeps_group_sizes_and_positions():
    from mechdiff.circuits.scoring import random_circuit

    c = Circuit("m", "t", {"A": parse_heads(["L1H0", "L1H1", "L2H3"]), "B": parse_heads(["L0H2"])},
                {"A": "last", "B": "query_label"})
    draws = [random_circuit(c, 3, 4, random.Random(s)) for s in range(20)]
    c.names = {"A": "fetchers", "B": "movers"}
    draws = [random_circuit(c, 3, 4, random.Random(s)) for s in range(20)]
    for r in draws:
        assert r.sizes() == c.sizes() and r.positions == c.positions
        assert (r.model, r.task, r.names, r.meta) == ("m", "t", c.names, {"random_baseline_of": "m"})
        assert r.names is not c.names and r.positions is not c.positions
        assert len(set(r.groups["A"])) == 3
        assert all(0 <= h.layer < 3 and 0 <= h.head < 4 for h in r.heads())
    assert len({tuple(r.groups["A"]) for r in draws}) > 10  # drawn, not fixed


def test_full_circuit_has_every_head_at_every_position():
    from mechdiff.circuits.scoring import EVERY_POSITION, full_circuit

    c = full_circuit(3, 4, model="m")
    assert sorted(c.heads()) == [Head(l, h) for l in range(3) for h in range(4)]
    assert c.groups["L1"] == [Head(1, h) for h in range(4)]
    assert set(c.positions.values()) == {EVERY_POSITION} and c.model == "m"
    assert c.task == "" and full_circuit(1, 2, task="ioi").task == "ioi"  # the engine names no task by default
    assert c.names == {"L0": "", "L1": "", "L2": ""}


def test_prune_keeps_pairs_above_the_threshold_and_records_it():
    from mechdiff.circuits.pruning import prune

    c = Circuit("m", "t", {"A": parse_heads(["L1H0", "L1H1"]), "B": parse_heads(["L0H2"])},
                {"A": "last", "B": "query_label"})
    result = {"metric": "prob", "max_steps": 1, "n_candidates": 4, "seed": 0, "n_prompts": 8,
              "full": 0.5, "pairs": {"L1H0@last": {"relative": 0.2}, "L1H1@last": {"relative": 0.01},
                                     "L0H2@query_label": {"relative": -0.3}}}
    pruned = prune(c, result, threshold=0.01)
    assert pruned.groups == {"A": [Head(1, 0)], "B": []}
    assert pruned.meta["pruned"]["threshold"] == 0.01
    assert pruned.meta["pruned"]["removed"] == ["L0H2@query_label", "L1H1@last"]
    assert pruned.meta["pruned"]["sizes_before"] == {"A": 2, "B": 1}
    assert pruned.scores["minimality"]["L0H2@query_label"] == -0.3
    assert prune(c, result, threshold=-1.0).groups == c.groups


def test_hard_concrete_mask_lives_on_the_asked_device():
    for kind in ("continuous", "hard_concrete"):
        mask = _Mask(2, DCMConfig(parameterisation=kind), torch.device("meta"))
        assert mask.param.device.type == "meta" and mask.param.requires_grad


@pytest.mark.parametrize("log_alpha,expected", [(-6.0, 1.0), (6.0, 0.0)])
def test_hard_concrete_values_are_clipped_to_the_unit_interval(log_alpha, expected):
    """A nearly closed gate gives mask 1 exactly, a nearly open one 0: the stretched sigmoid is clipped."""
    assert torch.equal(_hard_concrete(3, log_alpha).values(), torch.full((3,), expected))


# ----------------------------------------------------------------------------------- scoring on a fake scorer
class FakeScorer:
    """A scorer whose metric is a known function of which (head, position) pairs stay unablated:
    prompt i is correct when ``rule(kept)`` holds and ``i`` is not in ``always_wrong``; its answer
    probability is ``base[i] + 0.1 * (number of kept pairs among the circuit's)``."""

    def __init__(self, every: list, rule, n: int = 12, progress: bool = False):
        self.model = type("M", (), {"shape": type("S", (), {"n_layers": 3, "n_heads": 4})()})()
        self.records = list(range(n))
        self.progress, self.every, self.rule = progress, frozenset(every), rule
        self.base = np.linspace(0.05, 0.5, n)
        self.calls: list[tuple[str, frozenset]] = []

    def _result(self, kept: frozenset) -> EvalResult:
        ok = self.rule(kept)
        correct = np.array([ok and i % 5 != 0 for i in self.records])
        return EvalResult(correct, self.base + 0.1 * len(kept & self.every))

    def full(self) -> EvalResult:
        self.calls.append(("full", frozenset()))
        return self._result(self.every)

    def keep(self, pairs) -> EvalResult:
        pairs = frozenset(pairs)
        self.calls.append(("keep", pairs))
        return self._result(pairs)

    def keep_without(self, pairs, removed) -> EvalResult:
        return self.keep(frozenset(pairs) - frozenset(removed))

    def ablate(self, pairs) -> EvalResult:
        pairs = frozenset(pairs)
        self.calls.append(("ablate", pairs))
        return self._result(self.every - pairs)


def _or_circuit():
    """Group A = {a, b}: the task works while either is kept (redundant heads), group B = {c}: not needed."""
    a, b, c = (Head(2, 0), "last"), (Head(2, 1), "last"), (Head(0, 3), "query_label")
    circuit = Circuit("m", "t", {"A": [a[0], b[0]], "B": [c[0]]}, {"A": "last", "B": "query_label"})
    scorer = FakeScorer([a, b, c], lambda kept: a in kept or b in kept)
    return circuit, scorer, (a, b, c)


def test_minimality_grows_k_to_expose_redundant_heads():
    from mechdiff.circuits.pruning import minimality

    circuit, scorer, (a, b, c) = _or_circuit()
    acc_full = float(np.mean([i % 5 != 0 for i in range(12)]))
    res = minimality(scorer, circuit, max_steps=1, n_candidates=None, seed=3, metric="accuracy")
    assert res["full"] == pytest.approx(acc_full) and res["metric"] == "accuracy" and res["n_prompts"] == 12
    assert (res["max_steps"], res["n_candidates"], res["seed"]) == (1, None, 3)
    # alone, removing a changes nothing (b covers it); with K = {b} removing a breaks the task
    assert res["pairs"]["L2H0@last"] == {"contribution": pytest.approx(acc_full), "relative": pytest.approx(1.0),
                                         "relative_full": pytest.approx(1.0), "K": ["L2H1@last"], "searched": True}
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
    for name, r in res["pairs"].items():  # removing one more pair lowers every prompt's probability by 0.1
        assert r["contribution"] == pytest.approx(0.1) and r["relative"] == pytest.approx(0.1 / full)
        assert r["K"] == []  # no K raises a contribution that is the same for every K


def test_faithfulness_against_direct_means():
    from mechdiff.circuits.scoring import faithfulness, random_circuit

    circuit, scorer, (a, b, c) = _or_circuit()
    only_c = Circuit("m", "t", {"B": [c[0]]}, {"B": "query_label"})
    full_acc = np.array([i % 5 != 0 for i in range(12)], dtype=float)
    res = faithfulness(scorer, only_c, n_random=3, seed=7)
    assert res["n_prompts"] == 12
    assert res["full"]["accuracy"]["value"] == pytest.approx(full_acc.mean())
    assert res["full"]["faithfulness"]["value"] == pytest.approx(1.0)
    assert res["circuit"]["accuracy"]["value"] == 0.0 and res["circuit"]["faithfulness"]["value"] == 0.0
    prob_c, prob_full = scorer.base + 0.1, scorer.base + 0.3
    assert res["circuit"]["answer_prob"]["value"] == pytest.approx(prob_c.mean())
    assert res["circuit"]["faithfulness_prob"]["value"] == pytest.approx(prob_c.mean() / prob_full.mean())
    rng = random.Random(7)
    draws = [scorer._result(frozenset(random_circuit(only_c, 3, 4, rng).pairs())) for _ in range(3)]
    acc = np.mean([d.correct for d in draws], 0)
    assert res["random"]["accuracy"]["value"] == pytest.approx(acc.mean())
    assert res["random"]["answer_prob"]["value"] == pytest.approx(np.mean([d.prob for d in draws]))
    assert (res["random"]["n_draws"], res["random"]["seed"]) == (3, 7)
    assert "random" not in faithfulness(scorer, only_c)
    bad = Circuit("m", "t", {"A": [Head(5, 0)]}, {"A": "last"})
    with pytest.raises(ValueError, match="do not exist"):
        faithfulness(scorer, bad)


def test_completeness_against_direct_differences():
    from mechdiff.circuits.scoring import completeness

    circuit, scorer, (a, b, c) = _or_circuit()
    pairs = circuit.pairs()
    res = completeness(scorer, circuit, n_draws=4, p=0.5, seed=11, metric="prob")
    rng = random.Random(11)
    expected = []
    for _ in range(4):
        k = [pr for pr in pairs if rng.random() < 0.5]
        kept = frozenset(pr for pr in pairs if pr not in k)
        expected.append(abs(float((scorer._result(kept).prob - scorer._result(scorer.every - frozenset(k)).prob).mean())))
    assert res["random"]["draws"] == pytest.approx(expected)
    assert res["random"]["mean"] == pytest.approx(np.mean(expected))
    assert res["random"]["std"] == pytest.approx(np.std(expected))
    assert (res["metric"], res["p"], res["seed"], res["n_prompts"]) == ("prob", 0.5, 11, 12)
    # group A removed: the circuit keeps c only, the model keeps c too (the rest of it is "every" here)
    diff_a = scorer._result(frozenset([c])).prob - scorer._result(frozenset([c])).prob
    assert res["groups"]["A"]["completeness"] == pytest.approx(abs(diff_a.mean())) and res["groups"]["A"]["size"] == 2
    acc = completeness(scorer, circuit, n_draws=0, metric="accuracy")
    assert "random" not in acc and set(acc["groups"]) == {"A", "B"}
    assert acc["groups"]["B"]["completeness"] == 0.0 and acc["groups"]["B"]["size"] == 1
    always = completeness(scorer, circuit, n_draws=2, p=1.0, seed=0, metric="prob")
    assert always["random"]["draws"] == [0.0, 0.0]  # K = C: nothing kept in either run


def test_matrix_rows_columns_from_faithfulness():
    from mechdiff.circuits.scoring import faithfulness, matrix_rows

    circuit, scorer, _ = _or_circuit()
    rows = matrix_rows("model-x", {"or": circuit}, scorer, n_random=2, seed=1)
    res = faithfulness(scorer, circuit, n_random=2, seed=1)
    (row,) = rows
    assert row["circuit"] == "or" and row["model"] == "model-x" and row["n_heads"] == 3 and row["n_prompts"] == 12
    assert row["n_pairs"] == len(circuit.pairs())
    for col, (part, metric) in {"full_accuracy": ("full", "accuracy"), "accuracy": ("circuit", "accuracy"),
                                "faithfulness": ("circuit", "faithfulness"), "answer_prob": ("circuit", "answer_prob"),
                                "faithfulness_prob": ("circuit", "faithfulness_prob"),
                                "random_accuracy": ("random", "accuracy"),
                                "random_faithfulness": ("random", "faithfulness"),
                                "random_faithfulness_prob": ("random", "faithfulness_prob")}.items():
        d = res[part][metric]
        assert (row[col], row[f"{col}_low"], row[f"{col}_high"]) == (d["value"], d["low"], d["high"])
    assert "random_accuracy" not in matrix_rows("m", {"or": circuit}, scorer)[0]
    only = matrix_rows("m", {"or": circuit, "same": circuit}, scorer, n_random=2, seed=1, random_for=["same"])
    assert "random_accuracy" not in only[0] and only[1]["random_accuracy"] == row["random_accuracy"]


def test_estimate_round_trip_and_pair_name():
    from mechdiff.circuits.scoring import estimate
    from mechdiff.circuits.pruning import pair_name
    from mechdiff.common.stats import Estimate

    e = Estimate(0.4, 0.1, 0.7, 30)
    assert estimate(e.to_dict()) == e
    assert pair_name((Head(14, 7), "query_label")) == "L14H7@query_label"


def test_head_mask_marks_each_pairs_position():
    from mechdiff.circuits.scoring import EVERY_POSITION, _head_mask, _pairs_by_layer

    batch = {"input_ids": torch.zeros(3, 6, dtype=torch.long),
             "positions": {"last": torch.tensor([5, 4, 5]), "query_label": torch.tensor([2, 1, 3]),
                           "gone": torch.tensor([1, -1, 2])}}
    layers = _pairs_by_layer([(Head(1, 2), "last"), (Head(0, 1), "query_label"), (Head(1, 0), EVERY_POSITION)])
    assert {k: [(h.name, p) for h, p in v] for k, v in layers.items()} == {
        1: [("L1H2", "last"), ("L1H0", EVERY_POSITION)], 0: [("L0H1", "query_label")]}
    mask = _head_mask(layers[1], batch, 6, 4, fill=0.0)
    expected = torch.ones(3, 6, 4)
    expected[[0, 1, 2], [5, 4, 5], 2] = 0.0
    expected[:, :, 0] = 0.0
    assert torch.equal(mask, expected)
    keep = _head_mask(layers[0], batch, 6, 4, fill=1.0)
    expected = torch.zeros(3, 6, 4)
    expected[[0, 1, 2], [2, 1, 3], 1] = 1.0
    assert torch.equal(keep, expected)
    first = {"input_ids": batch["input_ids"], "positions": {"bos": torch.tensor([0, 0, 0])}}
    assert torch.equal(_head_mask([(Head(0, 2), "bos")], first, 6, 4, 1.0)[:, 0, 2], torch.ones(3))  # 0 is valid
    with pytest.raises(ValueError, match="unknown position 'nowhere'"):
        _head_mask([(Head(0, 0), "nowhere")], batch, 6, 4, 0.0)
    with pytest.raises(ValueError, match="missing in some prompts"):
        _head_mask([(Head(0, 0), "gone")], batch, 6, 4, 0.0)


def test_per_prompt_rejects_unknown_metric():
    from mechdiff.circuits.scoring import per_prompt

    with pytest.raises(ValueError, match="unknown metric 'f1'"):
        per_prompt(_result([True], [0.5]), "f1")


def test_group_pairs():
    from mechdiff.circuits.scoring import group_pairs

    circuit, _, (a, b, c) = _or_circuit()
    assert group_pairs(circuit, "A") == [a, b] and group_pairs(circuit, "B") == [c]


def test_minimality_draws_candidates_with_its_seed():
    """With fewer candidates than other pairs, the candidates are a seeded draw: K comes from that draw."""
    from mechdiff.circuits.pruning import minimality

    pairs = [(Head(2, h), "last") for h in range(4)]
    circuit = Circuit("m", "t", {"A": [p[0] for p in pairs]}, {"A": "last"})
    # the task works while any of the four is kept: removing v matters only once the other three are in K
    scorer = FakeScorer(pairs, lambda kept: bool(kept & frozenset(pairs)))
    exhaustive = minimality(scorer, circuit, max_steps=3, n_candidates=None, metric="accuracy")
    for name, r in exhaustive["pairs"].items():
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


def _completeness_scorer():
    """Circuit {a, b, c} inside a model that also has d: d and a together add 0.2 to the probability."""
    a, b, c, d = (Head(1, 0), "last"), (Head(1, 1), "last"), (Head(2, 2), "last"), (Head(0, 0), "last")
    circuit = Circuit("m", "t", {"A": [a[0], b[0]], "B": [c[0]]}, {"A": "last", "B": "last"})
    scorer = FakeScorer([a, b, c, d], lambda kept: d in kept or (a in kept and b in kept))
    plain = scorer._result

    def result(kept: frozenset) -> EvalResult:
        r = plain(kept)
        return EvalResult(r.correct, r.prob + 0.2 * (a in kept and d in kept))

    scorer._result = result
    return circuit, scorer, (a, b, c, d)


def test_completeness_draws_k_with_its_seed():
    from mechdiff.circuits.scoring import completeness
    from mechdiff.common.stats import bootstrap

    circuit, scorer, (a, b, c, d) = _completeness_scorer()
    pairs = circuit.pairs()
    res = completeness(scorer, circuit, n_draws=8, p=0.5, seed=4, metric="prob")
    rng, expected = random.Random(4), []
    for _ in range(8):
        k = frozenset(pr for pr in pairs if rng.random() < 0.5)
        with_c = scorer._result(frozenset(pairs) - k).prob
        with_m = scorer._result(frozenset([a, b, c, d]) - k).prob
        expected.append(abs(float((with_c - with_m).mean())))
    assert len(set(expected)) > 1  # the draws differ, so the seed shows
    assert res["random"]["draws"] == pytest.approx(expected)
    assert res["random"]["ci"] == bootstrap(res["random"]["draws"]).to_dict()
    assert completeness(scorer, circuit, n_draws=8, p=0.5, seed=4, metric="prob")["random"] == res["random"]
    default = completeness(scorer, circuit)
    assert (default["metric"], default["p"], default["seed"], len(default["random"]["draws"])) == ("accuracy", 0.5, 0, 5)
    # group A removed: C keeps c only (wrong), M keeps c and d (right on 4 prompts of 5)
    acc_m = np.array([i % 5 != 0 for i in range(12)], dtype=float)
    assert default["groups"]["A"]["completeness"] == pytest.approx(acc_m.mean())
    assert default["groups"]["A"]["difference"]["value"] == pytest.approx(-acc_m.mean())


def test_prune_records_every_setting_and_keeps_the_circuit_identity():
    from mechdiff.circuits.pruning import prune

    c = Circuit("m", "t", {"A": parse_heads(["L1H0", "L1H1"])}, {"A": "last"}, names={"A": "fetchers"},
                meta={"source": "x"})
    result = {"metric": "prob", "max_steps": 2, "n_candidates": 3, "seed": 5, "n_prompts": 8, "full": 0.5,
              "pairs": {"L1H0@last": {"relative": 0.011}, "L1H1@last": {"relative": 0.009}}}
    pruned = prune(c, result)  # threshold 0.01 by default
    assert pruned.groups == {"A": [Head(1, 0)]}
    assert (pruned.model, pruned.task, pruned.names, pruned.positions) == ("m", "t", {"A": "fetchers"}, {"A": "last"})
    assert pruned.meta == {"source": "x", "pruned": {
        "rule": "greedy", "threshold": 0.01, "relative_to": "F(M)", "metric": "prob", "max_steps": 2, "n_candidates": 3, "seed": 5,
        "n_prompts": 8, "removed": ["L1H1@last"], "sizes_before": {"A": 2}}}
    with pytest.raises(ValueError, match="no minimality score for L1H1@last"):
        prune(c, {**result, "pairs": {"L1H0@last": {"relative": 1.0}}})


def test_full_circuit_default_model_name():
    from mechdiff.circuits.scoring import full_circuit

    assert full_circuit(1, 2).model == ""


def test_random_baseline_averages_draws_per_prompt():
    """The random baseline's probability is averaged over draws for each prompt, then bootstrapped over the
    prompts; its accuracy interval resamples draws and prompts (the spread between draws counts)."""
    from mechdiff.circuits.scoring import faithfulness, random_circuit
    from mechdiff.common.stats import bootstrap, pooled_proportion

    circuit, scorer, (a, b, c) = _or_circuit()
    res = faithfulness(scorer, circuit, n_random=3)  # seed 0 by default
    assert res["random"]["seed"] == 0 and res == faithfulness(scorer, circuit, n_random=3, seed=0)
    rng = random.Random(0)
    draws = [scorer._result(frozenset(random_circuit(circuit, 3, 4, rng).pairs())) for _ in range(3)]
    acc = np.mean([d.correct for d in draws], 0)  # one value per prompt
    prob = np.mean([d.prob for d in draws], 0)
    assert res["random"]["accuracy"] == pooled_proportion([d.correct.astype(float) for d in draws]).to_dict()
    assert res["random"]["accuracy"]["value"] == pytest.approx(acc.mean()) and res["random"]["accuracy"]["n"] == 12
    assert res["random"]["draws"] == [float(d.correct.mean()) for d in draws]
    assert res["random"]["answer_prob"] == bootstrap(prob).to_dict() and res["random"]["answer_prob"]["n"] == 12


def test_quiet_scoring_prints_nothing(capsys):
    """``progress=False`` means no progress bar on stderr from any scoring loop."""
    from mechdiff.circuits.scoring import completeness, faithfulness, per_prompt
    from mechdiff.circuits.pruning import minimality

    circuit, scorer, _ = _or_circuit()
    faithfulness(scorer, circuit, n_random=2)
    completeness(scorer, circuit, n_draws=2)
    minimality(scorer, circuit)
    assert capsys.readouterr().err == ""
    assert per_prompt(_result([True, False], [0.7, 0.2])).tolist() == [1.0, 0.0]  # accuracy by default
