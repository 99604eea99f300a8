"""The trajectory's report.html without a browser: each figure's numbers are the committed tables' (a measure's
line and band, formation steps and their intervals, the overlap matrix, role membership per step), and the
committed run, which labels roles once, says role membership was not measured."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from mechdiff.report.html import page

RESULTS = Path(__file__).resolve().parents[3] / "results"


def figures(html: str) -> dict[str, dict]:
    """Each figure of the page by its div id: the JSON its drawing call reads."""
    out, dec, at = {}, json.JSONDecoder(), 0
    while (at := html.find("var f = ", at)) >= 0:
        fig, end = dec.raw_decode(html, at + len("var f = "))
        div = html[end:].split('Plotly.newPlot("', 1)[1].split('"', 1)[0]
        out[div], at = fig, end
    return out


def _write(path: Path, data) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(data))


@pytest.fixture
def run(tmp_path: Path) -> Path:
    """A trajectory run of three checkpoints with every table the page reads, roles labelled per checkpoint."""
    names = ["r@0", "r@5", "r@10"]
    _write(
        tmp_path / "run.json",
        {"kind": "trajectory", "settings": {"task": {"name": "ioi"}, "models": {"checkpoints": names}}, "stages": {}},
    )
    t = tmp_path / "tables"
    acc = [(0.1, 0.05, 0.2), (0.5, 0.4, 0.6), (0.9, 0.8, 0.95)]
    _write(
        t / "accuracy.json",
        [
            {"step": s, "checkpoint": n, "accuracy": a, "accuracy_low": lo, "accuracy_high": hi}
            for s, n, (a, lo, hi) in zip((0, 5, 10), names, acc)
        ],
    )
    _write(
        t / "formation.json",
        [
            {"component": "the model", "step_50%": 5, "step_50%_low": 0, "step_50%_high": 10},
            {"component": "CMAP IO/z", "step_50%": 10, "step_50%_low": 5, "step_50%_high": "after step 10"},
            {
                "component": "early",
                "step_50%": "at or before step 5",
                "step_50%_low": "at or before step 5",
                "step_50%_high": 10,
            },
            {"component": "never", "step_50%": None, "step_50%_low": None, "step_50%_high": None},
        ],
    )
    _write(t / "structure_matrix.json", [{"step": s, "0": 0.5 + s / 100, "5": 0.3, "10": 0.2} for s in (0, 5, 10)])
    _write(
        t / "dcm_labels.json",
        [
            {"group": "S2", "desideratum": "io_name", "step": 0, "selected": "-"},
            {"group": "S2", "desideratum": "io_name", "step": 5, "selected": "L1H0"},
            {"group": "S2", "desideratum": "io_name", "step": 10, "selected": "L1H0 L0H1"},
        ],
    )
    for s in (0, 5, 10):
        _write(tmp_path / "circuits" / f"r_{s}.json", {"groups": {"last": ["L1H1"] if s else []}, "positions": {}})
    return tmp_path


def test_each_figure_holds_the_committed_tables_numbers(run: Path) -> None:
    figs = figures(page(run))
    band, line = figs["measure-accuracy"]["data"]
    assert line["x"] == [0, 5, 10] and line["y"] == [0.1, 0.5, 0.9]
    assert band["x"] == [0, 5, 10, 10, 5, 0] and band["y"] == [0.2, 0.6, 0.95, 0.8, 0.4, 0.05]  # high, then low back
    (formed,) = figs["formation"]["data"]
    # "never" formed: not drawn; "early" (left-censored) at the step it was reached at or before
    assert formed["y"] == ["the model", "CMAP IO/z", "early"] and formed["x"] == [5, 10, 5]
    assert formed["error_x"]["arrayminus"] == [5, 5, 0] and formed["error_x"]["array"] == [5, 0, 5]
    assert formed["marker"]["symbol"] == ["circle", "triangle-right", "circle"]  # CMAP's interval runs past the end
    (matrix,) = figs["overlap_matrix"]["data"]
    assert matrix["z"] == [[0.5, 0.3, 0.2], [0.55, 0.3, 0.2], [0.6, 0.3, 0.2]]
    (role,) = figs["role-0"]["data"]
    assert role["y"] == ["L0H1", "L1H0"] and role["z"] == [[0, 0, 1], [0, 1, 1]]
    (member,) = figs["circuit_membership"]["data"]
    assert member["y"] == ["L1H1"] and member["z"] == [[0, 1, 1]]


def test_the_committed_run_draws_its_roles_matrix_and_between_run_null() -> None:
    """The committed trajectory: a heads x steps chart per role DCM found at some step (a note for the others), the
    overlap matrix of its table, the between-run null, and each measure from its table."""
    run = RESULTS / "trajectory-smollm2"
    html = page(run)
    figs = figures(html)
    roles = json.loads((run / "tables" / "roles.json").read_text())
    order = list(dict.fromkeys((r["group"], r["desideratum"]) for r in roles))
    for i, (g, d) in enumerate(order):
        held = any(r["holding"] != "-" for r in roles if (r["group"], r["desideratum"]) == (g, d))
        assert (f"held-role-{i}" in figs) == held and (f"No scored head holds {g} / {d} at any step" in html) != held
    assert "Role membership per checkpoint: not measured." not in html
    matrix = json.loads((run / "tables" / "structure_matrix.json").read_text())
    (heat,) = figs["overlap_matrix"]["data"]
    assert len(heat["z"]) == len(matrix) == 17
    runs = json.loads((run / "tables" / "structure_runs.json").read_text())
    assert [r["step"] for r in runs] == [2, 5, 15, 45, 100] and "measure-structure_runs" in figs
    acc = json.loads((run / "tables" / "accuracy.json").read_text())
    line = figs["measure-accuracy"]["data"][1]
    assert line["x"] == [r["step"] for r in acc] and line["y"] == [round(r["accuracy"], 4) for r in acc]
    semantic = json.loads((run / "tables" / "semantic.json").read_text())
    roles = {(r["group"], r["desideratum"]) for r in semantic}
    # per role patched: its accuracy and its floor, each a line and a band (the paired differences: in the tables)
    assert len(figs["measure-semantic"]["data"]) == 2 * 2 * len(roles)
    assert html.count('id="plotly-gz"') == 1 and len(html) < 2_500_000


def test_roles_scored_per_checkpoint_give_a_chart_per_role_and_no_not_measured_note(run: Path) -> None:
    """A run with the ``[roles]`` stage's tables: a heads x steps chart per role some head holds (1 where the
    table's ``holding`` names the head at that step), a note for a role no head holds, the takeovers table of a run
    made before transitions were named, else the transitions table."""
    rows = [
        ("last", "positional", 0, "L2H1"),
        ("last", "positional", 5, "-"),
        ("last", "positional", 10, "L0H3 L2H1"),
        ("last", "object", 0, "-"),
        ("last", "object", 5, "-"),
        ("last", "object", 10, "-"),
    ]
    _write(
        run / "tables" / "roles.json",
        [{"group": g, "desideratum": d, "step": s, "n_holding": 0, "holding": h} for g, d, s, h in rows],
    )
    _write(
        run / "tables" / "role_takeovers.json",
        [{"group": "last", "desideratum": "positional", "head": "L2H1", "holds_since": 10, "takes_over": True}],
    )
    html = page(run)
    figs = figures(html)
    (held,) = figs["held-role-0"]["data"]
    assert held["y"] == ["L0H3", "L2H1"] and held["z"] == [[0, 0, 1], [1, 0, 1]] and held["x"] == ["0", "5", "10"]
    assert "held-role-1" not in figs and "No scored head holds last / object at any step." in html
    # in the roles section and in the list of every table
    assert "not measured" not in html and "role-0" not in figs and html.count("tables/role_takeovers.csv") == 2
    _write(  # a run since joins, leaves and takeovers were named: its table, not the older one
        run / "tables" / "role_transitions.json",
        [{"group": "last", "desideratum": "positional", "step": 10, "head": "L0H3", "event": "joins", "others": "-"}],
    )
    html = page(run)
    assert html.count("tables/role_transitions.csv") == 2 and html.count("tables/role_takeovers.csv") == 1


def test_a_run_lacking_a_part_says_so_where_the_part_would_be(run: Path) -> None:
    """The page's notes (templates/trajectory.html.j2): no component formed, no overlap matrix, roles labelled once
    (the labels' table under the note, or none), a formation table older than intervals (drawn, with its note)."""
    (run / "tables" / "structure_matrix.json").unlink()
    _write(run / "tables" / "formation.json", [{"component": "never", "step_50%": None}])
    _write(run / "tables" / "dcm_labels.json", [{"group": "S2", "desideratum": "io_name", "selected": "L1H0"}])
    html = page(run)
    figs = figures(html)
    assert "<h2>When each component forms</h2><p class=note>No component formed in this run" in html
    assert "<h2>Overlap matrix</h2><p class=note>Overlap matrix: not in this run's committed files" in html
    assert "formation" not in figs and "overlap_matrix" not in figs and "role-0" not in figs
    once = (
        "<p class=note><b>Role membership per checkpoint: not measured.</b> This study labels roles once (the DCM "
        "selections below, {}) and patches that one set into every checkpoint; which heads hold a role at each "
        "step was not measured.</p>"
    )
    assert once.format("from the table its task file names") in html and html.count("tables/dcm_labels.csv") == 2
    assert "predates intervals" not in html
    (run / "tables" / "dcm_labels.json").unlink()
    _write(run / "tables" / "formation.json", [{"component": "the model", "formed_at_step": 5}])
    html = page(run)
    assert once.format("none") in html and "formation" in figures(html)
    assert "This run's formation table predates intervals: each step is shown alone.</p>" in html
