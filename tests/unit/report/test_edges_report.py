"""The trajectory report's "Edges beside nodes": node overlap beside edge overlap on the same rows, and "nodes stable,
edges move" written only where the intervals carry it, from edge records of planted scores."""

from __future__ import annotations

import json
from types import SimpleNamespace

import numpy as np

from mechdiff.methods.edge_structure import STABLE_MOVE, edge_structure
from mechdiff.methods.knowledge.graph import Graph
from mechdiff.studies.trajectory.report_edges import EdgesReport, edge_rows, edge_sentence
from mechdiff.studies.trajectory.settings import EdgesSection

GRAPH = Graph(n_layers=3, n_heads=2, n_kv_heads=2)
A = ["L0H0->L1H0.q", "L0H1->L1H1.q", "L1H0->L2H0.q", "L1H1->L2H1.q"]
B = ["L0H0->L1H1.q", "L0H1->L1H0.q", "L1H0->L2H1.q", "L1H1->L2H0.q"]


def planted(edges: list[str], seed: int) -> np.ndarray:
    x = 0.05 * np.random.default_rng(seed).standard_normal((16, GRAPH.n_edges))
    x[:, [GRAPH.edge_index[e] for e in edges]] += 1.0
    return x


def record() -> dict:
    """Steps 0 -> 5 the same wiring (nothing moves), 5 -> 10 rewired between the same nodes."""
    scores = {"c0": planted(A, 0), "c5": planted(A, 1), "c10": planted(B, 2)}
    return edge_structure(scores, GRAPH, 4, draws=10, seed=0, resamples=30, resample_splits=2)


def test_rows_put_node_overlap_beside_edge_overlap_and_read_only_what_the_intervals_carry(tmp_path):
    rec, steps = record(), {"c0": 0, "c5": 5, "c10": 10}
    rows = edge_rows(rec, steps)
    assert [(r["against"], r["from_step"], r["to_step"]) for r in rows] == [
        ("next", 0, 5),
        ("next", 5, 10),
        ("final", 0, 10),
        ("final", 5, 10),
    ]
    assert [r["reading"] for r in rows] == ["not shown", STABLE_MOVE, STABLE_MOVE, STABLE_MOVE]
    moved = rows[1]
    assert moved["nodes_cross"] == 1.0 and moved["nodes_change"].startswith("same within")
    assert moved["edges_cross"] == 0.0 and moved["edges_change"] == "changed"
    assert rows[0]["edges_change"].startswith("same within") and rows[0]["nodes_change"].startswith("same within")
    text = edge_sentence(rows)
    # 5 -> 10 is both the consecutive comparison and step 5 against the final: one comparison, said once
    assert "is shown at 5-10, 0-10 " in text and "not shown at the other 1 of 3 distinct comparisons" in text
    assert edge_sentence(rows[:1]).endswith("is not shown at any of the 1 comparisons.")
    # the report section and its tables
    rep = EdgesReport.__new__(EdgesReport)
    rep.s = SimpleNamespace(st=SimpleNamespace(edges=EdgesSection(on=True)))
    rep.r = {"edges": SimpleNamespace(result=rec)}
    rep.names, rep.steps, rep.dir, rep.sections = list(steps), list(steps.values()), tmp_path, []
    rep.edges()
    assert rep.sections[0].startswith("## Edges beside nodes") and text in rep.sections[0]
    table = json.loads((tmp_path / "tables" / "edges_nodes.json").read_text())
    assert [r["reading"] for r in table] == [r["reading"] for r in rows]
    assert {"nodes_cross_low", "edges_cross_low", "nodes_null_minus_cross_high"} <= set(table[0])
