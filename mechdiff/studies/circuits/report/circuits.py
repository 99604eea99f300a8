"""The circuits report's position scan, method, circuits, pruning and overlap sections."""

from __future__ import annotations

from typing import Any

from ....circuits.circuit import Circuit
from ....circuits.curve import ATTRIBUTED
from ....circuits.overlap import overlap_table
from ....common.metrics import continuous_key, metric_label
from ....report.heads import head_rows, write_heads_table
from ....report.membership import membership_heatmap
from ....report.rows import (
    curve_rows,
    metric_note,
    scan_rows,
)
from ....runs.stages import label
from ....tasks.jsonl import REST
from .kit import Study, _disjoint, _group_label, _held_out, _pruned_on, study_table


def positions_section(study: "Study", positions: dict) -> str:
    """The position scan per model: classes chosen greedily, faithfulness after each."""
    rows, figs, note = [], [], ""
    for name, rec in positions.items():
        if rec is None:
            continue
        rows += [{"model": name, **row} for row in scan_rows(rec.result["scan"])]
        note = metric_note(rec.result["scan"]["steps"][0]) if rec.result["scan"]["steps"] else ""
        figs.append(f"![position scan {name}]({rec.result['figure']})")
    if not rows:
        return "_No position scan ([positions] n = 0)._\n"
    n = study.spec.positions.n
    text = study_table(
        study,
        rows,
        "position_scan",
        f"Position scan on {n} prompts per model: every head kept at the "
        "classes chosen so far, every head mean-ablated at every other position; greedy by accuracy, "
        f"stopping at faithfulness {study.spec.positions.stop_at}{note}",
    )
    classes = {c for rec in positions.values() if rec is not None for c in rec.result["scan"].get("classes", ())}
    if REST in classes:  # a row's own classes leave tokens uncovered: they are one class, named here
        text += (
            f"\nThe class `{REST}` holds the tokens the task's own classes leave uncovered (every token is in one "
            "class; `last` is always the final token).\n"
        )
    return "\n".join([text, *figs, ""])


def _method(study: "Study") -> str:
    d, sc = study.spec.discovery, study.spec.scoring
    if d.method == "curve":
        return (
            f"Each model's circuit: every (head, position class) pair ranked by mean-ablation attribution "
            f"({ATTRIBUTED[study.task.metric]}) "
            f"on {d.n} prompts; nested circuits of the top {', '.join(f'{x:g}' for x in d.sizes)} of the "
            f"ranking scored on {d.curve_n} other prompts; the circuit is the smallest whose accuracy "
            f"faithfulness {'interval lower bound' if d.select == 'low' else 'point estimate'} reaches "
            f"{d.target} on those prompts (the largest scored where none does). Selection stability: the same "
            f"ranking on {d.stability_draws} bootstrap resamples of the ranking prompts. Ablation: position-wise "
            f"means of {sc.reference_n} reference prompts{' with held-out objects' if _held_out(study) else ''}. "
            f"{MEANS_RULE}\n"
        )
    return (
        f"Each model's circuit by the paper's path patching on {d.n} clean/counterfactual pairs, senders scored by "
        f"the relative change of the {metric_label(study.task.metric)}; top-k per step "
        f"{d.top_k or 'as the plan gives'}; attribution screen: {d.screen} (shortlist {d.screen_multiple} x k). "
        f"{_counterfactuals(d)}{MEANS_RULE}\n"
    )


def _counterfactuals(d: Any) -> str:
    """The paper's counterfactual construction and seeds, where ``[discovery]`` selects them (nothing otherwise)."""
    out = ""
    if d.counterfactual == "paper":
        out += (
            "Counterfactuals as the paper builds them: the clean set's prompt querying box (j+1) mod n_boxes, its "
            "query letter overwritten by a uniform draw that may be a label of its context. "
        )
    if d.model_seed_redraws == "counterfactuals":
        out += "A model's own seed redraws only its counterfactuals: every model sees the same clean prompts. "
    return out


MEANS_RULE = (
    "Mean ablation respects templates: a prompt's position-wise means are taken over the reference prompts "
    "of its own template and token length, never across templates or lengths (prompts are batched by "
    "template and length, without padding)."
)


