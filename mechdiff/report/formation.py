"""The trajectory report's account of when each component forms, on the change scale
(`formation`): each component's level, its change from step 0 (tested, Holm across
components), the steps at which it first reaches and stays at 50% and 90% of its own final change (censoring
written out), every two components' order as a test in the family "formation order" (Holm-adjusted), and the
sentences that say only what those adjusted tests carry.

The components come from a study's per-prompt outcomes in the compact format (``outcomes.json``'s stages,
`trajectory_components`), so the live report and `restate_formation` (a committed run's formation
restated from its files, no model run) compute the same tables.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Mapping, Optional, Sequence

import numpy as np

from ..common import inference as inf
from ..common.io import write_text
from ..common.outcomes import read_outcomes, read_record
from ..methods.formation import (
    CHANGE_FAMILY,
    LEVELS,
    ORDER_FAMILY,
    Change,
    ChangeCurve,
    Curve,
    Measure,
    change_curves,
    change_family,
    curves,
    faithfulness,
    first_of,
    order_family,
    over_accuracy,
    share,
    step_text,
)
from .tables import to_markdown, write_table

MODEL = "the model"


def level_name(q: float) -> str:
    """``0.5`` -> ``"50%"``."""
    return f"{q:.0%}"


@dataclass(frozen=True)
class Component:
    """A component: its level on the change scale (what times formation), what that level is, and the ratio
    measure the report also shows as a level (None: none)."""

    change: Change
    what: str
    ratio: Optional[Measure] = None
    ratio_what: str = ""


def _values(record: Mapping[str, Any]) -> np.ndarray:
    """A compact record's per-prompt values: 0/1 correctness, or a random scope's share of right draws."""
    return np.asarray(record["share"], dtype=float) if "share" in record else read_record(record)[0]


def trajectory_components(
    stages: Mapping[str, Mapping[str, dict]],
    names: Sequence[str],
    floors: Mapping[str, Sequence[float]],
    heads: Mapping[str, str],
) -> dict[str, Component]:
    """The trajectory's components from its stages' outcomes (``outcomes.json``'s ``stages``): the model's
    accuracy; the final and first trained circuits' accuracy kept alone (ratio: faithfulness); each CMAP group's
    patched accuracy in the first checkpoint (step 0: the first's own; ratio: share of the checkpoint's gain); each
    DCM selection's patched target rate above its unpatched floor (``floors``: ``group/desideratum`` -> the floor
    at every step, a count; ratio: over the checkpoint's accuracy). ``heads``: ``group/desideratum`` -> its heads."""
    acc = np.array([read_record(stages["accuracy"][n])[0] for n in names])
    out = {MODEL: Component(Change(acc, "eval"), "accuracy on the held-out prompts")}
    for key, name in (
        ("final", f"the final checkpoint's circuit ({names[-1]})"),
        ("first trained", f"the first trained checkpoint's circuit ({names[1]})"),
    ):
        full = np.array([read_record(stages[f"scores:{n}"]["full"])[0] for n in names])
        kept = np.array([read_record(stages[f"scores:{n}"][key])[0] for n in names])
        out[name] = Component(
            Change(kept, "matrix"),
            "accuracy with the circuit alone kept",
            faithfulness(kept, full, "matrix"),
            "faithfulness (kept / the whole model's accuracy)",
        )
    out.update(_cmap_components(stages, names))
    sem = [stages.get(f"semantic:{n}", {}) for n in names]
    for label in sem[0]:
        x = np.array([read_record(s[label])[0] for s in sem])
        g, d = label.split("/", 1)
        out[f"DCM {g} {d} ({heads.get(label, '')})".replace(" ()", "")] = Component(
            Change(x, f"semantic:{d}", np.asarray(floors[label], dtype=float)),
            "patched target rate above the unpatched floor",
            over_accuracy(x, f"semantic:{d}", acc, "eval"),
            "patched target rate / the checkpoint's accuracy",
        )
    return out


def _cmap_components(stages: Mapping[str, Mapping[str, dict]], names: Sequence[str]) -> dict[str, Component]:
    recs = [stages.get(f"cmap:{n}") for n in names]
    present = [r for r in recs if r]
    if not present:
        return {}
    first = _values(present[0]["base"])  # the first checkpoint's own outcomes on the CMAP prompts
    own = np.array([_values(r["finetune"]) if r else first for r in recs])
    base = np.array([first] * len(recs))
    out = {}
    for k in (k for k in present[0] if k not in ("base", "finetune")):
        patched = np.array([_values(r[k]) if r else first for r in recs])
        out[f"CMAP {k}"] = Component(
            Change(patched, "cmap"),
            "the first checkpoint's accuracy with the group patched in from the checkpoint",
            share(patched, own, base, "cmap"),
            "share of the checkpoint's own gain",
        )
    return out


@dataclass
class Formation:
    """Every component's change curve, ratio level, change test and the order family, adjusted."""

    steps: tuple[int, ...]
    components: dict[str, Component]
    curves: dict[str, ChangeCurve]
    ratios: dict[str, Curve]
    changes: dict[str, inf.Test]  # component -> its change test, Holm-adjusted across components
    orders: list[tuple[str, str, float, inf.Test]]  # (a, b, level, adjusted test)
    levels: tuple[float, ...]

    @property
    def formed(self) -> list[str]:
        """Components whose change from step 0 to the last is shown."""
        return [n for n, t in self.changes.items() if t.rejects]


def formation(components: dict[str, Component], steps: Sequence[int], levels: Sequence[float] = LEVELS) -> Formation:
    """The change curves on one set of joint draws, each component's change tested (`CHANGE_FAMILY`) and every
    two formed components ordered at each level (`ORDER_FAMILY`), both Holm-adjusted."""
    got = change_curves({n: c.change for n, c in components.items()}, steps)
    ratios = curves({n: c.ratio for n, c in components.items() if c.ratio is not None}, steps)
    changes = dict(zip(got, change_family(got).adjusted()))
    formed = [n for n, t in changes.items() if t.rejects]
    fam, keys = order_family(got, formed, levels)
    orders = [(a, b, q, t) for (a, b, q), t in zip(keys, fam.adjusted())]
    return Formation(tuple(steps), components, got, ratios, changes, orders, tuple(levels))


def _iv(name: str, iv: Optional[inf.Interval]) -> dict:
    return (
        {name: iv.value, f"{name}_low": iv.low, f"{name}_high": iv.high}
        if iv
        else dict.fromkeys((name, f"{name}_low", f"{name}_high"))
    )


def _timing_cols(f: Formation, name: str, q: float) -> dict:
    c, key = f.curves[name], level_name(q)
    if name not in f.formed:
        return {f"step_{key}": None, f"step_{key}_low": None, f"step_{key}_high": None, f"stays_{key}": None,
                f"stays_{key}_low": None, f"stays_{key}_high": None, f"unreached_{key}": None}  # fmt: skip
    out: dict[str, Any] = {}
    for rule, col in (("first", "step"), ("stays", "stays")):
        point, draws = c.timing(q)[rule]
        low, high = np.quantile(draws, [0.025, 0.975], method="inverted_cdf")
        out.update({f"{col}_{key}": step_text(point, f.steps), f"{col}_{key}_low": step_text(low, f.steps),
                    f"{col}_{key}_high": step_text(high, f.steps)})  # fmt: skip
    out[f"unreached_{key}"] = float(np.mean(~np.isfinite(c.timing(q)["first"][1])))
    return out


def formation_rows(f: Formation) -> list[dict]:
    """Per component: its level at step 0 and the last, the change (test, Holm p across components), whether it
    formed, and at each level the first step reaching that share of its own final change and the step from which it
    stays there (censoring written out), the share of draws never reaching it, and its ratio measure's final level."""
    rows = []
    for name, comp in f.components.items():
        c, t = f.curves[name], f.changes[name]
        row: dict[str, Any] = {"component": name, "measure": comp.what}
        row["direction"] = "decline" if c.direction < 0 else "rise"
        row.update(_iv("level_first", comp.change.level_interval(0)))
        row.update(_iv("level_last", comp.change.level_interval(len(f.steps) - 1)))
        row.update(_iv("change", t.interval))
        row.update({"p": t.p, "p_holm": t.p_adjusted, "formed": t.rejects})
        for q in f.levels:
            row.update(_timing_cols(f, name, q))
        ratio = f.ratios.get(name)
        row.update(_iv("ratio_last", _dict_iv(ratio.interval(len(f.steps) - 1)) if ratio else None))
        rows.append(row)
    first = f"step_{level_name(f.levels[0])}"
    return sorted(rows, key=lambda r: (not r["formed"], _num(r.get(first))))


def _dict_iv(d: Optional[dict]) -> Optional[inf.Interval]:
    return inf.Interval(d["value"], d["low"], d["high"], d["n"], d["n"], "bootstrap") if d else None


def _num(x: Any) -> float:
    """A written step as a number for sorting (``at or before step N`` -> N, ``after ...`` -> inf)."""
    if x is None or (isinstance(x, str) and x.startswith("after")):
        return float("inf")
    return float(x.rsplit(" ", 1)[-1]) if isinstance(x, str) else float(x)


def _signed(x: float) -> Any:
    return x if np.isfinite(x) else ("inf" if x > 0 else "-inf")


def order_rows(f: Formation) -> list[dict]:
    """Every test of the family "formation order": the paired difference of two formed components' first steps
    at a level (a - b, bootstrap 95% CI on the same draws), p, Holm's p and what it orders."""
    rows = []
    for a, b, q, t in f.orders:
        iv, first = t.interval, first_of(t, (a, b))
        rows.append(
            {
                "family": ORDER_FAMILY,
                "level": level_name(q),
                "a": a,
                "b": b,
                "a_minus_b": _signed(iv.value),
                "a_minus_b_low": _signed(iv.low),
                "a_minus_b_high": _signed(iv.high),
                "p": t.p,
                "p_holm": t.p_adjusted,
                "ordered": f"{first} before {b if first == a else a}" if first else "not ordered",
            }
        )
    return rows


def curve_rows(f: Formation) -> list[dict]:
    """Per component and step: its level (exact 95% CI for 0/1 outcomes), its change as a share of its own final
    change (bootstrap 95% CI) and its ratio measure where it has one (empty where not shown)."""
    rows = []
    for name, comp in f.components.items():
        ratio = f.ratios.get(name)
        for i, step in enumerate(f.steps):
            sh = f.curves[name].share_interval(i)
            rows.append(
                {
                    "component": name,
                    "step": step,
                    **_iv("level", comp.change.level_interval(i)),
                    **_iv("share_of_final_change", _dict_iv(sh)),
                    **_iv("ratio", _dict_iv(ratio.interval(i)) if ratio else None),
                }
            )
    return rows


def _step_ci(row: dict, col: str) -> str:
    return f"{row[col]} [{row[f'{col}_low']}, {row[f'{col}_high']}]"


def _left(x: Any) -> bool:
    return isinstance(x, str) and x.startswith("at or before")


def formation_text(f: Formation, rows: list[dict]) -> str:
    """What the adjusted tests carry: which components change, when each formed one reaches each level (censoring
    marked), what the order family orders (every component against the model named), and what it leaves unordered."""
    n = len(rows)
    formed = [r for r in rows if r["formed"]]
    parts = [
        f"Of {n} components, {len(formed)} change from step {f.steps[0]} to step {f.steps[-1]} (family "
        f"'{CHANGE_FAMILY}', Holm over {n})"
        + (": " + "; ".join(f"{r['component']} {r['change']:+.3f} (Holm p = {r['p_holm']:.2g})" for r in formed))
        + "."
        if formed
        else f"No component's change from step {f.steps[0]} to step {f.steps[-1]} is shown (Holm over {n})."
    ]
    never = [r for r in rows if not r["formed"]]
    if never:
        parts.append(
            "Not shown to change, so not timed or ordered: "
            + "; ".join(f"{r['component']} {r['change']:+.3f} (Holm p = {r['p_holm']:.2g})" for r in never)
            + "."
        )
    for r in formed:
        times = []
        for q in f.levels:
            key = level_name(q)
            word = "of its final loss" if r["direction"] == "decline" else "of its final change"
            times.append(f"{key} {word} first {_step_ci(r, f'step_{key}')}, staying from {_step_ci(r, f'stays_{key}')}")
        parts.append(f"{r['component']} ({r['direction']}): " + "; ".join(times) + ".")
    left = [r["component"] for r in formed if _left(r.get(f"step_{level_name(f.levels[0])}"))]
    if left:
        parts.append(
            f"Left-censored: {'; '.join(left)} reach{'es' if len(left) == 1 else ''} {level_name(f.levels[0])} at or "
            f"before step {f.steps[1]}, the first checkpoint after step {f.steps[0]}: the run cannot say when in "
            f"({f.steps[0]}, {f.steps[1]}]."
        )
    parts.append(order_text(f))
    parts.append(
        f"Checkpoints are at steps {', '.join(map(str, f.steps))}: a step is the first of these at which the share "
        "reaches the level, so the crossing itself lies after the checkpoint before it."
    )
    return "\n\n".join(parts)


def order_text(f: Formation) -> str:
    """The order family: how many tests, which it orders (Holm), and each formed component against the model."""
    if not f.orders:
        return f"Fewer than two components change: the family '{ORDER_FAMILY}' is empty."
    shown = [(a, b, q, t) for a, b, q, t in f.orders if t.rejects]
    text = (
        f"The family '{ORDER_FAMILY}' holds {len(f.orders)} tests (every two components that change, at "
        f"{' and '.join(level_name(q) for q in f.levels)}), Holm-adjusted; "
        + (
            f"it orders {len(shown)}: "
            + "; ".join(
                f"{first_of(t, (a, b))} before {b if first_of(t, (a, b)) == a else a} at {level_name(q)} "
                f"({_diff(t)}, Holm p = {t.p_adjusted:.2g})"
                for a, b, q, t in shown
            )
            if shown
            else "it orders none"
        )
        + f". The other {len(f.orders) - len(shown)} are not ordered by this run (`tables/formation_order.md`)."
    )
    vs = [(a, b, q, t) for a, b, q, t in f.orders if MODEL in (a, b)]
    if vs:
        text += " Against the model (the component's first step minus the model's): " + "; ".join(
            f"{level_name(q)} {b if a == MODEL else a} {_diff(t, flip=a == MODEL)} (Holm p = {t.p_adjusted:.2g})"
            for a, b, q, t in vs
        )
        text += "."
    return text


def _diff(t: inf.Test, flip: bool = False) -> str:
    iv = t.interval
    s = -1 if flip else 1
    lo, hi = sorted((s * iv.low, s * iv.high))
    return f"{_fmt(s * iv.value)} [{_fmt(lo)}, {_fmt(hi)}]"


def _fmt(x: float) -> str:
    if not np.isfinite(x):
        return "+inf" if x > 0 else "-inf"
    return f"{round(x) + 0:+d}"  # no "-0"


CAPTION = (
    "When each component forms, on the change scale: its level at the first and last step (exact 95% CI for 0/1 "
    "outcomes), its change (the paired test; Holm across components), and at {levels} of its own final change the "
    "first step reaching it and the step from which it stays (bootstrap 95% CI over prompts drawn jointly across "
    "steps; 'at or before step {first}': reached at the first checkpoint after step 0, left-censored; 'after step "
    "{last}': not reached, right-censored; unreached: the share of draws never reaching it); ratio_last: the ratio "
    "measure's final level (shown, never timed)"
)
CURVES_CAPTION = (
    "Each component's level, its change as a share of its own final change (bootstrap 95% CI) and its ratio "
    "measure per step (empty: not shown). "
)
ORDER_CAPTION = (
    "Family 'formation order': every two components that change, at each level: the difference of their first "
    "steps (a - b, paired bootstrap 95% CI on the same draws; inf: one never reaches the level in those draws), p "
    "(twice the smaller share of draws on either side of 0, ties on both, +1 corrected), Holm's p within the family, "
    "and what it orders"
)


def write_formation(f: Formation, run_dir: Path) -> tuple[str, str, list[dict], list[dict]]:
    """Write ``tables/formation*`` and ``figures/formation.png``; returns the report section, the README section,
    and the formation and order rows."""
    from .figures import band_figure

    rows, orders, levels = formation_rows(f), order_rows(f), " and ".join(level_name(q) for q in f.levels)
    caption = CAPTION.format(levels=levels, first=f.steps[1], last=f.steps[-1])
    tables = {
        "formation": (rows, caption),
        "formation_order": (orders or [{"ordered": "fewer than two components change"}], ORDER_CAPTION),
        "formation_curves": (curve_rows(f), CURVES_CAPTION + "; ".join(
            f"{n}: {c.what}; ratio {c.ratio_what or '-'}" for n, c in f.components.items())),
    }  # fmt: skip
    md = {}
    for stem, (t, cap) in tables.items():
        write_table(t, run_dir / "tables" / stem, caption=cap)
        md[stem] = f"**{cap}** (`tables/{stem}.md`)\n\n" + to_markdown(t) + "\n"
    fig = band_figure(
        f.steps,
        {n: [c.share_interval(i) for i in range(len(f.steps))] for n, c in f.curves.items()},
        run_dir / "figures" / "formation.png",
        "each component's change from step 0 as a share of its own final change (bootstrap 95% CI over prompts)",
        "share of the final change",
        levels=f.levels,
    )
    text = formation_text(f, rows)
    intro = (
        "Each component is timed on its own change from step 0, divided by its own final change (a ratio measure "
        "- faithfulness, a share of the checkpoint's gain, patching over accuracy - is shown as a level and never "
        "times formation: a component that tracks the model sits near 1 on it at every step). A component is timed "
        f"only where its change from step 0 to the last is shown (family '{CHANGE_FAMILY}', Holm); a decline is timed "
        "on its loss. Intervals resample prompts jointly across steps (Jeffreys posterior draws at a step whose 0/1 "
        f"outcomes are all 0 or all 1); every 'A before B' is a test in the family '{ORDER_FAMILY}', Holm-adjusted.\n\n"
    )
    report = (
        "## When each component forms\n\n"
        + intro
        + md["formation"]
        + "\n"
        + md["formation_order"]
        + "\n"
        + text
        + "\n\n"
        + md["formation_curves"]
        + f"\n![each component's share of its final change]({fig.relative_to(run_dir)})\n\n"
        "*each component's change from step 0 as a share of its own final change against the step*\n"
    )
    readme = (
        "## Findings: when each component forms\n\n"
        + intro
        + to_markdown([{k: v for k, v in r.items() if k != "measure"} for r in rows])
        + "\n\n"
        + text
        + "\n"
    )
    return report, readme, rows, orders


# --- a committed run restated ------------------------------------------------------------------------------------

RESTATED = (
    "> **Restated** from the committed per-prompt outcomes (`outcomes.json`) and tables by `mechdiff restate`, no "
    "model run: formation on the change scale, orders as a Holm family (docs/trajectories.md)."
)


def _json(run_dir: Path, stem: str) -> list[dict]:
    path = run_dir / "tables" / f"{stem}.json"
    return json.loads(path.read_text(encoding="utf-8")) if path.exists() else []


def committed_formation(run_dir: str | Path) -> Formation:
    """A committed trajectory run's formation from its files: ``outcomes.json``, ``tables/accuracy.json`` (steps
    and checkpoints), ``tables/semantic.json`` (each DCM selection's floor per step) and ``tables/dcm_labels.json``
    (its heads)."""
    run_dir = Path(run_dir)
    acc = _json(run_dir, "accuracy")
    if not acc:
        raise ValueError(f"{run_dir}: no tables/accuracy.json; restate a trajectory study's results directory")
    steps, names = [int(r["step"]) for r in acc], [r["checkpoint"] for r in acc]
    floors: dict[str, list[float]] = {}
    for r in _json(run_dir, "semantic"):
        floors.setdefault(f"{r['group']}/{r['desideratum']}", [0.0] * len(steps))[steps.index(int(r["step"]))] = r[
            "floor"
        ]
    heads = {f"{r['group']}/{r['desideratum']}": r["selected"] for r in _json(run_dir, "dcm_labels")}
    return formation(trajectory_components(read_outcomes(run_dir), names, floors, heads), steps)


def restate_formation(run_dir: str | Path) -> Path:
    """Rewrite a committed trajectory run's formation tables, figure, README section and report section from its
    committed files (`committed_formation`); returns the README."""
    run_dir = Path(run_dir)
    report, readme, _, _ = write_formation(committed_formation(run_dir), run_dir)
    _replace_section(run_dir / "README.md", "## Findings: when each component forms", readme, RESTATED)
    _replace_section(run_dir / "report.md", "## When each component forms", report, RESTATED)
    return run_dir / "README.md"


def _replace_section(path: Path, heading: str, body: str, note: str) -> None:
    """Replace the section under ``heading`` (to the next ``## ``) with ``body``, the note under its heading."""
    text = path.read_text(encoding="utf-8")
    start = text.find(heading + "\n")
    if start < 0:
        raise ValueError(f"{path}: no section {heading!r} to restate")
    end = text.find("\n## ", start + len(heading))
    head, _, rest = body.partition("\n\n")
    new = f"{head}\n\n{note}\n\n{rest}"
    write_text(path, text[:start] + new + ("\n" + text[end + 1 :] if end >= 0 else ""))
