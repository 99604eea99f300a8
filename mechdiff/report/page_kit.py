"""The pieces every ``report.html`` page is built from: the report's Markdown as HTML, tables, Plotly figures with
plotly.js inlined once (gzipped), a run's sections, captions and stage rows, and head names (``L14H7``). The page,
its tables and figures are jinja2 templates (``templates/*.j2``, package data), their style and scripts files there
inlined into the one page (`asset`)."""

from __future__ import annotations

import html
import re
from functools import cache
from importlib.resources import files
from pathlib import Path
from typing import Any, Optional

from jinja2 import Environment, PackageLoader, StrictUndefined
from markupsafe import Markup

from .tables import format_value

HEAD = re.compile(r"^L(\d+)H(\d+)$")


@cache
def _templates() -> Environment:
    """The report templates (``mechdiff/report/templates``): every value escaped unless it is `Markup` (HTML the
    page's own code built), an unknown name an error."""
    return Environment(loader=PackageLoader("mechdiff.report"), autoescape=True, undefined=StrictUndefined)


def render(template: str, **values: Any) -> Markup:
    """The HTML of ``templates/<template>`` with ``values``."""
    return Markup(_templates().get_template(template).render(asset=asset, **values))


@cache
def asset(name: str) -> Markup:
    """A style or script file of ``templates/`` (``page.css``, ``loader.js``, ...), inlined as it is."""
    return Markup(files("mechdiff.report").joinpath("templates", name).read_text(encoding="utf-8"))


def caption(path: Path) -> str:
    """The bold first line of the table's Markdown twin, if any."""
    md = path.with_suffix(".md")
    if md.exists():
        first = md.read_text().lstrip().split("\n", 1)[0]
        if first.startswith("**") and first.endswith("**"):
            return first.strip("*")
    return ""


def sections(text: str) -> dict[str, str]:
    """``{"": lead, heading: body}`` of a Markdown report's ``##`` sections."""
    out, name, buf = {}, "", []
    for line in text.splitlines():
        if line.startswith("## "):
            out[name], name, buf = "\n".join(buf).strip(), line[3:].strip(), []
        elif not line.startswith("# "):
            buf.append(line)
    out[name] = "\n".join(buf).strip()
    return out


def inline(text: str) -> str:
    text = html.escape(text, quote=False)
    text = re.sub(r"`([^`]+)`", r"<code>\1</code>", text)
    return re.sub(r"\*\*([^*]+)\*\*", r"<b>\1</b>", text)


def markdown_html(text: str) -> str:
    """The Markdown the reports write: paragraphs, nested ``-`` lists with continuation lines, bold, code.
    Tables and images are left out (the page has its own)."""
    out, depth, para = [], [], []

    def close_para() -> None:
        if para:
            out.append(f"<p>{inline(' '.join(para))}</p>")
            para.clear()

    for line in text.splitlines():
        if not line.strip() or line.lstrip().startswith(("|", "![")):
            close_para()
            continue
        m = re.match(r"^( *)- (.*)$", line)
        if m:
            close_para()
            indent = len(m.group(1))
            while depth and depth[-1] > indent:
                out.append("</li></ul>")
                depth.pop()
            if depth and depth[-1] == indent:
                out.append("</li><li>")
            else:
                out.append("<ul><li>")
                depth.append(indent)
            out.append(inline(m.group(2)))
        elif depth:
            out.append(("<br>" if line.startswith("  ") and not line.startswith("   ") else " ") + inline(line.strip()))
        else:
            para.append(line.strip())
    close_para()
    out += ["</li></ul>"] * len(depth)
    return "".join(out)


