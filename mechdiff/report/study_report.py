"""``report.md`` of a study: what was run, the tables and figures, and what they show."""

from __future__ import annotations

import math
from pathlib import Path
from typing import TYPE_CHECKING

from ..circuits.circuit import Circuit
from ..circuits.overlap import overlap_table
from ..io import write_text
from ..stats import Estimate, paired_difference
from .bars import grouped_bars
from .membership import membership_heatmap
from .tables import estimate_columns, to_markdown, write_table

from ..study import label

if TYPE_CHECKING:
    from ..study import StageRecord, Study


def _est(d: dict) -> Estimate:
    return Estimate(d["value"], d["low"], d["high"], d["n"])


def _has_gap(cmap_result: dict) -> bool:
    """Whether the fine-tune is above the base on the CMAP prompts beyond both CIs."""
    return _est(cmap_result["finetune_accuracy"]).low > _est(cmap_result["base_accuracy"]).high


def _fmt(d: dict) -> str:
    return str(_est(d))


def _table(study: "Study", rows: list[dict], stem: str, caption: str) -> str:
    """Write a table in four formats under ``tables/`` and return its Markdown for the report."""
    if not rows:
        return f"**{caption}**\n\n_No rows: the stage had nothing to measure (e.g. every group was pruned empty)._\n"
    write_table(rows, study.dir / "tables" / stem, caption=caption)
    return f"**{caption}** (`tables/{stem}.csv`)\n\n{to_markdown(rows)}\n"


def accuracy_section(study: "Study", accuracy: dict[str, "StageRecord"]) -> tuple[str, list[dict]]:
    rows = []
    for name, rec in accuracy.items():
        r = rec.result
        rows.append({"model": name, **estimate_columns("accuracy", r["accuracy"]),
                     **estimate_columns("answer_prob", r["answer_prob"]), "fingerprint": r["fingerprint"]})
    n = study.spec.eval.n
    text = _table(study, rows, "accuracy", f"Accuracy on {n} held-out {study.spec.task.n_boxes}-box prompts "
                                           "(objects disjoint from fine-tuning objects; 95% bootstrap CI)")
    return text, rows


def circuit_section(study: "Study", found: dict, circuits: dict) -> str:
    shape = study.models.shape
    rows, figs = [], []
    for name in found:
        raw = Circuit.from_dict(found[name].result["circuit"])
        final = Circuit.from_dict(circuits[name].result["circuit"])
        row = {"model": name}
        for g in raw.groups:
            row[f"{g} found"] = len(raw.groups[g])
            row[f"{g} kept"] = len(final.groups.get(g, []))
        rows.append(row)
        figs += [f"![{name} step {s}]({p})" for s, p in found[name].result["figures"].items()]
    loaded = {n: Circuit.from_dict(circuits[n].result["circuit"]) for n in circuits}
    membership_heatmap(loaded, shape.n_layers, shape.n_heads, study.dir / "figures" / "membership.png",
                       title="circuit membership per model")
    text = _table(study, rows, "circuit_sizes", "Circuit sizes per group: found by path patching, kept after pruning")
    lines = [text, "Heads per group of each model's circuit (after pruning):\n"]
    for n, c in loaded.items():
        lines.append(f"- **{n}**: " + "; ".join(f"{g} ({c.names.get(g, '')}, at `{c.positions[g]}`): "
                                                + (", ".join(h.name for h in hs) or "none")
                                                for g, hs in c.groups.items()))
    lines += ["", "![circuit membership](figures/membership.png)", "", "Path-patching scores "
              "(boxed: selected heads):", "", *figs, ""]
    return "\n".join(lines)


