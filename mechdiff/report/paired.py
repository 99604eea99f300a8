"""Differences between models on the same prompts, each with its paired interval, and the per-prompt outcomes
they come from (``outcomes.json``, `mechdiff.common.outcomes`).

Every model of a circuits study is scored on the same prompts of each set (accuracy, the circuit x model matrix,
semantic patching of the DCM selections), so a difference between two models is one paired test on those prompts,
by the rules of `mechdiff.common.inference`: 0/1 outcomes by the exact McNemar test (or the sign-flip test
over items where an item has several rows), continuous ones by the sign-flip test, a faithfulness difference (two
ratios) by the paired cluster bootstrap, stated with its two parts (the circuit's accuracy and the model's accuracy
on those prompts). Every difference of a study is one test of the family "differences between the models",
adjusted by Holm's step-down; one that is not shown gets an equivalence test against its measure's margin.
Records made before per-prompt outcomes were kept have none: their comparisons are left out, and the report says
so.
"""

from __future__ import annotations

from typing import Any, Mapping, Optional, Sequence

import numpy as np

from ..common import inference as inf
from ..common.outcomes import read_record


def outcome_stages(accuracy: Mapping[str, Any], matrix: Mapping[str, Any], dcm: Any) -> dict[str, dict]:
    """Every stage's compact per-prompt records by label, as ``outcomes.json`` keeps them: ``accuracy``
    (label: model), ``matrix:<model>`` (``full`` and each circuit), ``matrix_random:<model>`` (each circuit with
    random draws: ``prompts``, indices into the matrix prompts, and ``outcomes``, one 0/1 string a draw),
    ``semantic`` (``group/desideratum in model``: the patched heads, the unpatched ``floor`` and each ``random``
    draw of heads, where kept)."""
    out: dict[str, dict] = {"accuracy": {}, "semantic": {}}
    for name, rec in accuracy.items():
        if rec is not None and "outcomes" in rec.result:
            out["accuracy"][name] = rec.result["outcomes"]
    for name, rec in matrix.items():
        kept = rec.result.get("outcomes") if rec is not None else None
        if kept:
            first = next(iter(kept.values()))
            empty = {"empty": first["empty"]} if "empty" in first else {}
            out[f"matrix:{name}"] = {"full": first["full"], **empty, **{c: o["circuit"] for c, o in kept.items()}}
            drawn = {c: o["random"] for c, o in kept.items() if "random" in o}
            if drawn:
                out[f"matrix_random:{name}"] = drawn
    for s in dcm.result.get("semantic", []) if dcm is not None else []:
        if "outcomes" in s:
            controls = {k: s[f"{k}_outcomes"] for k in ("floor", "random") if f"{k}_outcomes" in s}
            out["semantic"][f"{s['group']}/{s['desideratum']} in {s['model']}"] = {**s["outcomes"], **controls}
    return {k: v for k, v in out.items() if v}


MARGINS = inf.MARGINS
"""Equivalence margins by the kind of measure (defined in `mechdiff.common.inference`; a task file's
``[inference] margins`` sets others)."""

FAMILY = "differences between the models"
SAMENESS = "sameness between the models"
CAPTION = (
    'Fine-tune minus base on the same prompts, one test each in the family "differences between the models" '
    "(Holm-adjusted p; docs/inference.md): accuracy and answer probability (eval prompts), the model's and each "
    "circuit's accuracy and faithfulness with the rest mean-ablated (matrix prompts; a faithfulness difference "
    "is read with its two parts, never alone), and the target accuracy with the base's DCM heads patched (DCM "
    "test pairs). 0/1 outcomes: exact McNemar test with its exact-hulled Tango interval; continuous: sign-flip "
    "test over items with the interval that inverts it; faithfulness: paired cluster bootstrap. Where a "
    "difference is not shown, `same_within_margin` is its equivalence test (TOST) against `margin`. Per-prompt "
    "outcomes: `outcomes.json`"
)
"""The paired-differences table's caption."""

Items = Optional[Mapping[str, Sequence]]
"""Item ids aligned with each stage's rows (``accuracy``, ``matrix``, ``semantic``); None: one row an item."""


def margin_for(measure: str, margins: Optional[Mapping[str, float]] = None) -> float:
    """The equivalence margin of a measure by the kind its name ends with."""
    table = inf.margins_of(margins)
    for kind in ("faithfulness", "logit difference", "probability", "accuracy"):
        if measure.endswith(kind) or kind in measure.rsplit(":", 1)[-1]:
            return table[kind]
    return table["accuracy"]


Compared = dict[str, tuple[np.ndarray, np.ndarray, Optional[Sequence]]]
"""A mean difference's claim -> the two per-row arrays its test compared and their items (for its TOST)."""