def table_html(rows: list[dict], caption: str = "", name: str = "") -> str:
    """A sortable table (click a header): ``x``/``x_low``/``x_high`` shown as ``x [low, high]``, sorted by ``x``."""
    cols: dict[str, None] = {}
    for r in rows:
        cols.update(dict.fromkeys(r))
    merged = {c for c in cols if f"{c}_low" in cols and f"{c}_high" in cols}
    shown = [c for c in cols if not any(c in (f"{m}_low", f"{m}_high") for m in merged)]
    body = []
    for r in rows:
        cells = []
        for c in shown:
            v = r.get(c)
            text = format_value(v, ".3f")
            if c in merged and v is not None:
                text += f" [{format_value(r.get(c + '_low'), '.3f')}, {format_value(r.get(c + '_high'), '.3f')}]"
            key = v if isinstance(v, (int, float)) and not isinstance(v, bool) else None
            cells.append((text, None if key is None else repr(key)))
        body.append(cells)
    columns = [f"{c}{' [95% CI]' if c in merged else ''}" for c in shown]
    return render("table.html.j2", caption=Markup(inline(caption)), name=name, columns=columns, rows=body)


class Figures:
    """Plotly figures as HTML divs (``templates/figure.html.j2``), drawn once plotly.js is loaded
    (``templates/loader.js``): the first div carries
    plotly.js gzipped and base64-encoded (1.9 MB instead of 4.8 MB), which the page decompresses in the browser
    with no network; each figure is its JSON and the call that draws it."""

    def __init__(self) -> None:
        self.count = 0

    def div(self, fig: Any, div_id: str, post_script: Optional[str] = None) -> str:
        # no template: a template is written into every figure (some 7 kB each); a few axis settings instead
        fig.update_layout(
            template="none",
            font=dict(family="system-ui, sans-serif", size=12),
            margin=dict(l=60, r=20, t=110 if fig.layout.updatemenus else 60, b=50),
        )
        fig.update_xaxes(showgrid=True, gridcolor="#eee", zeroline=False, showline=True, linecolor="#999")
        fig.update_yaxes(showgrid=True, gridcolor="#eee", zeroline=False, showline=True, linecolor="#999")
        out = render(
            "figure.html.j2",
            plotly_gz=plotly_gz() if self.count == 0 else "",
            div_id=div_id,
            spec=Markup(fig.to_json().replace("</", "<\\/")),  # JSON in a script: no "</" may close it
            config=Markup('{"displaylogo": false, "responsive": true}'),
            then=Markup((post_script or "").replace("{plot_id}", div_id)),
        )
        self.count += 1
        return out


@cache
def plotly_gz() -> str:
    """plotly.js (the one plotly ships) gzipped (no time stamp: the same bytes on every run) in base64."""
    import base64
    import gzip

    from plotly.offline import get_plotlyjs

    return base64.b64encode(gzip.compress(get_plotlyjs().encode(), 9, mtime=0)).decode()


def hkey(name: str) -> tuple[int, int]:
    m = HEAD.match(name)
    return (int(m.group(1)), int(m.group(2))) if m else (1 << 30, 0)


def stage_rows(manifest: dict, keys: bool = True) -> list[dict]:
    """The stage table: each stage's seconds, with its planned FLOPs and the share of the machine's measured
    matrix-multiply throughput it reached (`stage_compute`) where ``run.json`` records them, whether this
    invocation reused it and (with ``keys``) its key."""
    stages = manifest.get("stages", {})
    if not isinstance(stages, dict):
        return []
    rows = []
    for n, s in stages.items():
        if isinstance(s, dict):
            row = {"stage": n, "seconds": s.get("seconds"), **stage_compute(manifest, n), "cached": s.get("cached")}
            rows.append({**row, "key": s.get("key")} if keys else row)
    return rows


#: The stage table's compute columns (`stage_compute`).
GFLOP, SHARE = "GFLOP (planned)", "share of mm throughput"


def stage_compute(manifest: dict, stage: str) -> dict:
    """``stage``'s planned GFLOP and FLOPs / (seconds x throughput): the share of this machine's matrix-multiply
    throughput (FLOP per CPU second, measured when ``run.json`` was written) the stage reached in its seconds;
    nothing where ``run.json`` records no plan (a GPU or NDIF run, or one made before it did)."""
    record = manifest.get("resources")
    if not isinstance(record, dict) or "stage_flops" not in record:
        return {}
    flops, seconds = record["stage_flops"].get(stage), manifest["stages"][stage].get("seconds")
    if flops is None:
        return {GFLOP: None, SHARE: None}
    share = flops / (seconds * record["throughput"]) if seconds else None
    return {GFLOP: flops / 1e9, SHARE: share}
