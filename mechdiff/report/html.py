"""``report.html``: one self-contained page per run directory, built from what a committed run holds.

A study run (``run.json`` with a ``spec``) gives: the findings and limitations (the sentences of ``report.md``,
which the study wrote from its tables' rows), the accuracy table, a layer x head grid per model whose hover shows
every score the run holds for each (head, position class) pair (``tables/heads.json``, or the circuit stage records
where present; the circuits; DCM; CMAP), a model toggle and the difference between two models, the position scan,
curve, selection stability and CMAP as plots with their intervals, every table (sortable) and the stage table. Any
other results directory (a HeadMap, IOI or knowledge run) gets its summary, every table and a grid per circuit file
it holds (the grid: `mechdiff.report.head_grid`). Charts are Plotly figures; plotly.js is inlined once, gzipped, so
the file opens from disk with no network. The page, its tables, figures and grid are jinja2 templates
(``templates/``, `render`).
"""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any, Iterable, Optional

from markupsafe import Markup

from ..common.io import write_text
from ..common.metrics import continuous_key
from .head_grid import Grid, grid_shape
from .heads import HEADS_TABLE, head_rows
from .page_kit import HEAD, Figures, caption, inline, markdown_html, render, sections, stage_rows, table_html
from .tables import format_value

#: JSON files larger than this are not read as tables or circuits of a generic results directory.
MAX_JSON = 400_000


# -- reading a run directory -----------------------------------------------------------------------
def _json(path: Path) -> Any:
    return json.loads(path.read_text())


def _is_table(data: Any) -> bool:
    scalar = (str, int, float, bool, type(None))
    return (
        isinstance(data, list)
        and bool(data)
        and all(isinstance(r, dict) for r in data)
        and all(isinstance(v, scalar) for r in data for v in r.values())
    )


def _circuit_pairs(data: Any) -> Optional[dict[str, set[str]]]:
    """``{head: {position classes}}`` of a circuit file (groups of heads at positions, or an edge circuit's
    nodes), else None."""
    if not isinstance(data, dict):
        return None
    if isinstance(data.get("groups"), dict) and isinstance(data.get("positions"), dict):
        out: dict[str, set[str]] = {}
        for g, heads in data["groups"].items():
            for h in heads:
                if isinstance(h, str) and HEAD.match(h):
                    out.setdefault(h, set()).add(data["positions"].get(g, g))
        return out
    if isinstance(data.get("nodes"), list):
        return {n: {"node"} for n in data["nodes"] if isinstance(n, str) and HEAD.match(n)}
    return None


# -- Markdown (the report's own sentences) ---------------------------------------------------------


# -- tables -----------------------------------------------------------------------------------------


# -- figures ----------------------------------------------------------------------------------------


def _errors(rows: list[dict], key: str) -> dict:
    return dict(
        type="data",
        symmetric=False,
        array=[round(r[f"{key}_high"] - r[key], 4) for r in rows],
        arrayminus=[round(r[key] - r[f"{key}_low"], 4) for r in rows],
    )


def interval_plot(
    series: dict[str, list[dict]],
    x: str,
    keys: Iterable[str],
    title: str,
    xtitle: str,
    ytitle: str,
    text: Optional[str] = None,
    log_x: bool = False,
) -> Any:
    """One line per (series, key) with its 95% interval as error bars."""
    import plotly.graph_objects as go

    fig = go.Figure()
    for name, rows in series.items():
        for key in keys:
            fig.add_trace(
                go.Scatter(
                    x=[r[x] for r in rows],
                    y=[round(r[key], 4) for r in rows],
                    error_y=_errors(rows, key),
                    mode="lines+markers+text" if text else "lines+markers",
                    name=f"{name}: {key}",
                    textposition="top left",
                    textfont=dict(size=10),
                    text=[r.get(text, "") for r in rows] if text else None,
                    hovertemplate=f"{name}<br>{x} %{{x}}<br>{key} %{{y:.3f}}"
                    + (" (+%{text})" if text else "")
                    + "<extra></extra>",
                )
            )
    fig.update_layout(title=title, xaxis_title=xtitle, yaxis_title=ytitle, height=420)
    if log_x:
        fig.update_xaxes(type="log")
    elif all(isinstance(r[x], int) for rows in series.values() for r in rows):
        fig.update_xaxes(dtick=1)
    return fig


