"""The circuits report's CMAP section: each fine-tune patched into the base, over the CMAP prompts' items."""

from __future__ import annotations

from typing import Optional

import numpy as np

from ....circuits.circuit import Circuit
from ....common.inference import Interval
from ....report.bars import grouped_bars
from ....report.rows import (
    cmap_caption,
    cmap_paired_caption,
    cmap_paired_rows,
    cmap_rows,
)
from ....runs.stages import label
from .kit import Study, _group_label, left_out_sentence, shared_items, study_table


def cmap_section(study: "Study", cmap: dict) -> str:
    text = []
    for ft, rec in cmap.items():
        r = rec.result
        if "skipped" in r:
            text.append(f"_CMAP {ft}: skipped, {r['skipped']}._{left_out_sentence(r, 'CMAP')}\n")
            continue
        if r.get("left_out"):
            text.append(left_out_sentence(r, f"CMAP {ft}").strip() + "\n")
        base_acc, ft_acc = Interval.from_dict(r["base_accuracy"]), Interval.from_dict(r["finetune_accuracy"])
        text.append(study_table(study, cmap_rows(r), f"cmap_{label(ft)}", cmap_caption(r, ft)))
        if "circuit" in r:  # CMAP as the paper: the fine-tune's pruned circuit cut to its DCM selections
            text.append(patched_heads(study, Circuit.from_dict(r["circuit"])))
        paired = cmap_paired_rows(r, cmap_items_of(study, {ft: rec}).get(ft))
        text.append(study_table(study, paired, f"cmap_paired_{label(ft)}", cmap_paired_caption(r, ft)))
        scopes = list(dict.fromkeys(row["scope"] for row in r["rows"]))
        kinds = list(dict.fromkeys(row["kind"] for row in r["rows"]))
        series = {
            k: [
                next((Interval.from_dict(x["accuracy"]) for x in r["rows"] if x["scope"] == s and x["kind"] == k), None)
                for s in scopes
            ]
            for k in kinds
        }
        fig = study.dir / "figures" / f"cmap_{label(ft)}.png"
        grouped_bars(
            fig, scopes, series, title=f"CMAP {ft} -> {r['base']}", references={r["base"]: base_acc, ft: ft_acc}
        )
        text.append(f"![CMAP {ft}](figures/cmap_{label(ft)}.png)\n")
    return "\n".join(text)


def patched_heads(study: "Study", circuit: Circuit) -> str:
    """The heads CMAP patched per group: DCM's selection under the group's desideratum (``[cmap] selection``,
    part of the CMAP stage's key, so the record was cut by it), else the whole group."""
    selection = study.spec.cmap.selection
    lines = [f"Heads patched ({circuit.model}'s pruned circuit cut to its DCM selections):\n"]
    for g, heads in circuit.groups.items():
        why = f"DCM {selection[g]}" if g in selection else "the whole pruned group"
        lines.append(f"- {_group_label(g, circuit.positions[g])}, {why}: {' '.join(h.name for h in heads) or '-'}")
    return "\n".join(lines) + "\n"


def cmap_items_of(study: "Study", cmap: dict) -> dict[str, np.ndarray]:
    """Each fine-tune's CMAP prompts' items (the ``cmap`` set's, its first rows as the stage read them), where an
    imported task's prompts share items; {} otherwise."""
    if getattr(getattr(study, "task", None), "items", None) is None:
        return {}
    out = {}
    for ft, rec in cmap.items():
        outcomes = (rec.result.get("outcomes") or {}) if rec is not None else {}
        ids = shared_items(study, "cmap", len(outcomes.get("base", "")))
        if ids is not None:
            out[ft] = ids
    return out


def _cmap_over_items(study: "Study", cmap: dict) -> dict:
    """``cmap`` with each part's accuracy and both models' as intervals over the CMAP prompts' items
    (`cmap_items_of`), from the per-prompt outcomes the stage kept; unchanged where prompts are items. The random
    controls keep the stage's interval (it resamples their draws as well as the prompts)."""
    from dataclasses import replace

    from ....common import inference as inf

    out = dict(cmap)
    for ft, items in cmap_items_of(study, cmap).items():
        r = cmap[ft].result
        outcomes, on = r["outcomes"], r.get("random_prompts") or []

        def over(key: str) -> Optional[dict]:
            x = np.asarray(outcomes.get(key, []), dtype=float)
            if not x.size:
                return None
            its = items[np.asarray(on)] if x.size != items.size and len(on) == x.size else items[: x.size]
            return inf.mean(x, its).to_dict(detail=True)

        def row(x: dict) -> dict:
            got = over(f"{x['scope']}/{x['kind']}")
            return {**x, "accuracy": got} if got is not None else x

        result = {**r, "rows": [row(x) for x in r["rows"]]}  # random controls keep their draws-and-prompts interval
        for m in ("base", "finetune"):
            got = over(m)
            if got is not None:
                result[f"{m}_accuracy"] = got
        out[ft] = replace(cmap[ft], result=result)
    return out
