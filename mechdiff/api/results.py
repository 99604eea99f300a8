"""A study's results read back from its directory: tables as `pandas.DataFrame`, estimates with their intervals,
circuits and figures (`Results`). Reads only the files a run wrote (``tables/*.json``, ``circuits/*.json``,
``run.json``); loads no model and imports no torch."""

from __future__ import annotations

import json
import textwrap
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, Optional

import pandas as pd

from ..circuits.circuit import Circuit
from ..common.inference import Interval
from ..report.tables import read_table
from ..runs.stages import label

if TYPE_CHECKING:
    from matplotlib.figure import Figure

__all__ = ["Results", "Estimate", "Circuit", "interval_figure"]

#: Characters a row's label of `interval_figure` holds a line.
LABEL_WIDTH = 50
#: The table each reader returns (`Results.accuracy`, `Results.faithfulness`, `Results.families`).
ACCURACY, FAITHFULNESS, FAMILIES = "accuracy", "circuit_x_model", "families"


@dataclass(frozen=True)
class Estimate:
    """One figure with its 95% interval, as the inference layer made it (`mechdiff.common.inference.Interval`)
    and, where it is a tested claim, its p (``p_holm``: Holm-adjusted within its ``family``).

    ``items`` counts the independent units the interval resamples (a row's item), ``rows`` the rows."""

    value: float
    low: float
    high: float
    rows: int
    items: int
    method: str
    claim: str = ""
    family: str = ""
    p: Optional[float] = None
    p_holm: Optional[float] = None

    def __str__(self) -> str:
        return f"{self.value:.3f} [{self.low:.3f}, {self.high:.3f}]"

    @property
    def excludes_zero(self) -> bool:
        """Whether the interval leaves 0 out."""
        return self.interval().excludes(0.0)

    def interval(self) -> Interval:
        """The inference layer's `Interval` of this estimate."""
        return Interval(self.value, self.low, self.high, self.rows, self.items, self.method)

    @classmethod
    def from_interval(cls, interval: Interval, claim: str = "", p: Optional[float] = None) -> "Estimate":
        """An estimate from an `Interval` (and the claim it supports, with its p where tested)."""
        i = interval
        return cls(i.value, i.low, i.high, i.n_rows, i.n_items, i.method, claim, p=p)

    @classmethod
    def from_family_row(cls, row: dict[str, Any]) -> "Estimate":
        """An estimate from one row of a study's ``families`` table."""
        p_holm = row.get("p_holm")
        return cls(
            float(row["estimate"]),
            float(row["low"]),
            float(row["high"]),
            int(row["rows"]),
            int(row["items"]),
            str(row["method"]),
            str(row["claim"]),
            str(row["family"]),
            None if row.get("p") is None else float(row["p"]),
            None if p_holm is None else float(p_holm),
        )


