"""report.html without a browser: the page of every committed results kind holds its report's sentences, a grid
view per model or circuit file whose members are the committed circuits' pairs, sortable tables with raw values,
and loads nothing from outside."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
from conftest import circuit_pairs

from mechdiff.report.html import markdown_html, page, table_html, write_html

RESULTS = Path(__file__).resolve().parents[3] / "results"


def _grid_data(html: str) -> dict:
    return json.loads(re.search(r"var GRID_DATA = (\{.*?\});</script>", html).group(1))


def _members(data: dict, name: str) -> dict[str, set[str]]:
    out: dict[str, set[str]] = {}
    for layer, head, c in data["members"][name]:
        out.setdefault(f"L{layer}H{head}", set()).add(data["classes"][c])
    return out


def test_study_page_has_the_reports_findings_and_each_modelscircuit_pairs() -> None:
    run = RESULTS / "entity-tracking-smollm2"
    html = page(run)
    report = (run / "report.md").read_text()
    findings = report.split("## Findings", 1)[1].split("## Limitations", 1)[0]
    text = re.sub(r"<[^>]+>", "", html)
    for line in findings.splitlines():
        sentence = line.strip().lstrip("- ").replace("**", "").replace("`", "")
        assert sentence[:60] in text, sentence  # the same sentences, not re-derived ones
    data = _grid_data(html)
    assert [v["name"] for v in data["views"]] == ["smollm2-et-early", "smollm2-et", "smollm2-et - smollm2-et-early"]
    for name, file in (("smollm2-et", "smollm2-et"), ("smollm2-et-early pruned", "smollm2-et-early.pruned")):
        assert _members(data, name) == circuit_pairs(run / "circuits" / f"{file}.json")
    assert (
        html.count('id="plotly-gz"') == 1
        and "* plotly.js v" not in html
        and not re.search(r"<(script|link|img)[^>]+(src|href)=\"?https?:", html)
    )


@pytest.mark.parametrize(
    "run, circuits",
    [
        ("headmap-smollm2", ["circuits/entity-tracking/circuit", "path-patching/smollm2-et-early"]),
    ],
)
def test_other_results_kinds_degrade_to_summary_tables_and_a_grid_percircuit_pairs(
    run: str, circuits: list[str]
) -> None:
    html = page(RESULTS / run)
    data = _grid_data(html)
    for name in circuits:
        assert _members(data, name) == circuit_pairs(RESULTS / run / f"{name}.json")
    assert "<h2>Tables</h2>" in html and 'class="sortable"' in html


def test_ioi_study_page_holds_each_models_circuit_pairs() -> None:
    """IOI through the whole study (tasks/ioi.toml): the page's grid is each model's circuit, pair for pair."""
    run = RESULTS / "ioi-smollm2"
    data = _grid_data(page(run))
    assert [v["name"] for v in data["views"]][:2] == ["smollm2-135m", "smollm2-et"]
    for name in ("smollm2-135m", "smollm2-et"):
        assert _members(data, name) == circuit_pairs(run / "circuits" / f"{name}.json")


def test_edge_circuit_grid_holds_its_head_nodes_and_the_head_roles_beside_it() -> None:
    run = RESULTS / "knowledge-smollm2" / "country_language"
    html = page(run)
    data = _grid_data(html)
    nodes = json.loads((run / "circuit.json").read_text())["nodes"]
    assert set(_members(data, "circuit")) == {n for n in nodes if re.fullmatch(r"L\d+H\d+", n)}
    roles = json.loads((run / "head_roles.json").read_text())
    notes = data["views"][0]["notes"]
    assert data["notes"][notes[roles[0]["head"]][-1]].startswith(f"role {roles[0]['role']}")


def test_markdown_lists_and_tables_sort_on_raw_values(tmp_path: Path) -> None:
    out = markdown_html("- **a** `x` 1 < 2\n  next line\n  - inner\n- b")
    assert out == ("<ul><li><b>a</b> <code>x</code> 1 &lt; 2<br>next line<ul><li>inner</li></ul></li><li>b</li></ul>")
    t = table_html([{"m": "a", "acc": 0.5, "acc_low": 0.25, "acc_high": 0.75}], "cap")
    assert '<td data-v="0.5">0.500 [0.250, 0.750]</td>' in t and "acc [95% CI]" in t
    with pytest.raises(ValueError, match="not a directory"):
        write_html(tmp_path / "missing")


def test_head_rows_carry_each_stage_score_to_its_pair() -> None:
    from mechdiff.report.heads import head_rows

    circuit = {
        "model": "m",
        "task": "t",
        "groups": {"last": ["L1H0"], "q": ["L0H1"]},
        "positions": {"last": "last", "q": "query"},
        "names": {},
        "scores": {},
        "meta": {},
    }
    pruned = {**circuit, "groups": {"last": ["L1H0"]}, "positions": {"last": "last"}}
    curve = {
        "circuit": circuit,
        "ranking": [["L1H0@last", -0.5], ["L0H1@query", 0.25], ["L0H0@last", 0.125]],
        "stability": {"selected": {"L1H0@last": 1.0, "L0H1@query": 0.5}, "others": {"L0H0@last": 0.25}},
    }
    rows = head_rows({"m": curve}, {"m": {"circuit": pruned}})
    assert rows == [
        {
            "model": "m",
            "head": "L1H0",
            "position": "last",
            "in_circuit": True,
            "kept_after_pruning": True,
            "selection_frequency": 1.0,
            "attribution": -0.5,
            "rank": 1,
        },
        {
            "model": "m",
            "head": "L0H1",
            "position": "query",
            "in_circuit": True,
            "kept_after_pruning": False,
            "selection_frequency": 0.5,
            "attribution": 0.25,
            "rank": 2,
        },
        {
            "model": "m",
            "head": "L0H0",
            "position": "last",
            "in_circuit": False,
            "kept_after_pruning": False,
            "selection_frequency": 0.25,
            "attribution": 0.125,
            "rank": 3,
        },
    ]
    path = {"circuit": circuit, "exact": {"last": {"L1H0": -0.75, "L2H2": 0.5}}}
    assert head_rows({"m": path}) == [
        {"model": "m", "head": "L0H1", "position": "query", "in_circuit": True},
        {"model": "m", "head": "L1H0", "position": "last", "in_circuit": True, "path_patching": -0.75},
        {"model": "m", "head": "L2H2", "position": "last", "in_circuit": False, "path_patching": 0.5},
    ]


#: The committed runs whose page must not depend on the hash seed.
SEEDED_RUNS = ("entity-tracking-smollm2", "trajectory-smollm2")
#: `mechdiff view RUN --out PAGE` for each (RUN, PAGE) of argv in one process (a view is mostly its imports), then
#: that process's hash of a string: the check that its hash seed was not this one's.
VIEWS = (
    "import sys; from mechdiff.cli import main; "
    "rc = max(main(['view', r, '--out', o]) for r, o in zip(sys.argv[1::2], sys.argv[2::2])); "
    "print(hash('mechdiff')); sys.exit(rc)"
)


@pytest.fixture(scope="module")
def seeded_pages(tmp_path_factory) -> Path:
    """Every run of `SEEDED_RUNS` viewed in this process and in one under another PYTHONHASHSEED (one process
    started, not two: a view is mostly its imports): ``<dir>/<run>-here.html`` and ``<dir>/<run>-there.html``."""
    import os
    import subprocess
    import sys

    from mechdiff.cli import main

    out = tmp_path_factory.mktemp("seeded")
    seed = "2" if os.environ.get("PYTHONHASHSEED") == "1" else "1"
    args = [a for run in SEEDED_RUNS for a in (str(RESULTS / run), str(out / f"{run}-there.html"))]
    there = subprocess.Popen(
        [sys.executable, "-c", VIEWS, *args],
        env={**os.environ, "PYTHONHASHSEED": seed},
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    for run in SEEDED_RUNS:
        assert main(["view", str(RESULTS / run), "--out", str(out / f"{run}-here.html")]) == 0
    printed, err = there.communicate(timeout=300)
    assert there.returncode == 0, err
    assert int(printed.split()[-1]) != hash("mechdiff")  # another hash seed than this process's
    return out


@pytest.mark.parametrize("run", SEEDED_RUNS)
def test_the_page_is_the_same_bytes_whatever_the_hash_seed(seeded_pages: Path, run: str) -> None:
    assert (seeded_pages / f"{run}-here.html").read_bytes() == (seeded_pages / f"{run}-there.html").read_bytes()


def test_the_templates_escape_what_a_run_holds_and_inline_their_assets() -> None:
    """A table's cells, column names and file name are text, never markup; the page's style and scripts come from
    the package's template folder, inlined whole."""
    from importlib.resources import files

    t = table_html([{"<i>col</i>": "<b>x</b>"}], "", "tables/a&b.csv")
    assert "<th>&lt;i&gt;col&lt;/i&gt;</th>" in t and "<td>&lt;b&gt;x&lt;/b&gt;</td>" in t
    assert "<code>tables/a&amp;b.csv</code>" in t and "<b>" not in t
    html = page(RESULTS / "headmap-smollm2")
    for name in ("page.css", "loader.js", "grid.js", "sort.js"):
        assert files("mechdiff.report").joinpath("templates", name).read_text() in html
