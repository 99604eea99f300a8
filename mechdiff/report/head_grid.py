"""The layer x head grid of `report.html` (`mechdiff.report.html`): one heatmap per model or circuit, one per pair of
them (the difference), a button per view, and a hover text that shows every score the run holds for each head.
"""

from __future__ import annotations

import json
from typing import Any, Iterable, Optional

from markupsafe import Markup

from .page_kit import HEAD, Figures, hkey, render


class Grid:
    """The layer x head grid: one heatmap per model or circuit (cell: how many position classes of the head its
    circuit holds), one per pair (the difference), a button per view. The hover text is built in the page from
    one compact data block (every score once), so the file stays small; the tooltip is Plotly's own."""

    def __init__(self, n_layers: int, n_heads: int) -> None:
        self.n_layers, self.n_heads = n_layers, n_heads
        self.classes: list[str] = []
        self._notes: dict[str, int] = {}
        self.members: dict[str, list[list[int]]] = {}
        self.views: list[dict] = []

    def _class(self, c: str) -> int:
        if c not in self.classes:
            self.classes.append(c)
        return self.classes.index(c)

    def circuit(self, name: str, pairs: dict[str, set[str]]) -> None:
        """A circuit whose membership every hover line of a pair lists."""
        self.members[name] = [[*hkey(h), self._class(c)] for h, cs in pairs.items() for c in sorted(cs)]

    def add(self, name: str, circuit: Optional[str], scores: list[dict], notes: dict[str, list[str]]) -> None:
        """A view of one model: cells count the classes of ``circuit``; hover: per class of a head, the ``scores``
        rows (``head``, ``position``, attribution, rank, selection frequency, path patching) and the circuits
        holding the pair, then the head's ``notes``."""
        rows = []
        for r in scores:
            row = [
                *hkey(r["head"]),
                self._class(r["position"]),
                *(_round(r.get(k)) for k in ("attribution", "rank", "selection_frequency", "path_patching")),
            ]
            while row[-1] is None:  # the page reads a missing score as none
                row.pop()
            rows.append(row)
        self.views.append(
            {
                "name": name,
                "circuit": circuit,
                "pairs": rows,
                "notes": {h: [self._note(n) for n in notes[h]] for h in sorted(notes, key=hkey)},
            }
        )

    def _note(self, text: str) -> int:
        """Index of a note line in the shared list (a group's CMAP or DCM lines repeat for each of its heads)."""
        if text not in self._notes:
            self._notes[text] = len(self._notes)
        return self._notes[text]

    def difference(self, a: str, b: str) -> None:
        """``b`` minus ``a`` in classes per head (both circuits must have been added)."""
        self.views.append({"name": f"{b} - {a}", "a": a, "b": b})

    def data(self) -> dict:
        return {
            "layers": self.n_layers,
            "heads": self.n_heads,
            "classes": self.classes,
            "members": self.members,
            "views": self.views,
            "notes": list(self._notes),
        }

    def figure(self, title: str) -> Any:
        """Heatmaps with empty hover text (filled in the page by `GRID_JS`)."""
        import plotly.graph_objects as go

        fig = go.Figure()
        for i, view in enumerate(self.views):
            diff = "a" in view
            z = [[0] * self.n_layers for _ in range(self.n_heads)]
            if diff:
                for sign, key in ((-1, "a"), (1, "b")):
                    for layer, h, _ in self.members[view[key]]:
                        z[h][layer] += sign
            elif view["circuit"]:
                for layer, h, _ in self.members[view["circuit"]]:
                    z[h][layer] += 1
            top = max((abs(v) for row in z for v in row), default=1) or 1
            fig.add_trace(
                go.Heatmap(
                    z=z,
                    hovertemplate="%{text}<extra></extra>",
                    name=view["name"],
                    visible=i == 0,
                    colorscale="RdBu" if diff else "Viridis",
                    zmid=0 if diff else None,
                    zmin=-top if diff else 0,
                    zmax=top,
                    xgap=1,
                    ygap=1,
                    colorbar=dict(title="classes"),
                )
            )
        buttons = [
            dict(
                label=v["name"],
                method="update",
                args=[{"visible": [j == i for j in range(len(self.views))]}, {"title.text": f"{title}: {v['name']}"}],
            )
            for i, v in enumerate(self.views)
        ]
        fig.update_layout(
            title=f"{title}: {self.views[0]['name']}" if self.views else title,
            height=480,
            xaxis=dict(title="layer", dtick=1),
            yaxis=dict(title="head", dtick=1),
            hoverlabel=dict(align="left", font=dict(family="monospace", size=11)),
            updatemenus=[
                dict(
                    type="buttons",
                    direction="right",
                    buttons=buttons,
                    x=0,
                    y=1.02,
                    xanchor="left",
                    yanchor="bottom",
                    showactive=True,
                )
            ]
            if len(self.views) > 1
            else [],
        )
        return fig

    def html(self, figs: "Figures", title: str, div_id: str = "grid") -> str:
        """The grid's data block and figure, its hover filled by ``gridText`` (``templates/grid.js``)."""
        data = json.dumps(self.data(), separators=(",", ":")).replace("</", "<\\/")
        fill = (
            "var t = gridText(GRID_DATA); Plotly.restyle('{plot_id}', {text: t}, t.map(function (_, i) { return i; }));"
        )
        return render("grid.html.j2", data=Markup(data), figure=figs.div(self.figure(title), div_id, post_script=fill))


def _round(v: Any) -> Any:
    """Three significant digits, as the hover shows them (the tables keep every digit)."""
    return float(f"{v:.3g}") if isinstance(v, float) else v


def grid_shape(heads: Iterable[str]) -> tuple[int, int]:
    """Layers and heads per layer of the grid: the largest seen (the files hold no model shape)."""
    layers, per = 0, 0
    for h in heads:
        m = HEAD.match(h)
        if m:
            layers, per = max(layers, int(m.group(1)) + 1), max(per, int(m.group(2)) + 1)
    return layers, per