def paired_family(
    stages: Mapping[str, Mapping[str, dict]], base: str, finetunes: list[str], items: Items = None
) -> tuple[inf.Family, Compared]:
    """Every comparison of a fine-tune with the base on the same prompts, one test each, in one family; and the
    values each mean difference compared."""
    fam, compared = inf.Family(FAMILY), {}
    acc, its = stages.get("accuracy", {}), items or {}

    def add(a, b, on, claim: str) -> None:
        a, b = np.asarray(a, dtype=float), np.asarray(b, dtype=float)
        fam.add(inf.paired(a, b, on, claim))
        compared[claim] = (a, b, on)

    for ft in finetunes:
        if base in acc and ft in acc:
            (c_b, p_b), (c_f, p_f) = read_record(acc[base]), read_record(acc[ft])
            on = its.get("accuracy")
            add(c_f, c_b, on, f"{ft} - {base}: accuracy")
            if p_b is not None and p_f is not None:
                add(p_f, p_b, on, f"{ft} - {base}: answer probability")
            if "logit_diff" in acc[base] and "logit_diff" in acc[ft]:
                add(acc[ft]["logit_diff"], acc[base]["logit_diff"], on, f"{ft} - {base}: logit difference")
        mb, mf = stages.get(f"matrix:{base}"), stages.get(f"matrix:{ft}")
        if mb and mf:
            on = its.get("matrix")
            full_b, full_f = read_record(mb["full"])[0], read_record(mf["full"])[0]
            add(full_f, full_b, on, f"{ft} - {base}: model accuracy on the matrix prompts")
            for circuit in (c for c in mb if c not in ("full", "empty") and c in mf):
                cb, cf = read_record(mb[circuit])[0], read_record(mf[circuit])[0]
                if cb.shape == cf.shape:
                    add(cf, cb, on, f"{ft} - {base}: circuit of {circuit}: accuracy")
                    what = f"{ft} - {base}: circuit of {circuit}: faithfulness"
                    fam.add(inf.paired_ratio(cf, full_f, cb, full_b, on, what))
                    both = (full_b == 1) & (full_f == 1)
                    if 1 < both.sum() < both.size:
                        sub = None if on is None else np.asarray(on)[both]
                        claim = f"{ft} - {base}: circuit of {circuit}: accuracy on the prompts both models answer"
                        add(cf[both], cb[both], sub, claim)
        semantic = stages.get("semantic", {})
        for label, record in semantic.items():
            what, _, model = label.rpartition(" in ")
            other = semantic.get(f"{what} in {ft}")
            if model == base and other is not None:
                b, f = read_record(record)[0], read_record(other)[0]
                on = its.get("semantic", {}).get(what) if isinstance(its.get("semantic"), Mapping) else None
                if b.shape == f.shape:
                    add(f, b, on, f"{ft} - {base}: DCM heads of {what} patched: target accuracy")
    return fam, compared


def paired_rows(
    stages: Mapping[str, Mapping[str, dict]],
    base: str,
    finetunes: list[str],
    items: Items = None,
    margins: Optional[Mapping[str, float]] = None,
) -> list[dict]:
    """One row per comparison of a fine-tune with the base on the same prompts: the difference (fine-tune minus
    base) with its interval, its test's p and Holm's p in the family, and, where it is not shown, the
    equivalence test against the measure's margin (means only, not ratios); from ``outcomes.json``'s stages."""
    fam, compared = paired_family(stages, base, finetunes, items)
    rows, tosts = [], []
    for test in fam.adjusted():
        if not np.isfinite(test.interval.value):
            continue
        eq = None
        if not test.rejects and test.claim in compared:
            a, b, on = compared[test.claim]
            try:
                eq = inf.equivalence(a, b, margin_for(test.claim, margins), on, test.claim)
            except ValueError:
                eq = None
        comparison, _, measure = test.claim.partition(": ")
        rows.append(_row(comparison, measure, test, eq))
        tosts += [len(rows) - 1] if eq is not None else []
    for i, p_holm in zip(tosts, inf.holm([rows[i]["p_tost"] for i in tosts])):
        rows[i].update(p_tost_holm=float(p_holm), same_within_margin=bool(p_holm <= inf.ALPHA))
    return rows


