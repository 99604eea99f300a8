"""The circuits report's DCM section and its tests: what the heads encode, over the test pairs' items."""

from __future__ import annotations

from typing import Optional

import numpy as np

from ....report.claims import encodes, encodes_family
from ....report.rows import (
    dcm_rows,
    semantic_rows,
)
from ....runs.stages import StageRecord, label
from .kit import Study, _fmt, left_out_sentence, shared_items, study_table

DCM_CAPTION = (
    "heads whose mask went to 0 for each desideratum, target accuracy on held-out pairs with them "
    "patched, the no-intervention floor and random heads of the same size (by default drawn from each selected "
    "head's own layer, at the same position)"
)


def dcm_section(study: "Study", dcm: "StageRecord", finetune_dcm: Optional[dict] = None) -> str:
    """The base's DCM and its semantic patching; each fine-tune's own DCM where CMAP as the paper read it."""
    if "skipped" in dcm.result:
        return f"DCM: not run ({dcm.result['skipped']}).{left_out_sentence(dcm.result, 'DCM')}\n"
    text = study_table(study, dcm_rows(dcm.result["dcm"]), "dcm", f"DCM on the base model's circuit: {DCM_CAPTION}")
    text += left_out_sentence(dcm.result, "DCM")
    sem = semantic_rows(dcm.result["semantic"], dcm_test_items(study, dcm))
    if sem:
        text += "\n" + study_table(
            study,
            sem,
            "semantic_patching",
            "Semantic patching: the same DCM-selected heads patched in every model, against the unpatched floor and "
            "random heads of their layers at their position (the same draws in every model); minus_floor: exact "
            "McNemar test on the same pairs (floor_p), minus_random: sign-flip test against the per-pair share of "
            "draws (random_p); per-pair outcomes in outcomes.json",
        )
    for ft, rec in (finetune_dcm or {}).items():
        text += "\n" + study_table(
            study,
            dcm_rows(rec.result["dcm"]),
            f"dcm_{label(ft)}",
            f"DCM on {ft}'s own pruned circuit (its selections are the heads CMAP as the paper patches): {DCM_CAPTION}",
        )
    return text


def _base_semantic(dcm: "StageRecord", row: dict, base: str) -> dict:
    """The base's semantic patching record of a DCM row's selection (same group and desideratum); {} where none."""
    return next(
        (
            x
            for x in dcm.result.get("semantic", [])
            if (x["group"], x["desideratum"], x["model"]) == (row["group"], row["desideratum"], base)
        ),
        {},
    )


def dcm_tests(dcm: "StageRecord", base: str, study: Optional["Study"] = None) -> dict:
    """The family "what the heads encode": each selected group against its floor and its random heads, with the
    base's per-pair outcomes where the stage kept them, clustered by the test pairs' items where ``study`` knows
    them (`dcm_test_items`)."""
    if "skipped" in dcm.result:
        return {}
    items = dcm_test_items(study, dcm) if study is not None else {}
    rows = []
    for r in dcm.result["dcm"]:
        sem = _base_semantic(dcm, r, base)
        extra = {k: sem[k] for k in ("floor_outcomes", "random_outcomes") if k in sem}
        if "outcomes" in sem and sem["accuracy"]["value"] == r["test_accuracy"]["value"]:
            extra["test_outcomes"] = sem["outcomes"]
        key = f"{r['group']}/{r['desideratum']}"
        if key in items and len(items[key]) == int(r["test_accuracy"]["n"]):
            extra["test_items"] = items[key]
        rows.append({**r, **extra})
    return encodes_family(rows)


def dcm_test_items(study: Optional["Study"], dcm: "StageRecord") -> dict[str, np.ndarray]:
    """Each DCM (``group/desideratum``)'s test pairs' items, split again as the stage split them (`split_indices`
    on the ``dcm`` set's item ids with the record's split and seed: the stage kept the outcomes, not the items), for
    an imported task whose items the stage split by; {} for a generated task (its pairs are items of their own) or
    where the counts do not align. The semantic patching of a selection runs on the same test pairs."""
    from ....methods.dcm import split_indices

    task = getattr(study, "task", None)
    if study is None or getattr(task, "items", None) is None or "skipped" in dcm.result:
        return {}
    out = {}
    for r in dcm.result.get("dcm", []):
        n = int(r["n_train"]) + int(r["n_val"]) + int(r["n_test"])
        ids = shared_items(study, "dcm", n)
        if ids is None:  # one pair an item: the exact tests already hold
            continue
        test = split_indices(n, r["config"]["split"], r["config"]["seed"], ids.tolist())[2]
        if len(test) == int(r["n_test"]):
            out[f"{r['group']}/{r['desideratum']}"] = ids[test]
    return out


