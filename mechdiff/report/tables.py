"""One table, four formats: Markdown, CSV, LaTeX and JSON, from one list of flat dicts.

A figure with a confidence interval is three columns, ``x``, ``x_low``, ``x_high``
(`estimate_columns`); CSV and JSON keep them apart (so they read back exactly), while
Markdown and LaTeX show them as one column ``x [95% CI]`` = ``0.660 [0.610, 0.705]``.
"""

from __future__ import annotations

import csv
import io
import json
import math
from pathlib import Path
from typing import Any, Iterable, Mapping, Sequence

from tabulate import tabulate

from ..common.inference import Interval
from ..common.io import write_text

FORMATS = ("md", "csv", "tex", "json")


def estimate_columns(name: str, est: Interval | Mapping[str, Any]) -> dict[str, float]:
    """``{name: value, name_low: low, name_high: high}`` from an Interval or its ``to_dict``."""
    d = est.to_dict() if isinstance(est, Interval) else est
    return {name: d["value"], f"{name}_low": d["low"], f"{name}_high": d["high"]}


def _columns(rows: Sequence[Mapping[str, Any]]) -> list[str]:
    cols: dict[str, None] = {}
    for r in rows:
        cols.update(dict.fromkeys(r))
    return list(cols)


def format_value(value: Any, floatfmt: str) -> str:
    if isinstance(value, float):
        if math.isnan(value):
            return "nan"
        text = format(value, floatfmt)
        return format(value, ".2e") if value != 0 and float(text) == 0 else text  # tiny p-values stay readable
    return "" if value is None else str(value)


def display_rows(rows: Sequence[Mapping[str, Any]], floatfmt: str = ".3f") -> tuple[list[str], list[list[str]]]:
    """Headers and formatted cells, with ``x``/``x_low``/``x_high`` merged into ``x [95% CI]``."""
    cols = _columns(rows)
    merged = {c for c in cols if f"{c}_low" in cols and f"{c}_high" in cols}
    shown = [c for c in cols if not any(c in (f"{m}_low", f"{m}_high") for m in merged)]
    headers = [f"{c} [95% CI]" if c in merged else c for c in shown]
    body = []
    for r in rows:
        cells = []
        for c in shown:
            text = format_value(r.get(c), floatfmt)
            if c in merged and r.get(c) is not None:
                text += f" [{format_value(r.get(c + '_low'), floatfmt)}, {format_value(r.get(c + '_high'), floatfmt)}]"
            cells.append(text)
        body.append(cells)
    return headers, body


def to_markdown(rows: Sequence[Mapping[str, Any]], floatfmt: str = ".3f") -> str:
    headers, body = display_rows(rows, floatfmt)
    return tabulate(body, headers=headers, tablefmt="github", disable_numparse=True)


def to_latex(rows: Sequence[Mapping[str, Any]], floatfmt: str = ".3f", caption: str | None = None) -> str:
    headers, body = display_rows(rows, floatfmt)
    table = tabulate(body, headers=headers, tablefmt="latex_booktabs", disable_numparse=True)
    if caption is None:
        return table
    return "\\begin{table}[t]\n\\centering\n" + table + f"\n\\caption{{{_latex_escape(caption)}}}\n\\end{{table}}"


def _latex_escape(text: str) -> str:
    return "".join("\\" + ch if ch in "&%$#_{}" else ch for ch in text)


def to_csv(rows: Sequence[Mapping[str, Any]]) -> str:
    buf = io.StringIO()
    writer = csv.DictWriter(buf, fieldnames=_columns(rows), lineterminator="\n")
    writer.writeheader()
    for r in rows:
        writer.writerow({k: ("" if v is None else repr(v) if isinstance(v, float) else v) for k, v in r.items()})
    return buf.getvalue()


def write_table(
    rows: Sequence[Mapping[str, Any]],
    stem: str | Path,
    formats: Iterable[str] = FORMATS,
    caption: str | None = None,
    floatfmt: str = ".3f",
) -> dict[str, Path]:
    """Write ``rows`` to ``stem.md``, ``stem.csv``, ``stem.tex`` and ``stem.json`` (atomically; a dot in
    ``stem``'s name is kept: ``run.minimality`` -> ``run.minimality.csv``)."""
    rows = [dict(r) for r in rows]
    if not rows:
        raise ValueError(f"no rows to write to {stem}")
    stem = Path(stem)
    render = {
        "md": lambda: (f"**{caption}**\n\n" if caption else "") + to_markdown(rows, floatfmt) + "\n",
        "csv": lambda: to_csv(rows),
        "tex": lambda: to_latex(rows, floatfmt, caption) + "\n",
        "json": lambda: json.dumps(rows, indent=2) + "\n",
    }
    unknown = set(formats) - set(render)
    if unknown:
        raise ValueError(f"unknown table formats {sorted(unknown)}; choose from {FORMATS}")
    return {fmt: write_text(stem.with_name(f"{stem.name}.{fmt}"), render[fmt]()) for fmt in formats}


def _parse(cell: str) -> Any:
    if cell == "":
        return None
    if cell in ("True", "False"):
        return cell == "True"
    for kind in (int, float):
        try:
            return kind(cell)
        except ValueError:
            pass
    return cell


def read_table(path: str | Path) -> list[dict]:
    """Read back a table written as ``.csv`` (numbers and booleans parsed) or ``.json``."""
    path = Path(path)
    if path.suffix == ".json":
        return json.loads(path.read_text())
    if path.suffix == ".csv":
        with path.open(newline="") as f:
            return [{k: _parse(v) for k, v in r.items()} for r in csv.DictReader(f)]
    raise ValueError(f"cannot read {path}: only .csv and .json tables read back")