def matrix_section(study: "Study", matrix: dict) -> tuple[str, list[dict]]:
    rows = [r for rec in matrix.values() for r in rec.result["rows"]]
    keep = ("circuit", "model", "n_heads", "full_accuracy", "accuracy", "faithfulness", "random_accuracy",
            "random_faithfulness")
    shown = [{k: v for k, v in r.items() if k.split("_low")[0].split("_high")[0] in keep} for r in rows]
    text = _table(study, shown, "circuit_x_model",
                  "Circuit x model: accuracy with every other head mean-ablated, faithfulness F(C)/F(M), "
                  "and random circuits of the same group sizes")
    comp_rows = []
    for name, rec in matrix.items():
        comp = rec.result.get("completeness")
        if not comp:
            continue
        row = {"model": name, "random K mean": comp["random"]["mean"], "random K std": comp["random"]["std"]}
        row.update({f"group {g}": "n/a" if v["completeness"] is None else v["completeness"]
                    for g, v in comp["groups"].items()})
        comp_rows.append(row)
    if comp_rows:
        text += "\n" + _table(study, comp_rows, "completeness",
                              "Completeness |F(C\\K) - F(M\\K)| of each model's own circuit (accuracy)")
    return text, rows


def overlap_section(study: "Study", circuits: dict) -> tuple[str, dict]:
    shape = study.models.shape
    base = study.spec.models.base
    first = Circuit.from_dict(circuits[base].result["circuit"])
    out, text = {}, []
    for ft in study.spec.models.finetunes:
        second = Circuit.from_dict(circuits[ft].result["circuit"])
        rows = overlap_table(first, second, shape.n_layers, shape.n_heads)
        out[ft] = rows
        text.append(_table(study, rows, f"overlap_{label(base)}_{label(ft)}",
                           f"Overlap of the {base} circuit (first) and the {ft} circuit (second); p: hypergeometric "
                           f"probability of at least this intersection for random head sets of these sizes"))
    return "\n".join(text), out


def dcm_section(study: "Study", dcm: "StageRecord") -> str:
    rows = []
    for r in dcm.result["dcm"]:
        row = {"group": r["group"], "desideratum": r["desideratum"], "position": r["position"],
               "n_heads": len(r["heads"]), "selected": " ".join(r["selected"]) or "-"}
        row.update(estimate_columns("accuracy", r["test_accuracy"]))
        row.update(estimate_columns("floor", r["floor"]))
        if r.get("random"):
            row.update(estimate_columns("random", r["random"]))
        rows.append(row)
    text = _table(study, rows, "dcm", "DCM on the base model's circuit: heads whose mask went to 0 for each "
                                      "desideratum, target accuracy on held-out pairs with them patched, the "
                                      "no-intervention floor and random heads of the same size")
    sem = [{"group": s["group"], "desideratum": s["desideratum"], "model": s["model"], "heads": " ".join(s["heads"]),
            **estimate_columns("accuracy", s["accuracy"]), **estimate_columns("floor", s["floor"])}
           for s in dcm.result["semantic"]]
    if sem:
        text += "\n" + _table(study, sem, "semantic_patching",
                              "Semantic patching: the same DCM-selected heads patched in every model")
    return text


def cmap_section(study: "Study", cmap: dict) -> str:
    text = []
    for ft, rec in cmap.items():
        r = rec.result
        if "skipped" in r:
            text.append(f"_CMAP {ft}: skipped, {r['skipped']}._\n")
            continue
        base_acc, ft_acc = _est(r["base_accuracy"]), _est(r["finetune_accuracy"])
        gap = _has_gap(r)  # a share of the gap means nothing when there is no gap
        rows = [{"scope": row["scope"], "kind": row["kind"], **estimate_columns("accuracy", row["accuracy"]),
                 **({"recovered": row["recovered"]} if gap else {})} for row in r["rows"]]
        share = ("recovered = (patched - base)/(fine-tune - base)" if gap else
                 "no recovered share: the fine-tune is not above the base beyond their CIs")
        caption = f"CMAP {ft} -> {r['base']}: base accuracy {base_acc}, fine-tune {ft_acc}; {share}. {r['caption']}"
        text.append(_table(study, rows, f"cmap_{label(ft)}", caption))
        scopes = list(dict.fromkeys(row["scope"] for row in r["rows"]))
        kinds = list(dict.fromkeys(row["kind"] for row in r["rows"]))
        series = {k: [next((_est(x["accuracy"]) for x in r["rows"] if x["scope"] == s and x["kind"] == k), None)
                      for s in scopes] for k in kinds}
        fig = study.dir / "figures" / f"cmap_{label(ft)}.png"
        grouped_bars(fig, scopes, series, title=f"CMAP {ft} -> {r['base']}",
                     references={r["base"]: base_acc, ft: ft_acc})
        text.append(f"![CMAP {ft}](figures/cmap_{label(ft)}.png)\n")
    return "\n".join(text)