class Results:
    """The results directory of a study (``mechdiff run`` or `Study.run` wrote it), read from its files.

    ``Results.load("results/ioi-smollm2").accuracy()`` is the ``tables/accuracy.json`` a run wrote, as a
    DataFrame; every table a run wrote is `table` by its name (`tables`)."""

    def __init__(self, directory: str | Path):
        self.dir = Path(directory)
        if not (self.dir / "tables").is_dir() and not (self.dir / "run.json").is_file():
            raise FileNotFoundError(
                f"{self.dir} holds no study's results (no tables/ or run.json): give a results directory that "
                "`mechdiff run` or `Study.run()` wrote, e.g. results/entity-tracking-smollm2"
            )

    @classmethod
    def load(cls, directory: str | Path) -> "Results":
        """The results in ``directory``; refused where it holds none."""
        return cls(directory)

    def __repr__(self) -> str:
        return f"Results({str(self.dir)!r})"

    @property
    def manifest(self) -> dict[str, Any]:
        """``run.json``: the study's kind, settings, versions and each stage's key and time (empty if absent)."""
        path = self.dir / "run.json"
        return json.loads(path.read_text()) if path.is_file() else {}

    @property
    def kind(self) -> str:
        """The study's kind (``circuits``, ``knowledge``, ``headmap``, ``trajectory``), from ``run.json``."""
        return str(self.manifest.get("kind", ""))

    def stage_keys(self) -> dict[str, str]:
        """Each stage's name -> its key, as ``run.json`` records them."""
        return {name: s["key"] for name, s in self.manifest.get("stages", {}).items()}

    def tables(self) -> list[str]:
        """The names of the tables the run wrote (``tables/NAME.json`` or ``.csv``), sorted."""
        found = {p.stem for p in (self.dir / "tables").glob("*") if p.suffix in (".json", ".csv")}
        return sorted(found)

    def table(self, name: str) -> pd.DataFrame:
        """The table ``name`` (`tables`) as written, one row a record: its JSON where written, else its CSV. An
        estimate is three columns, ``x``, ``x_low`` and ``x_high`` (its 95% interval)."""
        for suffix in (".json", ".csv"):
            path = self.dir / "tables" / f"{name}{suffix}"
            if path.is_file():
                return pd.DataFrame(read_table(path))
        raise KeyError(f"{self.dir} has no table {name!r}; its tables: {', '.join(self.tables()) or 'none'}")

    def accuracy(self) -> pd.DataFrame:
        """Each model's accuracy, answer probability and logit difference, each with its interval columns."""
        return self.table(ACCURACY)

    def faithfulness(self) -> pd.DataFrame:
        """The circuit x model matrix: each model's circuit scored in each model (faithfulness with its interval,
        the random circuits' control where drawn)."""
        return self.table(FAITHFULNESS)

    def families(self) -> pd.DataFrame:
        """Every tested claim: its family, estimate, interval, p and Holm's p, whether it is shown, its rows and
        items."""
        return self.table(FAMILIES)

    def estimates(self, family: Optional[str] = None) -> list[Estimate]:
        """The claims of the ``families`` table as `Estimate` (``family``: only that family's)."""
        rows = read_table(self.dir / "tables" / f"{FAMILIES}.json")
        return [Estimate.from_family_row(r) for r in rows if family is None or r["family"] == family]

    def circuit(self, model: str, pruned: bool = False) -> Circuit:
        """The circuit the study found in ``model`` (``pruned``: after pruning), from ``circuits/``."""
        path = self.dir / "circuits" / f"{label(model)}{'.pruned' if pruned else ''}.json"
        if not path.is_file():
            known = sorted(p.name for p in (self.dir / "circuits").glob("*.json"))
            raise KeyError(f"{self.dir} has no circuit {path.name}; its circuits: {', '.join(known) or 'none'}")
        return Circuit.from_dict(json.loads(path.read_text()))  # the run's own file: no task to load to check it

    def figure(self, table: str = FAMILIES, value: str = "", by: str = "", where: Optional[dict] = None) -> Figure:
        """A figure of one table's estimates with their intervals (`interval_figure`): ``value``'s column and its
        ``_low``/``_high`` ones (default: ``estimate``, ``low``, ``high`` of the families table, else the table's
        first estimate), one row a label from ``by`` (default: its ``claim`` or first text column); ``where``: keep
        only the rows whose columns equal these values."""
        frame = self.table(table)
        for column, wanted in (where or {}).items():
            frame = frame[frame[column] == wanted]
        return interval_figure(frame, value, by, title=f"{self.dir.name}: {table}")

    def report(self) -> Path:
        """Write ``report.html`` from the directory's files (as ``mechdiff view``) and return its path."""
        from ..report.html import write_html

        return write_html(self.dir)


def _estimate_columns(frame: pd.DataFrame, value: str) -> tuple[str, str, str]:
    """The value, low and high columns of ``value`` in ``frame`` (``estimate``/``low``/``high``, or ``x``/``x_low``/
    ``x_high``); default the first such."""
    if not value:
        if {"estimate", "low", "high"} <= set(frame.columns):
            return "estimate", "low", "high"
        found = [c for c in frame.columns if f"{c}_low" in frame.columns and f"{c}_high" in frame.columns]
        if not found:
            raise ValueError(f"no column with an interval among {list(frame.columns)}; give value=")
        value = found[0]
    if value == "estimate":
        return "estimate", "low", "high"
    if f"{value}_low" not in frame.columns or f"{value}_high" not in frame.columns:
        raise ValueError(f"column {value!r} has no {value}_low/{value}_high interval columns in {list(frame.columns)}")
    return value, f"{value}_low", f"{value}_high"


def interval_figure(frame: pd.DataFrame, value: str = "", by: str = "", title: str = "") -> Figure:
    """Each row of ``frame`` as a point (``value``) with its interval bar (``value_low`` to ``value_high``, or
    ``low``/``high`` for ``estimate``), labelled by ``by`` (default ``claim``, else the first text column), and a
    line at 0 where the intervals are of differences (some below 0). A `matplotlib.figure.Figure`, no window
    opened (save it with ``fig.savefig``)."""
    from matplotlib.figure import Figure

    if frame.empty:
        raise ValueError("no rows to plot (a `where` that keeps none?)")
    v, lo, hi = _estimate_columns(frame, value)
    if not by:
        text = [c for c in frame.columns if frame[c].dtype == object]
        by = "claim" if "claim" in frame.columns else (text[0] if text else "")
    labels = [textwrap.fill(str(x), LABEL_WIDTH) for x in (frame[by] if by else range(len(frame)))]
    values, low, high = (frame[c].astype(float).to_numpy() for c in (v, lo, hi))
    lines = sum(label.count("\n") + 1 for label in labels)
    fig = Figure(figsize=(10, 0.3 * lines + 0.25 * len(labels) + 1.2), layout="constrained")
    ax = fig.add_subplot()
    y = list(range(len(frame)))[::-1]
    ax.errorbar(values, y, xerr=[values - low, high - values], fmt="o", capsize=3)
    if (low < 0).any():
        ax.axvline(0, color="grey", linewidth=0.8)
    ax.set_yticks(y, labels)
    ax.set_xlabel(f"{v} (95% interval)")
    ax.set_title(title)
    return fig
