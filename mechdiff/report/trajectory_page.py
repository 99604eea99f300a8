"""The trajectory study's ``report.html``: each measure over the steps with its 95% band, each component's
formation steps with their intervals, the overlap matrix of every two checkpoints, role membership over the
steps (or a note that the study did not measure it per checkpoint), and every table; read from the committed
files of a trajectory run (``run.json`` of kind ``trajectory``, ``tables/``, ``circuits/``), no model loaded. The
page's text is ``templates/trajectory.html.j2``; this module makes its figures and tables."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Optional, Sequence

from markupsafe import Markup

from .page_kit import HEAD, Figures, caption, hkey, inline, markdown_html, render, sections, stage_rows, table_html

#: The measures plotted over the steps: (table stem, x column, series column (None: one series), title, y title).
MEASURES = (
    ("accuracy", "step", None, "Accuracy of each checkpoint (exact binomial 95% CI)", "accuracy"),
    ("circuits", "step", None, "Circuits scored in each checkpoint: faithfulness (bootstrap 95% CI)", "faithfulness"),
    ("cmap", "step", None, "CMAP gain: each group patched from the checkpoint into the first (95% CI)", "gain"),
    ("semantic", "step", ("group", "desideratum"), "Semantic patching of the DCM-labelled heads (95% CI)", "accuracy"),
    ("structure_changes", "to_step", None, "Consecutive checkpoints: cross overlap with the previous", "overlap"),
    (
        "structure_null",
        "step",
        None,
        "Within-checkpoint null: overlap of two discoveries on disjoint halves",
        "overlap",
    ),
    ("structure_final", "step", None, "Each checkpoint's circuit against the final one", "overlap"),
    (
        "structure_runs",
        "step",
        None,
        "Between-run null: other runs of the recipe against this one at the same step",
        "overlap",
    ),
    ("role_dcm", "step", ("group", "desideratum"), "DCM trained in each checkpoint: its selection patched", "accuracy"),
    (
        "formation_curves",
        "step",
        ("component",),
        "Each component's level, its change as a share of its own final change, and its ratio (95% CI)",
        "level / share",
    ),
)


def structure_band(stem: str, rows: list[dict]) -> str:
    """What a structure table's band is: an interval over prompts where the table gives the splits' spread beside
    it (``*_split_spread``), else (a run before issue 51) the range of the splits, a spread ('' for other tables)."""
    if not stem.startswith("structure_"):
        return ""
    if any(k.endswith("_split_spread") for k in rows[0]):
        return " (95% CI over prompts)"
    return " (95% range of the splits: a spread, not an interval over prompts)"


def _num(v: Any) -> Optional[float]:
    return float(v) if isinstance(v, (int, float)) and not isinstance(v, bool) else None


def _banded(rows: list[dict]) -> list[str]:
    """The columns of ``rows`` that carry a 95% interval (``X``, ``X_low``, ``X_high``), but the paired differences
    from the first checkpoint (``minus_first``: another scale; the tables give them)."""
    return [k for k in rows[0] if f"{k}_low" in rows[0] and f"{k}_high" in rows[0] and k != "minus_first"]


def band_traces(name: str, xs: Sequence[float], rows: Sequence[dict], key: str, color: str) -> list[Any]:
    """A line of ``key`` over ``xs`` and its interval as a band below it, one legend entry for both; points whose
    value is missing are left out (a gap, not a zero)."""
    import plotly.graph_objects as go

    got = [(x, r) for x, r in zip(xs, rows) if _num(r.get(key)) is not None]
    if not got:
        return []
    x = [p for p, _ in got]
    low = [_num(r.get(f"{key}_low")) for _, r in got]
    high = [_num(r.get(f"{key}_high")) for _, r in got]
    value = [round(float(r[key]), 4) for _, r in got]
    band = dict(legendgroup=name, showlegend=False, hoverinfo="skip", line=dict(width=0), mode="lines")
    return [
        go.Scatter(x=x + x[::-1], y=high + low[::-1], fill="toself", fillcolor=color, opacity=0.2, name=name, **band),
        go.Scatter(
            x=x,
            y=value,
            mode="lines+markers",
            name=name,
            legendgroup=name,
            line=dict(color=color),
            customdata=[[lo, hi] for lo, hi in zip(low, high)],
            hovertemplate=f"{name}<br>step %{{x}}<br>%{{y:.3f}} [%{{customdata[0]:.3f}}, %{{customdata[1]:.3f}}]"
            "<extra></extra>",
        ),
    ]


COLORS = ("#1f77b4", "#ff7f0e", "#2ca02c", "#d62728", "#9467bd", "#8c564b", "#e377c2", "#7f7f7f", "#bcbd22", "#17becf")


def measure_figure(rows: list[dict], x: str, by: Optional[tuple[str, ...]], title: str, ytitle: str) -> Any:
    """Every banded column of ``rows`` over ``x`` (one series per value of the ``by`` columns, else per column)."""
    import plotly.graph_objects as go

    fig = go.Figure()
    series: dict[str, tuple[list[dict], str]] = {}
    for key in _banded(rows):
        groups = {" ".join(str(r[c]) for c in by) for r in rows} if by else {""}
        for g in sorted(groups):
            part = [r for r in rows if not by or " ".join(str(r[c]) for c in by) == g]
            series[f"{g}: {key}" if by and len(_banded(rows)) > 1 else (g or key)] = (part, key)
    for i, (name, (part, key)) in enumerate(series.items()):
        for trace in band_traces(name, [r[x] for r in part], part, key, COLORS[i % len(COLORS)]):
            fig.add_trace(trace)
    fig.update_layout(title=title, xaxis_title="training step", yaxis_title=ytitle, height=420)
    return fig


def _bound(v: Any, last: float) -> tuple[Optional[float], bool]:
    """A formation step or bound as a number, and whether it is open ("after N": not reached by the last step);
    "at or before step N" (left-censored) reads as N."""
    if isinstance(v, str) and v.startswith("after "):
        return last, True
    if isinstance(v, str) and v.startswith("at or before "):
        return float(v.rsplit(" ", 1)[-1]), False
    return _num(v), False


def formation_points(rows: list[dict], last: float) -> list[dict]:
    """Per component and level (the ``step_<level>`` columns), its formation step and interval; ``open``: the
    interval reaches past the last step. Rows of an older table (``formed_at_step``, no interval) give the step
    alone."""
    out = []
    for r in rows:
        levels = [k[5:] for k in r if k.startswith("step_") and not k.endswith(("_low", "_high"))]
        for level in levels or ["formed"]:
            key = f"step_{level}" if levels else "formed_at_step"
            step, _ = _bound(r.get(key), last)
            if step is None:
                continue
            low, _ = _bound(r.get(f"{key}_low", step), last)
            high, open_ = _bound(r.get(f"{key}_high", step), last)
            out.append(
                {"component": r["component"], "level": level, "step": step, "low": low, "high": high, "open": open_}
            )
    return out


def formation_figure(points: list[dict], steps: Sequence[float]) -> Any:
    """Each component's formation step at each level with its interval (an open end: beyond the last step)."""
    import plotly.graph_objects as go

    fig = go.Figure()
    for i, level in enumerate(dict.fromkeys(p["level"] for p in points)):
        at = [p for p in points if p["level"] == level]
        fig.add_trace(
            go.Scatter(
                x=[p["step"] for p in at],
                y=[p["component"] for p in at],
                mode="markers",
                name=f"reaches {level}" if level != "formed" else "formed at",
                marker=dict(
                    size=9,
                    color=COLORS[i % len(COLORS)],
                    symbol=["triangle-right" if p["open"] else "circle" for p in at],
                ),
                error_x=dict(
                    type="data",
                    symmetric=False,
                    array=[p["high"] - p["step"] for p in at],
                    arrayminus=[p["step"] - p["low"] for p in at],
                ),
                customdata=[[p["low"], p["high"], " or later" if p["open"] else ""] for p in at],
                hovertemplate="%{y}<br>step %{x} [%{customdata[0]}, %{customdata[1]}%{customdata[2]}]<extra></extra>",
            )
        )
    fig.update_layout(
        title="Formation step of each component (bootstrap 95% CI; a triangle: the interval runs past the last step)",
        xaxis=dict(title="training step", range=[min(steps) - 1, max(steps) + 1]),
        height=120 + 40 * len({p["component"] for p in points}),
        yaxis=dict(automargin=True),
    )
    return fig


