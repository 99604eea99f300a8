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
from mechdiff.components import Head, parse_heads
from mechdiff.dcm import DCMConfig, _Mask
from mechdiff.evaluate import EvalResult

BETA, GAMMA, ZETA = 2 / 3, -0.1, 1.1  # Louizos et al. (2018), written out independently of mechdiff.dcm


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
    from mechdiff.knowledge.graph import Graph

    model = make_tiny("llama", None, seed=3)
    ids = torch.randint(0, 2000, (4, 7), generator=torch.Generator().manual_seed(5))
    return model, Graph.from_shape(model.shape), ids


def test_mean_ablation_keeps_the_sink_mean_apart(tiny_graph):
    """Position 0's mean and the later positions' mean, each averaged independently from the clean outputs."""
    from mechdiff.knowledge.forward import Ablation, edge_forward, mean_ablation

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
    from mechdiff.knowledge.forward import edge_forward, mean_ablation

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
    for r in draws:
        assert r.sizes() == c.sizes() and r.positions == c.positions
        assert len(set(r.groups["A"])) == 3
        assert all(0 <= h.layer < 3 and 0 <= h.head < 4 for h in r.heads())
    assert len({tuple(r.groups["A"]) for r in draws}) > 10  # drawn, not fixed


def test_full_circuit_has_every_head_at_every_position():
    from mechdiff.circuits.scoring import EVERY_POSITION, full_circuit

    c = full_circuit(3, 4, model="m")
    assert sorted(c.heads()) == [Head(l, h) for l in range(3) for h in range(4)]
    assert c.groups["L1"] == [Head(1, h) for h in range(4)]
    assert set(c.positions.values()) == {EVERY_POSITION} and c.model == "m"


def test_prune_keeps_pairs_above_the_threshold_and_records_it():
    from mechdiff.circuits.scoring import prune

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
