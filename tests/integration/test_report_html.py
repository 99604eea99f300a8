"""``report.html`` in a real browser: Debian's headless Chromium driven by selenium through Debian's chromedriver
(nothing downloaded at run time). Writes the default study's page from its committed files, opens it from disk,
reads the grid against the committed circuits, hovers a known head and reads its scores against the committed
tables, takes a screenshot, and checks that the page asks for nothing over the network; the trajectory's page draws
every figure from its tables."""

from __future__ import annotations

import json
import math
import re
import shutil
from pathlib import Path

import pytest
from conftest import circuit_pairs

ROOT = Path(__file__).resolve().parents[2]
RUN = ROOT / "results" / "entity-tracking-smollm2"
CHROMIUM, DRIVER = (
    shutil.which("chromium") or "/usr/bin/chromium",
    shutil.which("chromedriver") or "/usr/bin/chromedriver",
)

pytestmark = pytest.mark.skipif(
    not (Path(CHROMIUM).exists() and Path(DRIVER).exists()),
    reason="needs Debian's chromium and chromium-driver (apt-get install -y chromium chromium-driver; .ci/run "
    "installs them)",
)


@pytest.fixture(scope="module")
def browser():
    webdriver = pytest.importorskip("selenium.webdriver")
    from selenium.webdriver.chrome.options import Options
    from selenium.webdriver.chrome.service import Service

    opts = Options()
    opts.binary_location = CHROMIUM
    for arg in (
        "--headless=new",
        "--no-sandbox",
        "--disable-gpu",
        "--disable-dev-shm-usage",
        "--window-size=1400,1000",
        "--allow-file-access-from-files",
    ):
        opts.add_argument(arg)
    opts.set_capability("goog:loggingPrefs", {"browser": "ALL", "performance": "ALL"})
    driver = webdriver.Chrome(service=Service(executable_path=DRIVER), options=opts)
    driver.set_page_load_timeout(60)
    yield driver
    driver.quit()


@pytest.fixture(scope="module")
def written(tmp_path_factory) -> Path:
    """The page as this code writes it (``mechdiff view``) from the committed run."""
    from mechdiff.report.html import write_html

    return write_html(RUN, tmp_path_factory.mktemp("page") / "report.html")


def _open(browser, path: Path) -> None:
    browser.get(path.as_uri())
    from selenium.webdriver.support.ui import WebDriverWait

    # drawn, and the hover text filled in (gridText runs after the grid's newPlot)
    WebDriverWait(browser, 60).until(
        lambda d: d.execute_script("var g = document.getElementById('grid'); return !!(g && g.data && g.data[0].text);")
    )


@pytest.fixture(scope="module")
def page(browser, written):
    """The page loaded once (2 MB: each load costs seconds), with what the browser logged while loading it: the
    console's messages and the network log."""
    browser.get_log("browser")
    browser.get_log("performance")  # nothing from before the load
    _open(browser, written)
    return browser, browser.get_log("browser"), browser.get_log("performance"), written


def test_page_opens_with_no_console_error_and_the_grid_holds_each_circuit(page, tmp_path) -> None:
    browser, console, _, path = page
    assert path.stat().st_size <= 2_500_000  # plotly.js gzipped is 1.9 MB of it
    errors = [e for e in console if e["level"] == "SEVERE"]
    assert not errors, errors
    names = browser.execute_script("return document.getElementById('grid').data.map(function (t) { return t.name; });")
    run = json.loads((RUN / "run.json").read_text())["spec"]["models"]
    for i, model in enumerate([run["base"], *run["finetunes"]]):
        assert names[i] == model
        z = browser.execute_script(f"return document.getElementById('grid').data[{i}].z;")
        pairs = circuit_pairs(RUN / "circuits" / f"{model}.json")
        # every head of the circuit shows the number of its position classes, every other head 0
        assert sum(v > 0 for row in z for v in row) == len(pairs)
        for head, classes in pairs.items():
            layer, h = map(int, re.match(r"L(\d+)H(\d+)", head).groups())
            assert z[h][layer] == len(classes), head
    shot = tmp_path / "report.png"
    assert browser.save_screenshot(str(shot)) and shot.stat().st_size > 10_000


def _hover(browser, layer: int, head: int) -> str:
    """Move the mouse over the grid cell (layer, head) and return the tooltip's text."""
    from selenium.webdriver.common.action_chains import ActionChains
    from selenium.webdriver.common.by import By

    browser.execute_script("document.getElementById('grid').scrollIntoView();")
    x, y, w, h = browser.execute_script(
        "var gd = document.getElementById('grid'), L = gd._fullLayout, r = gd.getBoundingClientRect();"
        f"return [L.xaxis._offset + L.xaxis.l2p({layer}), L.yaxis._offset + L.yaxis.l2p({head}), r.width, r.height];"
    )
    grid = browser.find_element(By.ID, "grid")
    ActionChains(browser).move_to_element_with_offset(grid, int(x - w / 2), int(y - h / 2)).perform()
    from selenium.webdriver.support.ui import WebDriverWait

    WebDriverWait(browser, 10).until(
        lambda d: d.execute_script("return document.querySelectorAll('#grid .hoverlayer .hovertext').length > 0;")
    )
    return browser.execute_script(
        "return Array.from(document.querySelectorAll('#grid .hoverlayer .hovertext text tspan.line'))"
        ".map(function (t) { return t.textContent; }).join('\\n');"
    )