def matrix_figure(rows: list[dict]) -> Any:
    """The overlap matrix (``structure_matrix``: a row per step, a column per step) as a heatmap."""
    import plotly.graph_objects as go

    steps = [str(r["step"]) for r in rows]
    z = [[_num(r.get(s)) for s in steps] for r in rows]
    fig = go.Figure(
        go.Heatmap(
            z=z,
            x=steps,
            y=steps,
            colorscale="Viridis",
            colorbar=dict(title="Jaccard"),
            hovertemplate="step %{y} against step %{x}: %{z:.3f}<extra></extra>",
        )
    )
    fig.update_layout(
        title="Mean overlap of top-n pair sets on opposite halves of every two checkpoints (diagonal: the null)",
        xaxis=dict(title="step", type="category"),
        yaxis=dict(title="step", type="category", autorange="reversed"),
        height=520,
    )
    return fig


def membership_figure(steps: list[Any], sets: dict[Any, set[str]], title: str, ztitle: str) -> Any:
    """Heads (rows, those in any set) against the steps; a cell is 1 where the head is in that step's set."""
    import plotly.graph_objects as go

    heads = sorted(set().union(*sets.values()), key=hkey) if sets else []
    z = [[int(h in sets.get(s, set())) for s in steps] for h in heads]
    fig = go.Figure(
        go.Heatmap(
            z=z,
            x=[str(s) for s in steps],
            y=heads,
            zmin=0,
            zmax=1,
            colorscale=[[0, "#f4f4f4"], [1, "#1f77b4"]],
            showscale=False,
            xgap=1,
            ygap=1,
            hovertemplate="%{y} at step %{x}: " + ztitle + " %{z}<extra></extra>",
        )
    )
    fig.update_layout(
        title=title,
        xaxis=dict(title="step", type="category"),
        yaxis=dict(title="head", type="category", autorange="reversed"),
        height=160 + 14 * len(heads),
    )
    return fig