def _cost(manifest: dict) -> str:
    """What the stages cost when computed, and what this invocation reused."""
    stages = manifest["stages"].values()
    total = sum(s["seconds"] for s in stages)
    reused = sum(bool(s["cached"]) for s in stages)
    return (f"Computing the {len(stages)} stages took {total / 60:.1f} min in all (the seconds above, from the "
            f"runs that computed them); this invocation reused {reused} of them from the cache and took "
            f"{manifest['wall_seconds']:.0f} s up to writing this report.")


def findings(study: "Study", acc_rows: list[dict], matrix_rows: list[dict], overlaps: dict, cmap: dict) -> str:
    """Plain sentences read off the tables (every figure here is in a table above)."""
    base = study.spec.models.base
    acc = {r["model"]: r for r in acc_rows}
    lines = []
    for ft in study.spec.models.finetunes:
        a_b, a_f = acc[base]["accuracy"], acc[ft]["accuracy"]
        lines.append(f"- **{ft}** reaches accuracy {a_f:.2f} against {a_b:.2f} for {base}.")
        m = next((r for r in matrix_rows if r["model"] == ft and r["circuit"] == base), None)
        if m:
            lines.append(f"  The base circuit alone (every other head mean-ablated) gives {ft} accuracy "
                         f"{m['accuracy']:.2f} [{m['accuracy_low']:.2f}, {m['accuracy_high']:.2f}], faithfulness "
                         f"{m['faithfulness']:.2f} [{m['faithfulness_low']:.2f}, {m['faithfulness_high']:.2f}]"
                         + (f" (random circuits of the same sizes: {m['random_faithfulness']:.2f})"
                            if "random_faithfulness" in m else "") + ".")
        rows = overlaps.get(ft, [])
        everything = next((r for r in rows if r["group"] == "all"), None)
        if everything:
            lines.append(f"  Its own circuit shares {everything['intersection']} of the base circuit's "
                         f"{everything['size_first']} heads ({everything['frac_first']:.2f}; hypergeometric "
                         f"p = {everything['p_value']:.2g}).")
        r = cmap.get(ft)
        r = None if r is None or "skipped" in r.result else r
        gap = r and _has_gap(r.result)
        if r and not gap:
            lines.append(f"  On the CMAP prompts {ft} ({_fmt(r.result['finetune_accuracy'])}) is not above {base} "
                         f"({_fmt(r.result['base_accuracy'])}): there is no gain for CMAP to localise.")
        if r and gap:
            rows = [x for x in r.result["rows"] if x["scope"] != "circuit" and x["kind"] == "z"
                    and not math.isnan(x["recovered"])]
            if rows:
                best = max(rows, key=lambda x: x["recovered"])
                lines.append(f"  CMAP of head outputs from {ft} into {base}: group {best['scope']} recovers the most "
                             f"of the gap ({best['recovered']:.2f}; accuracy {_fmt(best['accuracy'])}).")
            qk = {x["kind"]: x for x in r.result["rows"] if x["scope"] == "circuit"}
            if "qk" in qk and "v" in qk:
                lines.append(f"  Whole circuit: QK patching gives {_fmt(qk['qk']['accuracy'])}, V patching "
                             f"{_fmt(qk['v']['accuracy'])}. {_ordering(r.result, 'circuit/v', 'circuit/qk')}")
    return "\n".join(lines)


def _ordering(result: dict, a: str, b: str) -> str:
    """A sentence on ``a`` against ``b`` from their paired difference on the same prompts: an ordering is
    stated only where the paired 95% interval excludes 0."""
    outcomes = result.get("outcomes", {})
    if a not in outcomes or b not in outcomes:
        return ""
    d = paired_difference(outcomes[a], outcomes[b])
    verdict = ("so the first is larger" if d.low > 0 else "so the second is larger" if d.high < 0
               else "which includes 0: neither is shown to be larger")
    return f"Paired difference {a} - {b} on the same prompts: {d}, {verdict}."