def _third_digit(v: float) -> float:
    """How far a value shown to three significant digits may be from the table's: half a unit of the third."""
    return 0.0 if v == 0 else 0.5 * 10 ** (math.floor(math.log10(abs(v))) - 2) * (1 + 1e-9)


def test_hover_shows_the_heads_scores_from_the_committed_tables(page) -> None:
    browser = page[0]
    head, layer, h = "L17H0", 17, 0  # in both circuits at query_label, chosen by DCM for positional there
    text = _hover(browser, layer, h)
    assert text.startswith(f"{head} in smollm2-et-early"), text
    lines = text.split("\n")
    for model in ("smollm2-et-early",):
        circuits = {
            name: circuit_pairs(RUN / "circuits" / f"{file}.json")
            for name, file in (
                ("smollm2-et-early", "smollm2-et-early"),
                ("smollm2-et-early pruned", "smollm2-et-early.pruned"),
                ("smollm2-et", "smollm2-et"),
                ("smollm2-et pruned", "smollm2-et.pruned"),
            )
        }
        for c in sorted(set().union(*(p.get(head, set()) for p in circuits.values()))):
            line = next(x for x in lines if x.startswith(f"{c}: "))
            holding = [n for n, p in circuits.items() if c in p.get(head, set())]
            assert line.endswith("in " + ", ".join(holding)), line
        heads_table = RUN / "tables" / "heads.json"
        if heads_table.exists():
            rows = [r for r in json.loads(heads_table.read_text()) if r["model"] == model and r["head"] == head]
            assert rows
            for r in rows:
                line = next(x for x in lines if x.startswith(f"{r['position']}: "))
                if "attribution" in r:
                    shown = float(re.search(r"attribution (\S+) \(rank (\d+)\)", line).group(1))
                    assert shown == pytest.approx(r["attribution"], rel=0, abs=_third_digit(r["attribution"])), line
                    assert f"(rank {r['rank']})" in line
                if "selection_frequency" in r:
                    shown = float(re.search(r"selected ([-+.\de]+)", line).group(1))
                    assert shown == pytest.approx(
                        r["selection_frequency"], rel=0, abs=_third_digit(r["selection_frequency"])
                    ), line
    dcm = [r for r in json.loads((RUN / "tables" / "dcm.json").read_text()) if head in r["selected"].split()]
    assert dcm
    for r in dcm:
        at = next(i for i, x in enumerate(lines) if x.startswith(f"DCM {r['group']}/{r['desideratum']}: selected"))
        assert f"target {r['accuracy']:.3f} [{r['accuracy_low']:.3f}, {r['accuracy_high']:.3f}]" in lines[at]
        assert f"floor {r['floor']:.3f} [{r['floor_low']:.3f}, {r['floor_high']:.3f}]" in lines[at + 1]
    cmap = [r for r in json.loads((RUN / "tables" / "cmap_smollm2-et.json").read_text()) if r["scope"] == "query_label"]
    at = lines.index("CMAP smollm2-et into smollm2-et-early, group query_label patched together:")
    line = " ".join(lines[at + 1 : at + 3])
    for r in cmap:
        assert f"{r['kind']} {r['accuracy']:.3f} [{r['accuracy_low']:.3f}, {r['accuracy_high']:.3f}]" in line


def test_the_page_makes_no_network_request(page) -> None:
    browser, _, loading, path = page
    _hover(browser, 17, 0)
    urls = []
    for entry in loading + browser.get_log("performance"):  # while loading, then since (hovers included)
        msg = json.loads(entry["message"])["message"]
        if msg["method"] == "Network.requestWillBeSent":
            urls.append(msg["params"]["request"]["url"])
    assert urls, "the page itself is a request: the log must show it"
    assert all(u.startswith(("file://", "data:", "about:")) for u in urls), [u for u in urls if u[:5] != "file:"]
    assert path.as_uri() in urls


def test_the_trajectory_page_draws_every_figure_from_its_tables(browser, tmp_path) -> None:
    """The trajectory's page, written from its committed files: every figure drawn with no console error, the
    accuracy line and band the table's, and the page asks for nothing over the network."""
    from selenium.webdriver.support.ui import WebDriverWait

    from mechdiff.report.html import write_html

    run = ROOT / "results" / "trajectory-smollm2"
    path = write_html(run, tmp_path / "report.html")
    browser.get_log("browser")
    browser.get(path.as_uri())
    WebDriverWait(browser, 60).until(
        lambda d: d.execute_script(
            "return Array.from(document.querySelectorAll('.plot')).every(function (p) { return !!p._fullLayout; });"
        )
    )
    assert not [e for e in browser.get_log("browser") if e["level"] == "SEVERE"]
    drawn = browser.execute_script(
        "return Array.from(document.querySelectorAll('.plot')).map(function (p) { return p.id; });"
    )
    assert {"formation", "measure-accuracy", "measure-semantic", "circuit_membership"} <= set(drawn)
    line, band = browser.execute_script(
        "var d = document.getElementById('measure-accuracy').data; return [d[1], d[0]];"
    )
    acc = json.loads((run / "tables" / "accuracy.json").read_text())
    assert line["y"] == [round(r["accuracy"], 4) for r in acc]
    assert band["y"] == [r["accuracy_high"] for r in acc] + [r["accuracy_low"] for r in acc][::-1]
    shot = tmp_path / "trajectory.png"
    assert browser.save_screenshot(str(shot)) and shot.stat().st_size > 10_000