def _row(comparison: str, measure: str, test: inf.Test, eq: Optional[inf.Equivalence]) -> dict:
    iv = test.interval
    return {
        "comparison": comparison,
        "measure": measure,
        "difference": iv.value,
        "difference_low": iv.low,
        "difference_high": iv.high,
        "p": test.p,
        "p_holm": test.p_adjusted,
        "shown": test.rejects,
        "test": test.method,
        "discordant": None if test.discordant is None else f"{test.discordant[0]} vs {test.discordant[1]}",
        "n_prompts": iv.n_rows,
        "n_items": iv.n_items,
        "margin": None if eq is None else eq.margin,
        "same_within_margin": None if eq is None else eq.shown,
        "p_tost": None if eq is None else eq.p,
        "p_tost_holm": None,
        "equivalence_low": None if eq is None else eq.low,
        "equivalence_high": None if eq is None else eq.high,
    }


def family_row(r: Mapping[str, Any]) -> dict:
    """A paired row as a row of the families table."""
    return {
        "family": FAMILY,
        "claim": f"{r['comparison']}: {r['measure']}",
        "estimate": r["difference"],
        "low": r["difference_low"],
        "high": r["difference_high"],
        "p": r["p"],
        "p_holm": r["p_holm"],
        "shown": r["shown"],
        "method": r["test"],
        "rows": r["n_prompts"],
        "items": r["n_items"],
    }


def sameness_row(r: Mapping[str, Any]) -> dict:
    """A paired row's equivalence test as a row of the families table (family "sameness between the models"): the
    difference with the 90% interval its two one-sided tests read, and the margin it was tested against."""
    return {
        "family": SAMENESS,
        "claim": f"{r['comparison']}: {r['measure']}: the same within +-{r['margin']:g}",
        "estimate": r["difference"],
        "low": r.get("equivalence_low"),
        "high": r.get("equivalence_high"),
        "p": r["p_tost"],
        "p_holm": r["p_tost_holm"],
        "shown": r["same_within_margin"],
        "method": "two one-sided tests (TOST) against the margin",
        "rows": r["n_prompts"],
        "items": r["n_items"],
        "margin": r["margin"],
    }


def paired_family_rows(rows: list[Mapping[str, Any]]) -> list[dict]:
    """The paired rows as rows of the families table: every difference, then every equivalence test (the
    differences not shown), each naming its margin."""
    return [family_row(r) for r in rows] + [sameness_row(r) for r in rows if r.get("margin") is not None]


def difference_sentence(row: Mapping[str, Any]) -> str:
    """What a paired row carries in words: a difference only where its Holm-adjusted test rejects; sameness only
    where its equivalence test passes (naming the margin); otherwise not shown, with what the interval allows."""
    value, low, high = row["difference"], row["difference_low"], row["difference_high"]
    ci = f"{value:+.3f} [{low:+.3f}, {high:+.3f}]"
    p = row.get("p_holm", row.get("p"))
    where = f"{row['n_prompts']} prompts" + (
        f" in {row['n_items']} items" if row.get("n_items") not in (None, row["n_prompts"]) else ""
    )
    if row.get("shown", low > 0 or high < 0):
        side = "higher" if value > 0 else "lower"
        return f"{row['measure']}: {ci}, {side} in the fine-tune (Holm p = {p:.2g}; {where})"
    if low > 0 or high < 0:
        return (
            f"{row['measure']}: {ci}, not shown after Holm's adjustment in its family (p = {row['p']:.2g}, "
            f"Holm p = {p:.2g}; {where})"
        )
    if row.get("same_within_margin"):
        return (
            f"{row['measure']}: {ci}, the same within +-{row['margin']:g} "
            f"(equivalence Holm p = {row.get('p_tost_holm') or row['p_tost']:.2g} in the family "
            f'"{SAMENESS}"; {where})'
        )
    allows = max(abs(low), abs(high))
    margin = f" nor the same within +-{row['margin']:g}" if row.get("margin") is not None else ""
    return f"{row['measure']}: {ci}, not shown to differ{margin}; the interval allows up to {allows:.3f} ({where})"


def faithfulness_parts(rows: list[Mapping[str, Any]]) -> dict[str, str]:
    """For each faithfulness difference, its two parts in words (the circuit's accuracy and the model's accuracy
    on the same prompts), so a ratio difference is never read alone."""
    by = {(r["comparison"], r["measure"]): r for r in rows}
    out = {}
    for comparison, measure in by:
        if not measure.endswith(": faithfulness"):
            continue
        circuit = by.get((comparison, measure.replace(": faithfulness", ": accuracy")))
        model = by.get((comparison, "model accuracy on the matrix prompts"))
        if circuit and model:
            out[measure] = f"its parts: the circuit's accuracy {_short(circuit)}, the model's accuracy {_short(model)}"
    return out


def _short(row: Mapping[str, Any]) -> str:
    verdict = "shown" if row.get("shown") else "not shown"
    return f"{row['difference']:+.3f} [{row['difference_low']:+.3f}, {row['difference_high']:+.3f}] ({verdict})"