# -- estimates in notes ----------------------------------------------------------------------------


def _num(v: Optional[float]) -> str:
    return "-" if v is None else f"{v:.3g}"


def _est(row: dict, key: str) -> str:
    return f"{row[key]:.3f} [{row[key + '_low']:.3f}, {row[key + '_high']:.3f}]"


# -- a study run ------------------------------------------------------------------------------------
class StudyRun:
    """What the page shows of a ``mechdiff run`` directory, read from its committed files (and its stage
    records where present)."""

    def __init__(self, run_dir: Path) -> None:
        from ..runs.stages import label

        self.dir = run_dir
        self.manifest = _json(run_dir / "run.json")
        spec = self.manifest["spec"]
        self.base, self.finetunes = spec["models"]["base"], list(spec["models"]["finetunes"])
        self.models = [self.base, *self.finetunes]
        self.label = label
        self.tables = {p.stem: _json(p) for p in sorted((run_dir / "tables").glob("*.json"))}
        self.circuits: dict[str, dict[str, set[str]]] = {}
        for m in self.models:
            for suffix, name in (("", m), (".pruned", f"{m} pruned")):
                path = run_dir / "circuits" / f"{label(m)}{suffix}.json"
                if path.exists():
                    self.circuits[name] = _circuit_pairs(_json(path)) or {}
        self.heads, self.heads_source = self._heads()

    def _heads(self) -> tuple[list[dict], str]:
        """The per-pair rows: ``tables/heads.json``, else rebuilt from the circuit stage records."""
        if HEADS_TABLE in self.tables:
            return self.tables.pop(HEADS_TABLE), f"tables/{HEADS_TABLE}.json"
        stages = self.dir / "stages"
        found, pruned = {}, {}
        for m in self.models:
            rec = stages / f"circuit__{self.label(m)}.json"
            if rec.exists():
                found[m] = _json(rec)["result"]
            rec = stages / f"prune__{self.label(m)}.json"
            if rec.exists():
                pruned[m] = _json(rec)["result"]
        if found:
            return head_rows(found, pruned), "the circuit stage records (stages/)"
        return [], ""

    def dcm_lines(self, model: str) -> dict[str, list[str]]:
        """Per head of the base circuit's DCM groups: what DCM selected it for (with intervals), and the same
        heads patched in ``model`` (semantic patching)."""
        out: dict[str, list[str]] = {}
        sem = {(s["group"], s["desideratum"], s["model"]): s for s in self.tables.get("semantic_patching", [])}
        rows = self.tables.get("dcm", [])
        base = self.circuits.get(self.base, {})
        for r in rows:
            chosen = set(r["selected"].split()) if r["selected"] != "-" else set()
            for head in chosen:
                lines = [
                    f"DCM {r['group']}/{r['desideratum']}: selected; target {_est(r, 'accuracy')}",
                    f"  floor {_est(r, 'floor')}" + (f", random {_est(r, 'random')}" if "random" in r else ""),
                ]
                s = sem.get((r["group"], r["desideratum"], model))
                if s:
                    lines.append(f"  the same heads patched in {model}: {_est(s, 'accuracy')}")
                out.setdefault(head, []).extend(lines)
        for group in dict.fromkeys(r["group"] for r in rows):
            position = next(r["position"] for r in rows if r["group"] == group)
            tried = [r for r in rows if r["group"] == group]
            for head, cs in base.items():
                if position in cs:
                    missed = [r["desideratum"] for r in tried if head not in r["selected"].split()]
                    if missed:
                        out.setdefault(head, []).append(f"DCM {group}: not selected for {', '.join(missed)}")
        return out

    def cmap_lines(self) -> dict[str, list[str]]:
        """Per head of a CMAP group of the base circuit: the group's CMAP accuracies (the heads are patched
        together; CMAP has no per-head effect)."""
        out: dict[str, list[str]] = {}
        base = self.circuits.get(self.base, {})
        for ft in self.finetunes:
            rows = self.tables.get(f"cmap_{self.label(ft)}", [])
            for scope in dict.fromkeys(r["scope"] for r in rows):
                kinds = [r for r in rows if r["scope"] == scope]
                parts = [f"{r['kind']} {_est(r, 'accuracy')}" for r in kinds]
                text = [f"CMAP {ft} into {self.base}, group {scope} patched together:"]
                text += ["  " + ", ".join(parts[i : i + 3]) for i in range(0, len(parts), 3)]
                for head, cs in base.items():
                    if scope in cs:
                        out.setdefault(head, []).extend(text)
        return out

    def grid(self) -> Grid:
        """A view per model (its circuit, its scores, DCM; CMAP on the base's), the difference per fine-tune."""
        shape = grid_shape([*(h for c in self.circuits.values() for h in c), *(r["head"] for r in self.heads)])
        grid = Grid(*shape)
        for name, pairs in self.circuits.items():
            grid.circuit(name, pairs)
        cmap = self.cmap_lines()
        for m in self.models:
            dcm = self.dcm_lines(m)
            notes = {h: dcm.get(h, []) + (cmap.get(h, []) if m == self.base else []) for h in set(dcm) | set(cmap)}
            grid.add(
                m,
                m if m in self.circuits else None,
                [r for r in self.heads if r["model"] == m],
                {h: n for h, n in notes.items() if n},
            )
        for ft in self.finetunes:
            if self.base in self.circuits and ft in self.circuits:
                grid.difference(self.base, ft)
        return grid

    def stability(self) -> Optional[Any]:
        """Selection frequency of each circuit pair over the bootstrap resamples of the ranking prompts, with the
        exact binomial interval over the resamples (Monte Carlo error of the frequency)."""
        import plotly.graph_objects as go

        from ..common.inference import proportion

        draws = self.manifest["spec"]["discovery"].get("stability_draws", 0)
        rows = [r for r in self.heads if r.get("in_circuit") and "selection_frequency" in r]
        if not rows or not draws:
            return None
        fig = go.Figure()
        for m in self.models:
            mine = sorted((r for r in rows if r["model"] == m), key=lambda r: -r["selection_frequency"])
            if not mine:
                continue
            ests = [
                proportion(
                    [1.0] * round(r["selection_frequency"] * draws)
                    + [0.0] * (draws - round(r["selection_frequency"] * draws))
                )
                for r in mine
            ]
            fig.add_trace(
                go.Scatter(
                    x0=1,
                    dx=1,
                    y=[round(e.value, 3) for e in ests],
                    mode="markers",
                    name=m,
                    error_y=dict(
                        type="data",
                        symmetric=False,
                        array=[round(e.high - e.value, 3) for e in ests],
                        arrayminus=[round(e.value - e.low, 3) for e in ests],
                        thickness=0.5,
                    ),
                    hovertemplate=f"{m}<br>pair %{{x}} of {len(mine)}: selected in %{{y:.3f}} of {draws} resamples"
                    "<extra></extra>",
                )
            )
        fig.update_layout(
            title=f"Selection stability: each circuit pair's frequency in the top n over {draws} "
            "bootstrap resamples of the ranking prompts<br><sup>(which pair: the grid's hover; "
            "interval: exact binomial over the resamples)</sup>",
            xaxis_title="pair (by frequency)",
            yaxis_title="selection frequency",
            height=420,
        )
        return fig

    def cmap_figures(self) -> list[tuple[str, Any]]:
        import plotly.graph_objects as go

        out = []
        for ft in self.finetunes:
            rows = self.tables.get(f"cmap_{self.label(ft)}", [])
            if not rows:
                continue
            fig = go.Figure()
            for kind in dict.fromkeys(r["kind"] for r in rows):
                mine = [r for r in rows if r["kind"] == kind]
                fig.add_trace(
                    go.Bar(
                        x=[r["scope"] for r in mine],
                        y=[round(r["accuracy"], 4) for r in mine],
                        name=kind,
                        error_y=_errors(mine, "accuracy"),
                        hovertemplate=f"%{{x}} {kind}: accuracy %{{y:.3f}}<extra></extra>",
                    )
                )
            fig.update_layout(
                barmode="group",
                title=f"CMAP {ft} into {self.base}: accuracy with each part patched",
                yaxis_title="accuracy",
                height=420,
            )
            out.append((f"cmap_{self.label(ft)}", fig))
        return out