def dcm_findings(dcm: "StageRecord") -> str:
    """One sentence per (group, desideratum) whose mask selected heads, and the semantic-patching spread."""
    res = dcm.result["dcm"]
    chosen = [r for r in res if r["selected"]]
    if not chosen:
        return (f"- DCM selected no head in any of {len(res)} (group, desideratum) runs: patching the group's heads "
                "did not move the target beyond the no-intervention floor within the training budget.")
    lines = []
    for r in chosen:
        lines.append(f"- DCM: group {r['group']} encodes **{r['desideratum']}** in {', '.join(r['selected'])}: "
                     f"target accuracy {_fmt(r['test_accuracy'])} against the floor {_fmt(r['floor'])}"
                     + (f" and random heads {_fmt(r['random'])}" if r.get("random") else "") + ".")
        sem = [x for x in dcm.result["semantic"] if x["group"] == r["group"] and x["desideratum"] == r["desideratum"]]
        if sem:
            lines.append("  The same heads patched in each model: "
                         + "; ".join(f"{x['model']} {_fmt(x['accuracy'])}" for x in sem) + ".")
    return "\n".join(lines)


def write_report(study: "Study", accuracy: dict, found: dict, circuits: dict, matrix: dict, dcm: "StageRecord",
                 cmap: dict) -> Path:
    """Write ``report.md`` (and every table and figure it cites) into the study directory."""
    acc_text, acc_rows = accuracy_section(study, accuracy)
    mat_text, mat_rows = matrix_section(study, matrix)
    ov_text, overlaps = overlap_section(study, circuits)
    manifest = study.manifest()
    spec = study.spec
    stage_rows = [{"stage": n, "seconds": s["seconds"], "cached": s["cached"]} for n, s in manifest["stages"].items()]
    model_rows = [{"model": n, "digest": d, "fingerprint": accuracy[n].result["fingerprint"],
                   "source": str(accuracy[n].result["provenance"].get("adapter") or accuracy[n].result["provenance"].get("path", ""))}
                  for n, d in manifest["model_digests"].items()]
    parts = [
        f"# Entity tracking: {spec.models.base} against {', '.join(spec.models.finetunes)}\n",
        "Generated by `mechdiff run` from "
        f"`{spec.source}`. Every figure carries a 95% bootstrap confidence interval over prompts.\n",
        "## Findings\n", findings(study, acc_rows, mat_rows, overlaps, cmap), dcm_findings(dcm), "",
        "## Accuracy\n", acc_text,
        "## Circuits (path patching)\n",
        f"Discovery on {spec.discovery.n} clean/counterfactual pairs per model; top-k per step "
        f"{spec.discovery.top_k}; attribution screen: {spec.discovery.screen} "
        f"(shortlist {spec.discovery.screen_multiple} x k); pruning: a head stays if removing it lowers the "
        f"{spec.scoring.prune_metric} metric by more than {spec.scoring.prune_threshold} of the circuit's own F(C) "
        f"({spec.scoring.prune_steps} greedy steps growing K in the minimality search).\n",
        circuit_section(study, found, circuits),
        "## Circuit x model\n", mat_text,
        "## Overlap\n", ov_text,
        "## What the heads encode (DCM)\n", dcm_section(study, dcm),
        "## Cross-model activation patching (CMAP)\n", cmap_section(study, cmap),
        "## What was run\n",
        to_markdown(model_rows), "",
        f"Seeds: task seed {spec.task.seed} (eval prompts seed+1, scoring seed+2, ablation reference seed+3, "
        f"DCM pairs seed+4, CMAP prompts seed+5, pruning prompts seed+6). All prompts use only the held-out "
        f"objects (`eval_objects()`), disjoint from the fine-tuning objects. Versions: "
        + ", ".join(f"{k} {v}" for k, v in manifest["versions"].items())
        + f". Python {manifest['python']} on {manifest['machine']}.\n",
        to_markdown(stage_rows), "",
        f"Configuration: `run.json` (the full spec). {_cost(manifest)}\n",
    ]
    return write_text(study.dir / "report.md", "\n".join(parts))