def _dcm_over_items(study: "Study", dcm: "StageRecord", base: str) -> "StageRecord":
    """``dcm`` with each selection's target and floor accuracies (its DCM row and every model's semantic patching)
    as intervals over the test pairs' items (`dcm_test_items`), from the per-pair outcomes the stage kept; unchanged
    where the pairs are items of their own. Random heads keep the stage's interval, which resamples the draws as
    well as the pairs (the per-pair share over items alone would leave the draws' spread out)."""
    from dataclasses import replace

    from ....common import inference as inf
    from ....common.outcomes import from_bits

    items = dcm_test_items(study, dcm)
    if not items:
        return dcm

    def arms(rec: dict, on: np.ndarray) -> dict:
        out = {}
        if (rec.get("outcomes") or {}).get("correct"):
            out["accuracy"] = inf.proportion(from_bits(rec["outcomes"]["correct"]), on).to_dict(detail=True)
        if rec.get("floor_outcomes"):
            out["floor"] = inf.proportion(from_bits(rec["floor_outcomes"]), on).to_dict(detail=True)
        return {k: v for k, v in out.items() if v["n"] == on.size}

    semantic = []
    for x in dcm.result.get("semantic", []):
        on = items.get(f"{x['group']}/{x['desideratum']}")
        semantic.append({**x, **arms(x, on)} if on is not None else x)
    rows = []
    for r in dcm.result.get("dcm", []):
        on = items.get(f"{r['group']}/{r['desideratum']}")
        sem = _base_semantic(dcm, r, base)
        same = sem and sem["accuracy"]["value"] == r["test_accuracy"]["value"]  # the mask's own test pairs
        got = arms(sem, on) if same and on is not None else {}
        if "accuracy" in got:
            got["test_accuracy"] = got.pop("accuracy")
        rows.append({**r, **got})
    return replace(dcm, result={**dcm.result, "dcm": rows, "semantic": semantic})


def dcm_findings(dcm: "StageRecord", tests: Optional[dict] = None) -> str:
    """One sentence per (group, desideratum) whose mask selected heads: "encodes" only where the paired tests
    against the no-intervention floor and against random heads both survive Holm in "what the heads encode"."""
    if "skipped" in dcm.result:  # a skip is not a finding
        return f"- DCM: not run ({dcm.result['skipped']})."
    res = dcm.result["dcm"]
    chosen = [r for r in res if r["selected"]]
    if not chosen:
        return (
            f"- DCM selected no head in any of {len(res)} (group, desideratum) runs: patching the group's heads "
            "did not move the target beyond the no-intervention floor within the training budget."
        )
    tests = tests or {}
    lines = []
    for r in chosen:
        above = encodes(tests, r["group"], r["desideratum"])
        verb = "encodes" if above else "is not shown to encode"
        said = []
        for kind in ("floor", "random"):
            t = tests.get((r["group"], r["desideratum"], kind))
            if t is not None:
                said.append(f"{kind} {t.interval.value:+.3f}, Holm p = {t.p_adjusted:.2g}")
        lines.append(
            f"- DCM: group {r['group']} {verb} **{r['desideratum']}** with {', '.join(r['selected'])}: "
            f"target accuracy {_fmt(r['test_accuracy'])} against the floor {_fmt(r['floor'])}"
            + (f" and random heads {_fmt(r['random'])}" if r.get("random") else "")
            + (f" (paired on the same pairs, patched minus {'; '.join(said)})" if said else "")
            + "."
        )
        sem = [x for x in dcm.result["semantic"] if x["group"] == r["group"] and x["desideratum"] == r["desideratum"]]
        if sem and above:
            lines.append(
                "  The same heads patched in each model: "
                + "; ".join(f"{x['model']} {_fmt(x['accuracy'])}" for x in sem)
                + "."
            )
    return "\n".join(lines)