def circuit_heads(path: Path) -> set[str]:
    """The heads of a circuit file (``groups``: name -> heads)."""
    data = json.loads(path.read_text())
    return {h for heads in (data.get("groups") or {}).values() for h in heads if HEAD.match(h)}


class TrajectoryRun:
    """What the page shows of a trajectory run directory, read from its committed files."""

    def __init__(self, run_dir: Path) -> None:
        from ..runs.stages import label

        self.dir = run_dir
        self.manifest = json.loads((run_dir / "run.json").read_text())
        settings = self.manifest["settings"]
        self.task = settings["task"]["name"]
        self.names = list(settings["models"]["checkpoints"])
        self.tables = {p.stem: json.loads(p.read_text()) for p in sorted((run_dir / "tables").glob("*.json"))}
        acc = self.tables.get("accuracy") or []
        by_name = {r["checkpoint"]: r["step"] for r in acc}
        self.steps = [by_name.get(n, i) for i, n in enumerate(self.names)]
        self.circuit_files = {s: run_dir / "circuits" / f"{label(n)}.json" for s, n in zip(self.steps, self.names)}

    def measures(self, figs: Figures) -> list[str]:
        """A figure per measure of `MEASURES` the run has a banded table of."""
        body = []
        for stem, x, by, title, ytitle in MEASURES:
            rows = self.tables.get(stem)
            if rows and _banded(rows):
                title += structure_band(stem, rows)
                body.append(figs.div(measure_figure(rows, x, by, title, ytitle), f"measure-{stem}"))
        return body

    def formation(self, figs: Figures) -> dict[str, Any]:
        """``figure``: the formation steps with their intervals (None: no component formed); ``undated``: the
        formation table predates intervals (each step shown alone)."""
        rows = self.tables.get("formation") or []
        points = formation_points(rows, max(self.steps))
        if not points:
            return {"figure": None, "undated": False}
        dated = any(p["low"] != p["high"] for p in points) or any("_low" in k for r in rows for k in r)
        return {"figure": figs.div(formation_figure(points, self.steps), "formation"), "undated": not dated}

    def matrix(self, figs: Figures) -> Optional[str]:
        """The overlap matrix of every two checkpoints; None where the run has none."""
        rows = self.tables.get("structure_matrix")
        return figs.div(matrix_figure(rows), "overlap_matrix") if rows else None

    def held_roles(self, figs: Figures) -> list[dict[str, Any]]:
        """Per role (group, desideratum) of ``tables/roles.json`` (the study's ``[roles]`` stage): ``figure``, a
        heads x steps chart of the heads holding it (None where no scored head holds it), and its ``group`` and
        ``desideratum`` (as the page writes them); none where the run has no such table."""
        rows = self.tables.get("roles") or []
        held = []
        for i, (g, d) in enumerate(dict.fromkeys((r["group"], r["desideratum"]) for r in rows)):
            sets = {r["step"]: _heads(r["holding"]) for r in rows if (r["group"], r["desideratum"]) == (g, d)}
            title = f"Heads holding {g} / {d} at each checkpoint scored (tables/roles.md: how a head holds a role)"
            figure = (
                figs.div(membership_figure(self.steps, sets, title, "holds"), f"held-role-{i}")
                if any(sets.values())
                else None
            )
            held.append({"figure": figure, "group": Markup(inline(g)), "desideratum": Markup(inline(d))})
        return held

    def roles(self, figs: Figures) -> dict[str, Any]:
        """``held``: the heads holding each role at each step where the study scored them (``[roles]``), with
        ``moves``, the table of heads joining and leaving a role; else ``by_step``, DCM head sets per checkpoint
        where ``tables/dcm_labels.json`` has a ``step`` column, a figure per role; else ``labels``, the table of
        the roles labelled once (None: none); and ``membership``, the circuits' heads over the steps."""
        out: dict[str, Any] = {"held": self.held_roles(figs), "moves": None, "by_step": [], "labels": None}
        labels = self.tables.get("dcm_labels") or []
        if out["held"]:
            for name in ("role_transitions", "role_takeovers"):  # the second: runs before joins and leaves were named
                moves = self.tables.get(name)
                if moves:
                    out["moves"] = table_html(moves, caption(self.dir / f"tables/{name}.json"), f"tables/{name}.csv")
                    break
        elif labels and "step" in labels[0]:
            roles = dict.fromkeys((r["group"], r["desideratum"]) for r in labels)
            for i, (g, d) in enumerate(roles):
                sets = {r["step"]: _heads(r["selected"]) for r in labels if (r["group"], r["desideratum"]) == (g, d)}
                fig = membership_figure(self.steps, sets, f"DCM heads of {g} / {d} at each checkpoint", "selected")
                out["by_step"].append(figs.div(fig, f"role-{i}"))
        elif labels:
            out["labels"] = table_html(labels, caption(self.dir / "tables/dcm_labels.json"), "tables/dcm_labels.csv")
        sets = {s: circuit_heads(p) for s, p in self.circuit_files.items() if p.exists()}
        title = "Heads of each checkpoint's own circuit (any position class)"
        membership = membership_figure(self.steps, sets, title, "in circuit") if sets else None
        out["membership"] = figs.div(membership, "circuit_membership") if membership is not None else None
        return out