def _ordered_tables(tables: dict[str, Any], report: str) -> list[str]:
    """Table stems in the order ``report.md`` cites them, the rest after."""
    cited = [m for m in re.findall(r"`tables/([^`]+)\.csv`", report) if m in tables]
    return list(dict.fromkeys(cited + sorted(tables)))


def _summary_parts(report: str) -> list[tuple[str, Markup]]:
    """The report's Findings and Limitations (else its summary): each heading with its Markdown as HTML."""
    parts = sections(report)
    shown = [(name, Markup(markdown_html(parts[name]))) for name in ("Findings", "Limitations") if name in parts]
    if not shown and parts.get(""):
        shown = [("Summary", Markup(markdown_html(parts[""])))]
    return shown


def _summary(report: str) -> str:
    return render("summary.html.j2", summary=_summary_parts(report))


def study_page(run_dir: Path) -> tuple[str, str]:
    """Title and body of the page of a study run (``templates/study.html.j2``)."""
    run = StudyRun(run_dir)
    report = (run_dir / "report.md").read_text() if (run_dir / "report.md").exists() else ""
    figs = Figures()
    spec = run.manifest["spec"]
    title = f"{spec['task']['name']}: {run.base} against {', '.join(run.finetunes)}"
    accuracy = run.tables.get("accuracy")
    # the figures in the page's order: the first carries plotly.js
    grid = run.grid().html(figs, "circuit pairs per head (cell: position classes in the circuit)")
    scan, curve = _scan_figure(run, figs), _curve_figure(run, figs)
    stability = run.stability()
    stability = figs.div(stability, "stability") if stability is not None else None
    cmap = [figs.div(fig, div_id) for div_id, fig in run.cmap_figures()]
    tables = [
        table_html(run.tables[stem], caption(run_dir / "tables" / f"{stem}.json"), f"tables/{stem}.csv")
        for stem in _ordered_tables(run.tables, report)
        if _is_table(run.tables[stem])
    ]
    stages = stage_rows(run.manifest)
    ran = "What ran: seconds when computed, and whether this invocation reused the cached record"
    body = render(
        "study.html.j2",
        lead=Markup(inline(sections(report).get("", ""))) if report else None,
        summary=_summary_parts(report),
        accuracy=table_html(accuracy, caption(run_dir / "tables/accuracy.json")) if accuracy else None,
        grid=grid,
        heads_source=run.heads_source,
        scan=scan,
        curve=curve,
        stability=stability,
        cmap=cmap,
        tables=tables,
        stages=table_html(stages, ran, "run.json") if stages else None,
    )
    return title, body


