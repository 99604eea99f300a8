"""Differences between models on the same prompts, each with its paired interval, and the per-prompt outcomes
they come from (``outcomes.json``, :mod:`mechdiff.common.outcomes`).

Every model of a circuits study is scored on the same prompts of each set (accuracy, the circuit x model matrix,
semantic patching of the DCM selections), so a difference between two models is read from one paired bootstrap
over those prompts, not from two separate intervals: accuracy and answer probability (mean of per-prompt
differences), a circuit's accuracy with the rest ablated (the same), and its faithfulness (a difference of two
ratios, every resample drawing the same prompts for both models). Records made before per-prompt outcomes were
kept have none: their comparisons are left out, and the report says so.
"""

from __future__ import annotations

from typing import Any, Mapping, Optional

import numpy as np

from ..common.outcomes import read_record
from ..common.stats import Estimate, paired_difference, paired_ratio_difference


def outcome_stages(accuracy: Mapping[str, Any], matrix: Mapping[str, Any], dcm: Any) -> dict[str, dict]:
    """Every stage's compact per-prompt records by label, as ``outcomes.json`` keeps them: ``accuracy``
    (label: model), ``matrix:<model>`` (``full`` and each circuit), ``semantic`` (``group/desideratum in model``)."""
    out: dict[str, dict] = {"accuracy": {}, "semantic": {}}
    for name, rec in accuracy.items():
        if rec is not None and "outcomes" in rec.result:
            out["accuracy"][name] = rec.result["outcomes"]
    for name, rec in matrix.items():
        kept = rec.result.get("outcomes") if rec is not None else None
        if kept:
            first = next(iter(kept.values()))
            out[f"matrix:{name}"] = {"full": first["full"], **{c: o["circuit"] for c, o in kept.items()}}
    for s in dcm.result.get("semantic", []) if dcm is not None else []:
        if "outcomes" in s:
            out["semantic"][f"{s['group']}/{s['desideratum']} in {s['model']}"] = s["outcomes"]
    return {k: v for k, v in out.items() if v}


def paired_rows(stages: Mapping[str, Mapping[str, dict]], base: str, finetunes: list[str]) -> list[dict]:
    """One row per comparison of a fine-tune with the base on the same prompts: what, the difference (fine-tune
    minus base) with its paired 95% interval, and the prompts; from ``outcomes.json``'s stages."""
    rows: list[dict] = []
    acc = stages.get("accuracy", {})
    for ft in finetunes:
        if base in acc and ft in acc:
            (c_b, p_b), (c_f, p_f) = read_record(acc[base]), read_record(acc[ft])
            rows.append(_row(ft, base, "accuracy", paired_difference(c_f, c_b)))
            rows.append(_row(ft, base, "answer probability", paired_difference(p_f, p_b)))
            if "logit_diff" in acc[base] and "logit_diff" in acc[ft]:
                ld_b, ld_f = (np.asarray(acc[m]["logit_diff"], dtype=float) for m in (base, ft))
                rows.append(_row(ft, base, "logit difference", paired_difference(ld_f, ld_b)))
        rows += _matrix_rows(stages, base, ft)
        rows += _semantic_rows(stages.get("semantic", {}), base, ft)
    return [r for r in rows if r is not None]


def _matrix_rows(stages: Mapping[str, Mapping[str, dict]], base: str, ft: str) -> list[Optional[dict]]:
    mb, mf = stages.get(f"matrix:{base}"), stages.get(f"matrix:{ft}")
    if not mb or not mf:
        return []
    full_b, full_f = read_record(mb["full"])[0], read_record(mf["full"])[0]
    rows = []
    for circuit in (c for c in mb if c != "full" and c in mf):
        cb, cf = read_record(mb[circuit])[0], read_record(mf[circuit])[0]
        if cb.shape != cf.shape:
            continue
        rows.append(_row(ft, base, f"circuit of {circuit}: accuracy", paired_difference(cf, cb)))
        rows.append(
            _row(ft, base, f"circuit of {circuit}: faithfulness", paired_ratio_difference(cf, full_f, cb, full_b))
        )
    return rows


def _semantic_rows(semantic: Mapping[str, dict], base: str, ft: str) -> list[Optional[dict]]:
    rows = []
    for label, record in semantic.items():
        what, _, model = label.rpartition(" in ")
        other = semantic.get(f"{what} in {ft}")
        if model != base or other is None:
            continue
        b, f = read_record(record)[0], read_record(other)[0]
        if b.shape == f.shape:
            rows.append(_row(ft, base, f"DCM heads of {what} patched: target accuracy", paired_difference(f, b)))
    return rows


def _row(ft: str, base: str, what: str, est: Estimate) -> Optional[dict]:
    if not np.isfinite(est.value):
        return None
    return {
        "comparison": f"{ft} - {base}",
        "measure": what,
        "difference": est.value,
        "difference_low": est.low,
        "difference_high": est.high,
        "n_prompts": est.n,
    }


def difference_sentence(row: Mapping[str, Any]) -> str:
    """What a paired row carries in words: a difference only where its interval excludes 0."""
    value, low, high = row["difference"], row["difference_low"], row["difference_high"]
    ci = f"{value:+.3f} [{low:+.3f}, {high:+.3f}]"
    if low > 0 or high < 0:
        return (
            f"{row['measure']}: {ci}, {'higher' if low > 0 else 'lower'} in the fine-tune ({row['n_prompts']} prompts)"
        )
    return f"{row['measure']}: {ci}, no difference the interval carries ({row['n_prompts']} prompts)"