def circuit_section(study: "Study", found: dict, pruned: dict) -> str:
    """Each model's circuit: how it was found, its size, the curve and stability (curve method) or the path-
    patching scores (path method), and what pruning kept."""
    shape = study.models.shape
    if not found:
        return "_No circuit: no model does the task (see Findings)._\n"
    rows, figs = [], []
    for name, rec in found.items():
        raw = Circuit.from_dict(rec.result["circuit"])
        row = {"model": name, "pairs": len(raw.pairs()), "heads": len(raw.heads())}
        if "curve" in rec.result:
            meta, stab = raw.meta, rec.result["stability"]
            sel = list(stab["selected"].values())
            row.update(
                {
                    "fraction": meta["fraction"],
                    "reached_target": meta["reached_target"],
                    "stable_share": sum(f >= 0.5 for f in sel) / len(sel) if sel else 0.0,
                }
            )
            figs += [
                f"![curve {name}]({rec.result['figures']['curve']})",
                f"![stability {name}]({rec.result['figures']['stability']})",
            ]
        else:
            figs += [f"![{name} step {s}]({p})" for s, p in rec.result["figures"].items()]
        if name in pruned:
            kept = Circuit.from_dict(pruned[name].result["circuit"])
            row.update({"pairs_after_pruning": len(kept.pairs()), "heads_after_pruning": len(kept.heads())})
        rows.append(row)
    loaded = {n: Circuit.from_dict(found[n].result["circuit"]) for n in found}
    membership_heatmap(
        loaded,
        shape.n_layers,
        shape.n_heads,
        study.dir / "figures" / "membership.png",
        title="circuit membership per model",
    )
    text = study_table(
        study,
        rows,
        "circuit_sizes",
        "Circuit sizes: (head, position) pairs and distinct heads; for the "
        "curve method the fraction of all pairs, whether the target was reached, and the share of the "
        "circuit's pairs selected in at least half of the bootstrap resamples; after pruning",
    )
    lines = [text, "Pairs per position class of each model's circuit:\n"]
    for n, c in loaded.items():
        lines.append(
            f"- **{n}**: " + "; ".join(_group_label(g, c.positions[g]) + f" {len(hs)}" for g, hs in c.groups.items())
        )
    heads = head_rows({n: rec.result for n, rec in found.items()}, {n: rec.result for n, rec in pruned.items()})
    if heads:
        write_heads_table(heads, study.dir / "tables")
        lines.append(
            f"\nEvery scored (model, head, position class) pair: its attribution and rank, selection "
            f"frequency, membership before and after pruning (`tables/heads.csv`, {len(heads)} rows; the "
            "grid of `report.html` shows them on hover)."
        )
    lines += ["", "![circuit membership](figures/membership.png)", "", *figs, ""]
    curves = [
        {"model": n, **row}
        for n, rec in found.items()
        if "curve" in rec.result
        for row in curve_rows(rec.result["curve"])
    ]
    if curves:
        lines.append(
            study_table(
                study,
                curves,
                "curve",
                f"Faithfulness of nested circuits (the top fraction of the "
                f"attribution ranking) on {study.spec.discovery.curve_n} prompts per model, "
                + _disjoint(
                    study, "curve", "disjoint from the ranking prompts and from those of the circuit x model matrix"
                )
                + metric_note(curves[0]),
            )
        )
        m = continuous_key(curves[0]).removeprefix("faithfulness_")
        areas_of = (f"cpr_{m}", f"cmd_{m}")
        areas = [
            {"model": n, **{k: rec.result["curve"][k] for k in (*areas_of, "cpr_accuracy", "cmd_accuracy")}}
            for n, rec in found.items()
            if "curve" in rec.result
        ]
        lines.append(
            study_table(
                study,
                areas,
                "cpr_cmd",
                "CPR and CMD (MIB): areas under the normalised faithfulness "
                "(m(C) - m(empty)) / (m(M) - m(empty)) and under |1 - it|, over the fraction of pairs"
                + ("" if m == "prob" else f" (cpr_{m}, cmd_{m}: m the logit difference)"),
            )
        )
    return "\n".join(lines)


def pruning_section(study: "Study", pruned: dict) -> str:
    """What pruning removed, per model, and by which rule."""
    if not pruned:
        return "_Pruning off ([scoring] prune = false)._\n"
    s = study.spec.scoring
    rows = []
    for name, rec in pruned.items():
        m = rec.result["minimality"]
        searched = sum(v["searched"] for v in m["pairs"].values() if "searched" in v)
        rows.append(
            {
                "model": name,
                "pairs_before": len(m["pairs"]),
                "pairs_after": len(Circuit.from_dict(rec.result["circuit"]).pairs()),
                "F(C) on pruning prompts": m["circuit"],
                "F(M)": m["full"],
                **({} if s.prune_rule == "paper" else {"K searched for": searched}),
            }
        )
    if s.prune_rule == "paper":
        caption = (
            f"Pruning (the paper's rule, per group): K = the heads among the top ceil({s.prune_share} |group|) "
            "by F(C\\{u}) - F(C\\{u,v}) with a positive score; v stays iff F(C\\K) / F(C\\(K+v)) - 1 >= "
            f"{s.prune_threshold}, on the {_pruned_on(study)} over {s.prune_n} prompts of their own"
        )
    else:
        caption = (
            f"Pruning (mechdiff's greedy rule, not the paper's): a pair stays if removing it moves the "
            f"{_pruned_on(study)} by more than {s.prune_threshold} of the circuit's own F(C), with K "
            f"grown greedily ({s.prune_steps} steps, {s.prune_candidates} candidates each; the search skipped for "
            f"pairs already above the threshold at K = {{}}) on {s.prune_n} prompts of their own"
        )
    return study_table(study, rows, "pruning", caption)


def overlap_section(study: "Study", circuits: dict) -> tuple[str, dict]:
    shape = study.models.shape
    base = study.spec.models.base
    out, text = {}, []
    first = Circuit.from_dict(circuits[base].result["circuit"]) if base in circuits else None
    if base not in circuits:
        return "_No overlap: the base model has no circuit (it does not do the task; see Findings)._\n", out
    for ft in (f for f in study.spec.models.finetunes if f in circuits):
        second = Circuit.from_dict(circuits[ft].result["circuit"])
        rows = overlap_table(first, second, shape.n_layers, shape.n_heads)
        out[ft] = rows
        text.append(
            study_table(
                study,
                rows,
                f"overlap_{label(base)}_{label(ft)}",
                f"Overlap of the {base} circuit (first) and the {ft} circuit (second); p: hypergeometric "
                f"probability of at least this intersection for random head sets of these sizes",
            )
        )
    return "\n".join(text), out