def _scan_figure(run: StudyRun, figs: Figures) -> Optional[str]:
    """The position scan's faithfulness per step, each model a line with its interval (None: no scan)."""
    scan = run.tables.get("position_scan")
    if not scan:
        return None
    series = {m: [r for r in scan if r["model"] == m] for m in run.models}
    fig = interval_plot(
        series,
        "step",
        ("faithfulness",),
        "Position scan: faithfulness with every head kept at the classes chosen so far",
        "step",
        "faithfulness",
        text="added",
    )
    return figs.div(fig, "position_scan")


def _curve_figure(run: StudyRun, figs: Figures) -> Optional[str]:
    """The faithfulness of the nested circuits against their fraction of pairs (None: no curve)."""
    curve = run.tables.get("curve")
    if not curve:
        return None
    series = {m: [r for r in curve if r["model"] == m] for m in run.models}
    fig = interval_plot(
        series,
        "fraction",
        ("faithfulness", continuous_key(curve[0])),
        "Faithfulness of nested circuits (top fraction of the attribution ranking)",
        "fraction of pairs",
        "faithfulness",
        log_x=True,
    )
    return figs.div(fig, "curve")


# -- any other results directory ---------------------------------------------------------------------
def generic_page(run_dir: Path) -> tuple[str, str]:
    """Title and body for a results directory without a study's ``run.json``: its summary, a grid per circuit
    file (hover: the circuit's groups and scores, and the rows of any table beside it with a ``head`` column),
    every table."""
    files = [
        p
        for p in sorted(run_dir.rglob("*.json"))
        if "stages" not in p.relative_to(run_dir).parts and p.stat().st_size <= MAX_JSON
    ]
    loaded = {}
    for p in files:
        try:
            loaded[p] = _json(p)
        except ValueError:
            continue
    report = next((p.read_text() for p in (run_dir / "report.md", run_dir / "README.md") if p.exists()), "")
    title = next((line[2:] for line in report.splitlines() if line.startswith("# ")), run_dir.name)
    figs, body = Figures(), [_summary(report)]
    circuits = {p: _circuit_pairs(d) for p, d in loaded.items()}
    circuits = {p: c for p, c in circuits.items() if c}
    if circuits:
        grid = Grid(*grid_shape(h for c in circuits.values() for h in c))
        names = [str(p.relative_to(run_dir).with_suffix("")) for p in circuits]
        for name, pairs in zip(names, circuits.values()):
            grid.circuit(name, pairs)
        for name, p in zip(names, circuits):
            grid.add(name, name, [], _generic_notes(loaded[p], _head_rows_beside(p, loaded)))
        if len(names) > 1:
            grid.difference(names[0], names[1])
        body += [
            "<h2>Heads</h2>",
            grid.html(figs, "heads per circuit file"),
            "<p class=note>Hover a cell for the head's groups and scores in that circuit file and the rows of "
            "the tables beside it that name the head; the buttons switch circuit file, or show the difference "
            "of the first two.</p>",
        ]
    tables = [(p, d) for p, d in loaded.items() if _is_table(d)]
    if tables:
        body.append("<h2>Tables</h2><p class=note>Click a column header to sort.</p>")
        body += [table_html(d, caption(p), str(p.relative_to(run_dir))) for p, d in tables]
    if (run_dir / "run.json").exists():
        stages = stage_rows(_json(run_dir / "run.json"))
        if stages:
            body += ["<h2>Stages</h2>", table_html(stages, "What ran", "run.json")]
    return title, "".join(body)


