"""Overlap tables (checked against Prakash et al. 2024), table formats and the membership heatmap."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
from scipy.stats import hypergeom

from mechdiff.circuits.circuit import Circuit
from mechdiff.circuits.overlap import hypergeom_p, overlap_table
from mechdiff.common.components import Head, all_heads
from mechdiff.common.inference import Interval
from mechdiff.report.membership import membership_grid, membership_heatmap
from mechdiff.report.tables import estimate_columns, read_table, to_latex, to_markdown, write_table

ROOT = Path(__file__).resolve().parents[3]
REFERENCE = Path("/work/shared/data/llama-7b-entity-tracking-circuit.json")
PAPER_CIRCUIT = ROOT / "tasks" / "circuits" / "llama-7b-entity-tracking.json"
# Published LLaMA vs Goat ratios (intersection / |LLaMA group|, intersection / |Goat group|).
PUBLISHED = {"A": (0.68, 0.40), "B": (0.86, 0.21), "C": (0.80, 0.40), "D": (1.00, 0.13)}
GOAT_SIZES = {"A": 68, "B": 28, "C": 40, "D": 39}
INTERSECTIONS = {"A": 27, "B": 6, "C": 16, "D": 5}


def goat_like(llama: Circuit, sizes: dict[str, int], shared: dict[str, int]) -> Circuit:
    """A circuit sharing exactly ``shared[g]`` heads with each LLaMA group, of size ``sizes[g]``."""
    pool = all_heads(32, 32)
    groups = {}
    for g, heads in llama.groups.items():
        fill = [h for h in pool if h not in heads][: sizes[g] - shared[g]]
        groups[g] = list(heads[: shared[g]]) + fill
    return Circuit("goat-7b", "entity-tracking", groups, dict(llama.positions))


@pytest.fixture(scope="module")
def llama() -> Circuit:
    return Circuit.load(PAPER_CIRCUIT)


def test_reproduces_published_overlap_ratios(llama):
    if REFERENCE.is_file():  # the reported figures, when the shared reference data is present
        reported = json.loads(REFERENCE.read_text())["reported"]
        assert reported["goat_circuit_group_sizes"] == GOAT_SIZES
        assert reported["overlap_llama_goat_intersection"] == INTERSECTIONS
    assert llama.sizes() == {"A": 40, "B": 7, "C": 20, "D": 5}
    rows = {r["group"]: r for r in overlap_table(llama, goat_like(llama, GOAT_SIZES, INTERSECTIONS), 32, 32)}
    for g, (frac_llama, frac_goat) in PUBLISHED.items():
        assert rows[g]["intersection"] == INTERSECTIONS[g]
        assert round(rows[g]["frac_first"], 2) == frac_llama, g
        assert round(rows[g]["frac_second"], 2) == frac_goat, g
        assert rows[g]["jaccard"] == pytest.approx(
            INTERSECTIONS[g] / (llama.sizes()[g] + GOAT_SIZES[g] - INTERSECTIONS[g])
        )
    # 27 shared heads between sets of 40 and 68 out of 1024 is far beyond chance (expected 2.7).
    assert rows["A"]["p_value"] < 1e-15
    assert rows["all"]["group"] == "all" and rows["all"]["size_first"] == len(llama.heads())


def test_hypergeom_p_known_values():
    assert hypergeom_p(0, 100, 10, 10) == pytest.approx(1.0)
    assert hypergeom_p(10, 10, 10, 10) == pytest.approx(1.0)  # all heads: certain
    assert hypergeom_p(1, 4, 1, 1) == pytest.approx(0.25)  # one head each out of 4: same head with p 1/4
    assert hypergeom_p(3, 50, 8, 12) == pytest.approx(hypergeom.sf(2, 50, 8, 12))
    assert hypergeom_p(6, 50, 5, 12) == 0.0
    with pytest.raises(ValueError, match="within"):
        hypergeom_p(1, 10, 11, 2)


def test_overlap_rejects_heads_outside_the_model(llama):
    with pytest.raises(ValueError, match="do not exist"):
        overlap_table(llama, llama, 30, 9)


def test_identical_circuits_overlap_fully():
    c = Circuit("m", "t", {"A": [Head(1, 2), Head(2, 0)], "C": [Head(0, 1)]}, {"A": "last", "C": "query_label"})
    rows = overlap_table(c, c, 3, 4)
    assert [r["group"] for r in rows] == ["A", "C", "all"]
    assert all(r["jaccard"] == 1.0 and r["frac_first"] == 1.0 for r in rows)


ROWS = [
    {
        "circuit": "llama",
        "model": "goat",
        "n": 3,
        "ok": True,
        **estimate_columns("accuracy", Interval(0.66, 0.61, 0.705, 100, 100, "test")),
    },
    {
        "circuit": "goat",
        "model": "goat",
        "n": 12,
        "ok": False,
        **estimate_columns("accuracy", Interval(0.8125, 0.75, 0.875, 100, 100, "test")),
    },
]


def test_tables_round_trip_and_render(tmp_path):
    paths = write_table(ROWS, tmp_path / "matrix", caption="Circuit x model")
    assert set(paths) == {"md", "csv", "tex", "json"} and all(p.is_file() for p in paths.values())
    assert read_table(paths["csv"]) == ROWS
    assert read_table(paths["json"]) == ROWS
    md, tex = paths["md"].read_text(), paths["tex"].read_text()
    for text in (md, tex):
        assert "0.660 [0.610, 0.705]" in text and "0.812 [0.750, 0.875]" in text
        assert "accuracy_low" not in text.replace("\\_", "_")
    assert "accuracy [95% CI]" in md and "accuracy [95\\% CI]" in tex
    assert "\\toprule" in tex and "\\caption{Circuit x model}" in tex
    assert md.count("\n|") == 4  # header, rule and two rows
    assert not list(tmp_path.glob("*.tmp"))


def test_table_renderers_and_errors(tmp_path):
    assert "nan" in to_markdown([{"x": math.nan}])
    assert "0.12" in to_latex([{"x": 0.1234}], floatfmt=".2f")
    assert "3.92e-25" in to_markdown([{"p_value": 3.92e-25}]) and "0.000" in to_markdown([{"x": 0.0}])
    with pytest.raises(ValueError, match="no rows"):
        write_table([], tmp_path / "t")
    with pytest.raises(ValueError, match="unknown table formats"):
        write_table(ROWS, tmp_path / "t", formats=["xlsx"])


def test_membership_heatmap(tmp_path, llama):
    goat = goat_like(llama, GOAT_SIZES, INTERSECTIONS)
    grid = membership_grid(llama, 32, 32, ["A", "B", "C", "D"])
    assert grid[15, 13] == 1 and grid[14, 27] == 2 and grid[10, 3] == 3 and grid[8, 21] == 4
    assert grid[13, 14] == 5  # in B and C: "several"
    assert (grid > 0).sum() == len(llama.heads())
    path = membership_heatmap({"llama-7b": llama, "goat-like": goat}, 32, 32, tmp_path / "fig" / "membership.png")
    assert path.is_file() and path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