def _heads(selected: Any) -> set[str]:
    items = selected.split() if isinstance(selected, str) else list(selected or [])
    return {h for h in items if h != "-"}


def findings(readme: str) -> list[tuple[Markup, Markup]]:
    """The README's findings sections (``## Findings...``), as the study wrote them: (heading, its Markdown as
    HTML)."""
    parts = sections(readme)
    return [(Markup(inline(n)), Markup(markdown_html(t))) for n, t in parts.items() if n.startswith("Findings")]


def trajectory_page(run_dir: Path) -> tuple[str, str]:
    """Title and body of the page of a trajectory run (``templates/trajectory.html.j2``)."""
    run = TrajectoryRun(run_dir)
    report = (run_dir / "report.md").read_text() if (run_dir / "report.md").exists() else ""
    readme = (run_dir / "README.md").read_text() if (run_dir / "README.md").exists() else ""
    figs = Figures()
    title = f"{run.task}: trajectory over {len(run.names)} checkpoints ({run.names[0]} to {run.names[-1]})"
    # the figures in the page's order: the first carries plotly.js
    formation, measures, matrix, roles = run.formation(figs), run.measures(figs), run.matrix(figs), run.roles(figs)
    tables = [
        table_html(rows, caption(run_dir / "tables" / f"{stem}.json"), f"tables/{stem}.csv")
        for stem, rows in run.tables.items()
        if rows and isinstance(rows, list) and isinstance(rows[0], dict)
    ]
    stages = stage_rows(run.manifest)
    body = render(
        "trajectory.html.j2",
        lead=Markup(inline(sections(report).get("", ""))) if report else None,
        findings=findings(readme),
        formation=formation,
        measures=measures,
        matrix=matrix,
        roles=roles,
        tables=tables,
        stages=table_html(stages, "What ran", "run.json") if stages else None,
    )
    return title, body