def _generic_notes(data: dict, beside: dict[str, list[dict]]) -> dict[str, list[str]]:
    """Per head: its groups in a circuit file (with the file's score), then the rows naming it beside the file."""
    out: dict[str, list[str]] = {}
    for g, heads in (data.get("groups") or {}).items():
        for head in heads:
            score = ((data.get("scores") or {}).get(g) or {}).get(head)
            out.setdefault(head, []).append(
                f"group {g} ({(data.get('names') or {}).get(g, '')}) at {data['positions'].get(g, g)}"
                + (f": score {_num(score)}" if score is not None else "")
            )
    for head, rows in beside.items():
        out.setdefault(head, []).extend(
            ", ".join(f"{k} {format_value(v, '.3g')}" for k, v in r.items() if k != "head") for r in rows
        )
    return out


def _head_rows_beside(path: Path, loaded: dict[Path, Any]) -> dict[str, list[dict]]:
    out: dict[str, list[dict]] = {}
    for p, d in loaded.items():
        if p.parent == path.parent and _is_table(d) and "head" in d[0]:
            for r in d:
                out.setdefault(str(r.get("head")), []).append(r)
    return out


# -- the page ---------------------------------------------------------------------------------------
def page(run_dir: str | Path) -> str:
    """The whole page of ``run_dir``."""
    run_dir = Path(run_dir)
    manifest = _json(run_dir / "run.json") if (run_dir / "run.json").exists() else {}
    if manifest.get("kind") == "trajectory":
        from .trajectory_page import trajectory_page

        title, body = trajectory_page(run_dir)
    else:
        title, body = study_page(run_dir) if "spec" in manifest else generic_page(run_dir)
    return render("page.html.j2", title=title, body=Markup(body)) + "\n"


def write_html(run_dir: str | Path, out: Optional[str | Path] = None) -> Path:
    """Write ``report.html`` (or ``out``) for the run directory ``run_dir``."""
    run_dir = Path(run_dir)
    if not run_dir.is_dir():
        raise ValueError(
            f"{run_dir} is not a directory: give a results directory (e.g. results/entity-tracking-smollm2)"
        )
    return write_text(Path(out) if out else run_dir / "report.html", page(run_dir))
