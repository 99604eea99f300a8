"""Edges beside nodes across checkpoints (`mechdiff.methods.edge_structure`), on per-prompt edge scores built
directly: identical checkpoints overlap fully in edges and nodes; a planted rewiring (other edges between the same
nodes) keeps the node overlap at 1 and takes the edge overlap below the within-checkpoint null; the node sets are
those of the edges' senders and receivers."""

from __future__ import annotations

import numpy as np
import pytest

from mechdiff.methods.edge_structure import NOT_SHOWN, STABLE_MOVE, checkpoint_top, edge_structure, masks
from mechdiff.methods.knowledge.graph import EdgeCircuit, Graph

GRAPH = Graph(n_layers=3, n_heads=2, n_kv_heads=2)
PROMPTS = 24
# the same four nodes, wired two ways: L0H0, L0H1 into L1H0, L1H1 (queries: one head a receiver)
WIRING_A = ["L0H0->L1H0.q", "L0H1->L1H1.q", "L1H0->L2H0.q", "L1H1->L2H1.q"]
WIRING_B = ["L0H0->L1H1.q", "L0H1->L1H0.q", "L1H0->L2H1.q", "L1H1->L2H0.q"]


def scores(planted: list[str], seed: int, noise: float = 0.05) -> np.ndarray:
    """Per-prompt scores: the planted edges at 1 (each prompt), every edge with noise of sd ``noise``."""
    rng = np.random.default_rng(seed)
    out = noise * rng.standard_normal((PROMPTS, GRAPH.n_edges))
    out[:, [GRAPH.edge_index[e] for e in planted]] += 1.0
    return out


def run(a: np.ndarray, b: np.ndarray, n: int = 4) -> dict:
    return edge_structure({"s": a, "t": b}, GRAPH, n, draws=20, seed=3, resamples=60, resample_splits=2)


def test_nodes_of_the_top_edges_are_their_senders_and_receivers_as_the_edge_circuit_names_them():
    """Against `EdgeCircuit.nodes` (EMB and LOGITS left out), on random edge sets of a grouped-query graph."""
    graph = Graph(n_layers=3, n_heads=4, n_kv_heads=2)  # K / V receivers feed two heads each
    rng = np.random.default_rng(0)
    for _ in range(20):
        idx = rng.choice(graph.n_edges, 7, replace=False)
        e, v = masks(idx[None], graph)
        circuit = EdgeCircuit.from_mask("m", "t", graph, e[0])
        want = [x for x in circuit.nodes() if x not in ("EMB", "LOGITS")]
        assert [graph.senders[i + 1] for i in np.flatnonzero(v[0])] == want
        assert sorted(np.flatnonzero(e[0])) == sorted(idx)


def test_identical_checkpoints_overlap_fully_in_edges_and_nodes_with_intervals_at_one():
    x = scores(WIRING_A, 0)
    st = run(x, x.copy())
    for kind in ("edges", "nodes"):
        c = st["consecutive"][0][kind]
        assert c["cross"]["value"] == c["cross"]["low"] == c["cross"]["high"] == 1.0
        assert st["null"]["s"][kind]["low"] == st["null"]["s"][kind]["high"] == 1.0
        assert c["null_minus_cross"]["low"] == c["null_minus_cross"]["high"] == 0.0
        assert c["same"] and not c["changed"]
    assert st["consecutive"][0]["reading"] == NOT_SHOWN  # the edges did not move
    assert set(checkpoint_top(x, GRAPH, 4)["edges"]) == set(WIRING_A)


def test_planted_rewiring_keeps_the_nodes_and_moves_the_edges_below_the_null():
    a, b = scores(WIRING_A, 1), scores(WIRING_B, 2)
    st = run(a, b)
    step = st["consecutive"][0]
    assert (
        set(st["top"]["s"]["nodes"]) == set(st["top"]["t"]["nodes"]) == {"L0H0", "L0H1", "L1H0", "L1H1", "L2H0", "L2H1"}
    )
    assert step["nodes"]["cross"]["value"] == 1.0 and step["nodes"]["same"]
    e = step["edges"]
    assert e["cross"]["value"] == 0.0 and st["null"]["s"]["edges"]["value"] == 1.0
    assert e["changed"] and e["null_minus_cross"]["low"] > 0.9
    assert step["reading"] == STABLE_MOVE and st["against_final"][0]["reading"] == STABLE_MOVE


def test_a_weak_rewiring_in_noise_is_not_read_as_moved_edges():
    """Planted edges at the noise level: the edge difference's interval reaches 0, so nothing is read."""
    a, b = scores(WIRING_A, 1, noise=3.0), scores(WIRING_B, 2, noise=3.0)
    step = run(a, b)["consecutive"][0]
    assert not step["edges"]["changed"] and step["reading"] == NOT_SHOWN


def test_bad_input_is_refused_before_any_work():
    x = scores(WIRING_A, 0)
    with pytest.raises(ValueError, match="same prompts"):
        edge_structure({"s": x, "t": x[:10]}, GRAPH, 4)
    with pytest.raises(ValueError, match="n must lie"):
        edge_structure({"s": x, "t": x}, GRAPH, 0)
