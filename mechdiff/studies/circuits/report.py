"""``report.md`` of a circuits study: what was run, the tables and figures, and what they show.

The writer reads the study's stage records and its settings (``study.spec``, ``study.dir``, ``study.manifest()``,
``study.models.shape``, ``study.task``); it imports no study."""

from __future__ import annotations

from pathlib import Path
from typing import Any, Optional

import numpy as np

from ...circuits.circuit import Circuit
from ...circuits.curve import ATTRIBUTED
from ...circuits.overlap import overlap_table
from ...common.inference import Interval
from ...common.io import write_text
from ...common.metrics import continuous_key, metric_label, scored_metric
from ...models.resolve import resolve_spec
from ...report.bars import grouped_bars
from ...report.claims import CONTROLS, cmap_family, controls_family, encodes, encodes_family, family_rows
from ...report.heads import head_rows, write_heads_table
from ...report.membership import membership_heatmap
from ...report.page_kit import stage_rows as stage_table
from ...report.paired import difference_sentence, paired_family_rows
from ...report.rows import (
    circuit_x_model_rows,
    cmap_caption,
    cmap_has_gap,
    cmap_paired_caption,
    cmap_paired_rows,
    cmap_rows,
    completeness_rows,
    curve_rows,
    dcm_rows,
    metric_note,
    scan_rows,
    semantic_rows,
)
from ...report.tables import estimate_columns, to_markdown, write_table
from ...runs.seeds import PROMPT_OFFSETS
from ...runs.stages import StageRecord, label
from ...tasks.jsonl import REST
from ...tasks.row_checks import per_template, task_empty_classes

#: The circuits study whose records are written (`mechdiff.studies.circuits.study.CircuitsStudy`).
Study = Any


def _fmt(d: dict) -> str:
    return str(Interval.from_dict(d))


def study_table(study: "Study", rows: list[dict], stem: str, caption: str) -> str:
    """Write a table in four formats under ``tables/`` and return its Markdown for the report."""
    if not rows:
        return f"**{caption}**\n\n_No rows: the stage had nothing to measure (e.g. every group was pruned empty)._\n"
    write_table(rows, study.dir / "tables" / stem, caption=caption)
    return f"**{caption}** (`tables/{stem}.csv`)\n\n{to_markdown(rows)}\n"


def shared_items(study: Any, name: str, n: int) -> Optional[np.ndarray]:
    """The item ids of the first ``n`` rows of the prompt set ``name`` (`set_items`), where some of them share an
    item; None where each is an item of its own, or the study records no items for the set (or fewer rows): the
    stage's own row-level figures then hold."""
    try:
        ids = np.asarray(study.set_items(name))
    except (KeyError, TypeError, ValueError, AttributeError):
        return None
    return ids[:n] if 0 < n <= ids.size and len(set(ids[:n].tolist())) < n else None


def _accuracy_over_items(result: dict, items: Optional[np.ndarray]) -> dict:
    """The accuracy stage's figures, their intervals over ``items`` where rows share items (`inf.proportion`,
    `inf.mean`: the cluster bootstrap over items, a proportion hulled with the exact interval of as many items);
    else the stage's own (exact over rows, one row an item)."""
    from ...common import inference as inf
    from ...common.outcomes import read_record

    outcomes = result.get("outcomes")
    if items is None or outcomes is None or len(outcomes["correct"]) != items.size:
        return {k: result[k] for k in ("accuracy", "answer_prob", "logit_diff") if k in result}
    correct, prob = read_record(outcomes)
    out = {"accuracy": inf.proportion(correct, items).to_dict(detail=True)}
    if prob is not None:
        out["answer_prob"] = inf.mean(prob, items).to_dict(detail=True)
    if "logit_diff" in result and outcomes.get("logit_diff") is not None:
        out["logit_diff"] = inf.mean(np.asarray(outcomes["logit_diff"], dtype=float), items).to_dict(detail=True)
    return {**{k: result[k] for k in ("answer_prob", "logit_diff") if k in result}, **out}


def accuracy_section(study: "Study", accuracy: dict[str, "StageRecord"]) -> tuple[str, list[dict]]:
    rows, clustered = [], False
    for name, rec in accuracy.items():
        r = rec.result
        items = shared_items(study, "eval", len((r.get("outcomes") or {}).get("correct", "")))
        figures = _accuracy_over_items(r, items)
        clustered = clustered or items is not None
        rows.append(
            {
                "model": name,
                **estimate_columns("accuracy", figures["accuracy"]),
                **estimate_columns("answer_prob", figures["answer_prob"]),
                **(estimate_columns("logit_diff", figures["logit_diff"]) if "logit_diff" in figures else {}),
                **({"items": figures["accuracy"].get("items")} if items is not None else {}),
                "fingerprint": r["fingerprint"],
            }
        )
    n = study.spec.eval.n
    what = (
        f"{n} held-out {study.spec.task.n_boxes}-box prompts (objects disjoint from fine-tuning objects; "
        if _held_out(study)
        else f"{n} held-out {study.task.name} prompts ("
    )
    text = study_table(
        study,
        rows,
        "accuracy",
        f"Accuracy on {what}"
        + (
            "intervals over items, since rows of one item share a clean prompt: for accuracy the cluster bootstrap "
            "over items hulled with the exact interval of as many items; the cluster bootstrap over items for "
            "probability"
            if clustered
            else "exact binomial CI for accuracy, bootstrap for probability"
        )
        + (" and the logit difference, answer minus the mean alternative)" if "logit_diff" in rows[0] else ")"),
    )
    floor, how = study.floor_is()
    text += (
        f"\nThe floor: {floor:.3g} ({how}). A model whose accuracy's lower bound is not above it has no behaviour "
        "to explain and gets no circuit.\n"
    )
    return text + _by_answer_length(study, accuracy), rows


def _by_answer_length(study: "Study", accuracy: dict[str, "StageRecord"]) -> str:
    """Each model's accuracy (and the task's metric) per answer length on the accuracy prompts, from the stage's
    per-prompt outcomes; empty where every answer has one length."""
    from ...common.metrics import CONTINUOUS_LABELS
    from ...common.outcomes import read_first_and_rest, read_record
    from ...patching.evaluate import EvalResult

    if study.task.answer_tokens < 2 or not all("outcomes" in rec.result for rec in accuracy.values()):
        return ""
    records, rows = study.eval_records(), []
    for name, rec in accuracy.items():
        correct, prob = read_record(rec.result["outcomes"])
        diff = rec.result["outcomes"].get("logit_diff")
        first, rest = read_first_and_rest(rec.result["outcomes"])
        res = EvalResult(
            correct.astype(bool),
            prob,
            None if diff is None else np.asarray(diff, dtype=float),
            None if first is None else first.astype(bool),
            None if rest is None else rest.astype(bool),
        )
        for row in res.by_answer_length(
            records, study.task.metric, np.asarray(study.set_items("eval"))[: len(records)]
        ):
            cells = [estimate_columns(k, v) if isinstance(v, Interval) else {k: v} for k, v in row.items()]
            rows.append({"model": name, **{k: v for cell in cells for k, v in cell.items()}})
    if not rows:
        return ""
    metric = "logit_diff" if "logit_diff" in rows[0] else "answer_prob"
    named = CONTINUOUS_LABELS["logit_diff" if metric == "logit_diff" else "prob"]
    return "\n" + study_table(
        study,
        rows,
        "accuracy_by_answer_length",
        f"Accuracy and {named} by the answer's length in tokens on the same prompts (exact binomial CI; bootstrap "
        "for the metric). An answer of several tokens is scored by teacher forcing: accuracy is greedy decoding "
        "giving the whole answer, split (where the stage kept it) into `first_token` (the first answer token the "
        "top-1 after the prompt) and `rest` (every later token the top-1 given the answer's tokens before it); the "
        "circuits cover the prompt's positions only (no head at an answer token's own position is ablated or "
        "patched)",
    )


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


def _pruned_on(study: "Study") -> str:
    """The caption words of the metric pruning decided on (``[scoring] prune_metric``; ``prob``: the task's own)."""
    return metric_label(scored_metric(study.spec.scoring.prune_metric, study.task.metric))


def _group_label(group: str, position: str) -> str:
    """``position`` where a group is named by its position class (the curve method), else ``group (position)``."""
    return f"`{position}`" if group == position else f"{group} (`{position}`)"


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


def _normalised_over_items(row: dict, kept: dict, items: np.ndarray) -> dict:
    """A matrix row's normalised faithfulness, (m(C) - m(empty)) / (m(M) - m(empty)) (`normalised_figures`), for
    accuracy and the task's metric, with its interval over ``items`` from the per-prompt outcomes (``kept``: the
    ``full``, ``circuit`` and ``empty`` records); a figure the stage left undefined (NaN) stays so."""
    from ...common.inference import ratio
    from ...common.outcomes import from_bits

    if "empty" not in kept:
        return {}
    out = {}
    for key in (k for k in row if k.startswith("faithfulness_normalised") and not k.endswith(("_low", "_high"))):
        metric = key.removeprefix("faithfulness_normalised").lstrip("_") or "correct"
        per = []
        for part in ("circuit", "full", "empty"):
            rec = kept[part]
            value = rec.get(metric) if metric != "correct" else rec.get("correct")
            if value is None:
                break
            per.append(from_bits(value) if isinstance(value, str) else np.asarray(value, dtype=float))
        if len(per) == 3 and not np.isnan(row[key]) and per[0].size == items.size:
            c, f, e = per
            out.update(estimate_columns(key, ratio(c - e, f - e, items)))
    return out


def _matrix_over_items(study: "Study", matrix: dict) -> Optional[list[dict]]:
    """The circuit x model rows with the model's and each circuit's accuracy and faithfulness intervals over items,
    from the stage's per-prompt outcomes, where the matrix prompts' rows share items (None otherwise: the stage's
    own intervals, one row an item). The random draws' figures stay as the stage made them."""
    from ...common.inference import proportion, ratio
    from ...common.outcomes import read_record

    out = []
    for rec in matrix.values():
        kept = rec.result.get("outcomes") or {}
        for r in rec.result["rows"]:
            o = kept.get(r["circuit"])
            if o is None:
                return None
            full, circ = read_record(o["full"])[0], read_record(o["circuit"])[0]
            items = shared_items(study, "matrix", full.size)
            if items is None:
                return None
            out.append(
                {
                    **r,
                    **estimate_columns("full_accuracy", proportion(full, items)),
                    **estimate_columns("accuracy", proportion(circ, items)),
                    **estimate_columns("faithfulness", ratio(circ, full, items)),
                    **_normalised_over_items(r, o, items),
                    "items": len(set(items.tolist())),
                }
            )
    return out or None


def matrix_section(study: "Study", matrix: dict) -> tuple[str, list[dict]]:
    clustered = _matrix_over_items(study, matrix)
    rows = clustered or [r for rec in matrix.values() for r in rec.result["rows"]]
    s = study.spec.scoring
    how = (
        "intervals over items, since rows of one item share a clean prompt: accuracy by the cluster bootstrap over "
        "items hulled with the exact interval of as many items, faithfulness F(C)/F(M) by the cluster bootstrap"
        if clustered
        else "exact binomial CI), faithfulness F(C)/F(M) (bootstrap CI"
    )
    text = study_table(
        study,
        circuit_x_model_rows(rows),
        "circuit_x_model",
        f"Circuit x model on {s.n} {_fresh(study, 'matrix')} per model: accuracy with every other (head, "
        f"position) mean-ablated ({how}), and "
        f"{s.random_draws} random circuits drawn layer- and position-matched to each model's own circuit, each on "
        f"{s.random_prompts or s.n} of the prompts (their mean, its interval resampling draws and prompts; the range "
        "of the draws' accuracies; the circuit's rank among the draws, draws at least as accurate, its p = (1 + "
        "rank) / (1 + draws) and the draws' 5th, 50th and 95th accuracy percentiles, on those prompts)",
    )
    text += _matrix_by_answer_length(study, matrix)
    comp_rows = completeness_rows({name: rec.result.get("completeness") for name, rec in matrix.items()})
    if comp_rows:
        text += "\n" + study_table(
            study,
            comp_rows,
            "completeness",
            "Completeness |F(C\\K) - F(M\\K)| of each model's own circuit (accuracy): random K "
            f"({s.completeness_draws} draws, each pair in K with probability 0.5) and K = one group",
        )
    return text, rows


def _matrix_by_answer_length(study: "Study", matrix: dict) -> str:
    """Each circuit's accuracy and faithfulness (accuracy) per answer length on each model's matrix prompts, from the
    stage's per-prompt outcomes; empty where every answer has one length."""
    from ...common.inference import proportion, ratio
    from ...common.outcomes import read_first_and_rest, read_record
    from ...patching.evaluate import LENGTH_BINS, length_bins

    if study.task.answer_tokens < 2:
        return ""
    lengths = length_bins(study.prompt_records("matrix", study.spec.scoring.n))
    if len(set(lengths)) < 2:
        return ""
    items = np.asarray(study.set_items("matrix"))[: len(lengths)]
    rows = []
    for name, rec in matrix.items():
        for circuit, kept in (rec.result.get("outcomes") or {}).items():
            full, circ = read_record(kept["full"])[0], read_record(kept["circuit"])[0]
            split = dict(zip(("full", "circuit"), map(read_first_and_rest, (kept["full"], kept["circuit"]))))
            for b in (b for b in LENGTH_BINS if (lengths == b).any()):
                at = lengths == b
                rows.append(
                    {
                        "model": name,
                        "circuit": circuit,
                        "answer_tokens": b,
                        "n": int(at.sum()),
                        "items": len(set(items[at].tolist())),
                        **estimate_columns("model_accuracy", proportion(full[at], items[at])),
                        **estimate_columns("accuracy", proportion(circ[at], items[at])),
                        **estimate_columns("faithfulness", ratio(circ[at], full[at], items[at])),
                        **_first_and_rest_columns(split, at, items, b == LENGTH_BINS[0]),
                    }
                )
    if not rows:
        return ""
    return "\n" + study_table(
        study,
        rows,
        "circuit_x_model_by_answer_length",
        "Circuit x model by the answer's length in tokens on the same prompts (rows and items): the model's and the "
        "circuit's accuracy and faithfulness F(C)/F(M), each with its interval over items (exact where an item has one "
        "row, else a cluster bootstrap); where the stage kept them, the same by first "
        "token against the rest (`first_token`: the first answer token the top-1 after the prompt; `rest`: every "
        "later token the top-1 given the answer's tokens before it, teacher forced). The circuits cover the "
        "prompt's positions only, an answer's later tokens reached through what they write there",
    )


def _first_and_rest_columns(split: dict, at: np.ndarray, items: np.ndarray, one_token: bool) -> dict:
    """The model's and the circuit's first-token accuracy and their ratio on the prompts ``at``, and (answers of
    several tokens) the same of the rest; empty where the records kept no split (``split``: ``full`` and
    ``circuit`` -> ``(first, rest)`` or ``(None, None)``)."""
    from ...common.inference import proportion, ratio

    (full_first, full_rest), (circ_first, circ_rest) = split["full"], split["circuit"]
    if full_first is None or circ_first is None:
        return {}
    parts = [("first_token", full_first, circ_first)] + ([] if one_token else [("rest", full_rest, circ_rest)])
    out: dict = {}
    for part, model, circuit in parts:
        out.update(estimate_columns(f"model_accuracy_{part}", proportion(model[at], items[at])))
        out.update(estimate_columns(f"accuracy_{part}", proportion(circuit[at], items[at])))
        out.update(estimate_columns(f"faithfulness_{part}", ratio(circuit[at], model[at], items[at])))
    return out


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


def left_out_sentence(result: dict, stage: str) -> str:
    """`` Groups left out of STAGE: `g` (why); ...`` where a stage left groups of the circuit out, else ``""``."""
    left_out = result.get("left_out") or {}
    if not left_out:
        return ""
    return f" Groups left out of {stage}: " + "; ".join(f"`{g}` ({why})" for g, why in left_out.items()) + ".\n"


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


def _cost(manifest: dict) -> str:
    """What the stages cost when computed, and what this invocation reused."""
    stages = manifest["stages"].values()
    total = sum(s["seconds"] for s in stages)
    reused = sum(bool(s["cached"]) for s in stages)
    return (
        f"Computing the {len(stages)} stages took {total / 60:.1f} min in all (the seconds above, from the "
        f"runs that computed them); this invocation reused {reused} of them from the cache and took "
        f"{manifest['wall_seconds']:.0f} s up to writing this report." + _compute_sentence(manifest)
    )


def _compute_sentence(manifest: dict) -> str:
    """What the stage table's compute columns mean, where ``run.json`` records the plan."""
    record = manifest.get("resources")
    if not record or "throughput" not in record:
        return ""
    return (
        f" Beside each stage's seconds: the FLOPs the resource planner counts for it (matrix multiplies, "
        f"`mechdiff run --plan`) and the share of this machine's matrix-multiply throughput they make in those "
        f"seconds (FLOPs / (seconds x {record['throughput'] / 1e9:.1f} GFLOP/s, {record['dtype']}, measured per CPU "
        "second when `run.json` was written; on several threads a share can pass 1). A stage far below the others "
        "spends its time outside matrix multiplies."
    )


def _interval(row: dict, key: str) -> str:
    return f"{row[key]:.2f} [{row[f'{key}_low']:.2f}, {row[f'{key}_high']:.2f}]"


def target_measure(study: "Study", row: dict) -> tuple[str, str]:
    """The faithfulness a circuit's target is read on, and its name: the normalised form (the empty circuit
    subtracted) in the task's metric (the logit difference on a ``logit_diff`` task, else accuracy); the paper's
    ratio only for records made before the empty circuit was scored."""
    if (
        getattr(getattr(study, "task", None), "metric", "prob") == "logit_diff"
        and "faithfulness_normalised_logit_diff" in row
    ):
        return "faithfulness_normalised_logit_diff", "normalised faithfulness in the logit difference"
    if "faithfulness_normalised" in row:
        return "faithfulness_normalised", "normalised faithfulness in accuracy"
    return "faithfulness", "the paper's ratio (records without the empty circuit)"


def circuit_findings(study: "Study", positions: dict, matrix_rows: list[dict], controls: Optional[dict] = None) -> str:
    """Per model: where the computation sits (position scan), and what its own circuit keeps on fresh prompts."""
    target = study.spec.discovery.target
    lines = []
    for name in study.spec.model_names:
        rec = positions.get(name)
        if rec is not None and rec.result["scan"]["steps"]:
            last = rec.result["scan"]["steps"][-1]
            lines.append(
                f"- **{name}**: every head kept at {', '.join(f'`{c}`' for c in last['classes'])} (every "
                f"other position mean-ablated) keeps faithfulness {_fmt(last['faithfulness'])} "
                f"({rec.result['scan']['n_prompts']} prompts)."
            )
        own = next((r for r in matrix_rows if r["model"] == name and r["circuit"] == name), None)
        if own is None:
            continue
        scanned = bool(lines) and lines[-1].startswith(f"- **{name}**")
        key, what = target_measure(study, own)
        met = own[key] >= target and own[f"{key}_low"] >= target - 0.1
        sentence = (
            ("  Its" if scanned else f"- **{name}**: its")
            + f" own circuit ({own['n_pairs']} (head, position) pairs) keeps faithfulness "
            f"{_interval(own, 'faithfulness')} (accuracy {_interval(own, 'accuracy')}) on {own['n_prompts']} "
            f"fresh prompts"
            + (f", {what} {_interval(own, key)}" if key != "faithfulness" else "")
            + f": the target (at least {target}, lower bound at least {target - 0.1:.1f}, on {what}) is "
            + ("met." if met else "not met.")
        )
        if key != "faithfulness" and np.isnan(own[key]):
            sentence += " The model does not beat its empty circuit on these prompts: it has no circuit to find."
        if own.get("empty_accuracy") is not None and own.get("full_accuracy"):
            share = own["empty_accuracy"] / own["full_accuracy"]
            if share >= 0.5:
                sentence += (
                    f" With every head ablated the model keeps {share:.2f} of its accuracy (empty circuit "
                    f"{own['empty_accuracy']:.2f}): the paper's ratio is near 1 for any circuit here, so only "
                    "the normalised faithfulness says what the circuit adds."
                )
        control = (controls or {}).get((name, name))
        if control is not None and own.get("random_draws"):
            draws = own["random_draws"]
            beats = "above" if control.rejects else "not shown above"
            sentence += (
                f" Against {len(draws)} random layer- and position-matched circuits of its size (faithfulness "
                f"{_interval(own, 'random_faithfulness')}; draws' accuracy {min(draws):.2f}-{max(draws):.2f}): "
                f'{beats} them{_rank_clause(own)} (Holm p = {control.p_adjusted:.2g} in "{CONTROLS}").'
            )
        lines.append(sentence)
        after = next((r for r in matrix_rows if r["model"] == name and r["circuit"] == f"{name} pruned"), None)
        if after is not None:
            lines.append(
                f"  After pruning ({after['n_pairs']} pairs): faithfulness {_interval(after, 'faithfulness')}."
            )
    return "\n".join(lines)


def findings(
    study: "Study",
    acc_rows: list[dict],
    matrix_rows: list[dict],
    overlaps: dict,
    cmap: dict,
    paired: Optional[list[dict]] = None,
    gain: Optional[dict] = None,
) -> str:
    """Plain sentences read off the tables (every figure here is in a table above); an ordering between models is
    read from the paired test on the same prompts (Holm within its family), never from two separate intervals."""
    base = study.spec.models.base
    acc = {r["model"]: r for r in acc_rows}
    gain = gain if gain is not None else cmap_family(cmap)
    lines = []
    for ft in study.spec.models.finetunes:
        a_b, a_f = acc[base], acc[ft]
        d = next((r for r in paired or [] if r["comparison"] == f"{ft} - {base}" and r["measure"] == "accuracy"), None)
        order = f"paired against {base} {_interval(a_b, 'accuracy')}: " + (
            difference_sentence(d) if d else "no per-prompt outcomes to pair"
        )
        lines.append(f"- **{ft}** accuracy {_interval(a_f, 'accuracy')}, {order}.")
        m = next((r for r in matrix_rows if r["model"] == ft and r["circuit"] == base), None)
        if m:
            lines.append(f"  The {base} circuit alone gives {ft} faithfulness {_interval(m, 'faithfulness')}.")
        rows = overlaps.get(ft, [])
        everything = next((r for r in rows if r["group"] == "all"), None)
        if everything:
            lines.append(
                f"  Its own circuit shares {everything['intersection']} of the base circuit's "
                f"{everything['size_first']} heads ({everything['frac_first']:.2f}; hypergeometric "
                f"p = {everything['p_value']:.2g})."
            )
        r = cmap.get(ft)
        r = None if r is None or "skipped" in r.result else r
        gap = r and cmap_has_gap(r.result)
        if r and not gap:
            lines.append(
                f"  On the CMAP prompts {ft} ({_fmt(r.result['finetune_accuracy'])}) is not above {base} "
                f"({_fmt(r.result['base_accuracy'])}): there is no gain for CMAP to localise."
            )
        if r and gap:
            lines.append(
                f"  CMAP ({ft} into {base}; base {_fmt(r.result['base_accuracy'])}, fine-tune "
                f"{_fmt(r.result['finetune_accuracy'])}):"
            )
            for x in r.result["rows"]:
                if x["kind"] != "z" or x["scope"].startswith("random"):
                    continue
                control = next(
                    (
                        y
                        for y in r.result.get("random_rows", [])
                        if y["scope"] == f"random:{x['scope']}" and y["kind"] == "z"
                    ),
                    None,
                )
                lines.append(
                    f"  - head outputs of `{x['scope']}`: accuracy {_fmt(x['accuracy'])}. "
                    f"{_ordering(gain, ft, x['scope'] + '/z', 'base')}"
                    + (
                        f" Random heads of the same layers: {_fmt(control['accuracy'])}; "
                        f"{_ordering(gain, ft, x['scope'] + '/z', 'random:' + x['scope'] + '/z')}"
                        if control
                        else ""
                    )
                )
            qk = {x["kind"]: x for x in r.result["rows"] if x["scope"] == "circuit"}
            if "qk" in qk and "v" in qk:
                lines.append(
                    f"  Whole circuit: QK patching gives {_fmt(qk['qk']['accuracy'])}, V patching "
                    f"{_fmt(qk['v']['accuracy'])}. {_ordering(gain, ft, 'circuit/v', 'circuit/qk')}"
                )
    return "\n".join(lines)


def _ordering(gain: dict, ft: str, a: str, b: str) -> str:
    """A sentence on ``a`` against ``b`` from their paired test on the same prompts, in the family "which parts
    carry the gain" (Holm): an ordering is stated only where the adjusted test rejects."""
    test = gain.get((ft, a, b))
    if test is None:
        return ""
    iv = test.interval
    ci = f"{iv.value:+.3f} [{iv.low:+.3f}, {iv.high:+.3f}]"
    verdict = (
        ("so the first is larger" if iv.value > 0 else "so the second is larger")
        if test.rejects
        else "neither is shown to be larger"
    )
    p = f"{test.method}, Holm p = {test.p_adjusted:.2g}"
    return f"Paired difference {a} - {b} on the same prompts: {ci}, {verdict} ({p})."


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
    from ...methods.dcm import split_indices

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


def _dcm_over_items(study: "Study", dcm: "StageRecord", base: str) -> "StageRecord":
    """``dcm`` with each selection's target and floor accuracies (its DCM row and every model's semantic patching)
    as intervals over the test pairs' items (`dcm_test_items`), from the per-pair outcomes the stage kept; unchanged
    where the pairs are items of their own. Random heads keep the stage's interval, which resamples the draws as
    well as the pairs (the per-pair share over items alone would leave the draws' spread out)."""
    from dataclasses import replace

    from ...common import inference as inf
    from ...common.outcomes import from_bits

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


def _cmap_over_items(study: "Study", cmap: dict) -> dict:
    """``cmap`` with each part's accuracy and both models' as intervals over the CMAP prompts' items
    (`cmap_items_of`), from the per-prompt outcomes the stage kept; unchanged where prompts are items. The random
    controls keep the stage's interval (it resamples their draws as well as the prompts)."""
    from dataclasses import replace

    from ...common import inference as inf

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


def limitations(study: "Study", positions: dict) -> str:
    """The departures and cuts of this run, each stated only where the run made it."""
    d, sc, cm = study.spec.discovery, study.spec.scoring, study.spec.cmap
    scanned = any(rec is not None and rec.result["scan"]["steps"] for rec in positions.values())
    lines = []
    if d.method == "curve":
        lines.append(
            "- Departures from Prakash et al.: circuits are drawn over (head, position class) pairs ranked by a\n"
            "  first-order attribution, not path-patched head groups A-D"
            + (
                " (the position scan shows how much the paper's\n  form, every head kept at the named "
                "positions, explains)"
                if scanned
                else ""
            )
            + "; DCM and CMAP run on the groups of the base's circuit, a group at\n"
            "  a position class patched at every token of it (its groups are position classes, not the paper's\n"
            "  functional groups). `method =\n"
            '  "path"` in the task file gives the paper\'s form.'
        )
    else:
        lines.append(
            "- Circuits by path patching of head groups as Prakash et al.; pruning, DCM and CMAP follow the rules the\n"
            f"  task file names (pruning `{sc.prune_rule}`, DCM `lam_scale = {study.spec.dcm.lam_scale}`, CMAP "
            f"`scope = {cm.scope}`); the README's departures table says which are the paper's."
        )
    if sc.prune and sc.prune_rule == "greedy":
        lines.append(
            f"- Pruning uses the {_pruned_on(study)} on its own small prompt set and a bounded greedy "
            "search for K; pairs\n"
            "  whose removal alone already exceeds the threshold skip the search (it could only raise them)."
        )
    nested = study.nested_sets() if hasattr(study, "nested_sets") else []
    if nested:
        from ...tasks.prompt_sets import nested_departure

        lines.append(f"- Departure from disjoint sets: {nested_departure(nested)}.")
    if study.task.answer_tokens > 1:
        lines.append(
            f"- Answers of up to {study.task.answer_tokens} tokens are scored by teacher forcing (each answer's "
            "tokens appended to the prompt); the circuits,\n  pruning, DCM and CMAP cover the prompt's positions only, "
            "never an answer token's own, so the heads\n  reach the answer's later tokens only through what they write "
            "at the prompt (by answer length, and by first token against the rest:\n  "
            "`tables/accuracy_by_answer_length.csv`, `tables/circuit_x_model_by_answer_length.csv`)."
        )
    empty = task_empty_classes(study.task)
    if empty:  # a class empty in a prompt holds no head there (a named position on the last token, say)
        lines.append(
            "- Position classes empty in some prompts: "
            + "; ".join(f"`{c}` ({per_template(n)})" for c, n in empty.items())
            + "."
        )
    if cm.n_random:
        lines.append(
            f"- CMAP's random control: {cm.n_random} draws of layer-matched heads per group (the `[cmap] n_random`\n"
            "  setting), each draw's outcomes kept; a part is compared with it by the sign-flip test against the\n"
            "  per-prompt share of draws that are right."
        )
    return "\n".join(lines) + "\n"


#: The last limitation: entity tracking's one template family, or any other task's own templates.
PHRASINGS = {
    True: """- Every prompt comes from one template family with 7 boxes; nothing here says how the circuits transfer to
  other phrasings.
""",
    False: """- Every prompt comes from the task's own templates; nothing here says how the circuits transfer to other
  phrasings.
""",
}


def _source(name: str, provenance: dict) -> str:
    """Where a model came from as its spec names it (``package:...``, a hub id), never this machine's resolved
    path: the adapter for a LoRA, else the spec's source (and GGUF file)."""
    if provenance.get("adapter"):
        return str(provenance["adapter"])
    spec = resolve_spec(name)
    return spec.source + (f"/{spec.gguf_file}" if spec.gguf_file else "")


def paired_section(study: "Study", accuracy: dict, matrix: dict, dcm: "StageRecord") -> tuple[str, list[dict]]:
    """Every difference of a fine-tune from the base on the same prompts with its paired interval; the per-prompt
    outcomes behind them written to ``outcomes.json`` (committed with the results)."""
    from ...common.outcomes import write_outcomes
    from ...report.paired import CAPTION, outcome_stages, paired_rows

    stages = outcome_stages(accuracy, matrix, dcm)
    if not stages:
        return (
            "_No per-prompt outcomes in these stage records (made before mechdiff kept them): rerun the stages "
            "for paired intervals._\n",
            [],
        )
    write_outcomes(study.dir, stages)
    margins = study.spec.inference.margins  # the task file's [inference] margins: report-only
    items = _items(study, stages) or {}
    semantic = dcm_test_items(study, dcm) if dcm is not None else {}
    if semantic:  # the DCM test pairs' items, where an imported task's pairs share them
        items["semantic"] = semantic
    rows = paired_rows(stages, study.spec.models.base, study.spec.models.finetunes, items or None, margins)
    return study_table(study, rows, "paired_differences", CAPTION), rows


def families_section(study: "Study", paired: list[dict], gain: dict, encoded: dict, controls: dict) -> str:
    """Every test a findings sentence reads, by family, with its adjusted p (docs/inference.md)."""
    rows = paired_family_rows(paired) + family_rows(gain, encoded, controls)
    if not rows:
        return "_No test: no per-prompt outcomes in these stage records._\n"
    caption = (
        "Every claim of the findings as a test in its family (differences between the models; sameness between "
        "the models; circuit against controls; which parts carry the gain; what the heads encode): estimate and "
        "95% interval (sameness: the 90% interval its two one-sided tests read, and its margin, from the task "
        "file's [inference] margins), p, Holm's adjusted p within the family, whether it is shown, the test, rows "
        "and items (docs/inference.md)"
    )
    return study_table(study, rows, "families", caption)


def _items(study: "Study", stages: dict) -> Optional[dict]:
    """Each paired stage's item ids (eval for accuracy, matrix for the circuit x model matrix), where the study
    knows them and they align with the recorded outcomes; None: one row an item."""
    get = getattr(study, "set_items", None)
    if get is None:
        return None
    out = {}
    for stage, name in (("accuracy", "eval"), ("matrix", "matrix")):
        try:
            ids = np.asarray(get(name))
        except (KeyError, TypeError, ValueError):
            continue
        record = next(iter(stages.get(stage, {}).values()), None) if stage == "accuracy" else None
        if record is None and stage == "matrix":
            record = next((v["full"] for k, v in stages.items() if k.startswith("matrix:")), None)
        n = len(record["correct"]) if record else None
        if n is not None and ids.size >= n:
            out[stage] = ids[:n]
    return out or None


def paired_findings(rows: list[dict]) -> str:
    """The paired differences in words (accuracy and each model's own circuit), each as far as its interval goes."""
    from ...report.paired import difference_sentence

    lines = []
    for comparison in dict.fromkeys(r["comparison"] for r in rows):
        mine = [r for r in rows if r["comparison"] == comparison and not r["measure"].startswith("DCM")]
        if mine:
            lines.append(f"- **{comparison}** on the same prompts (paired 95% intervals, Holm within the family): ")
            lines[-1] += "; ".join(difference_sentence(r) for r in mine) + "."
    return "\n".join(lines)


def _rank_clause(row: dict) -> str:
    """A findings clause on the circuit's rank among its random draws (none where the row predates it)."""
    if "random_rank" not in row:
        return ""
    n = len(row["random_draws"])
    return (
        f"; on {row['random_n_prompts']} of the prompts, {row['random_rank']} of {n} draws are at least as accurate "
        f"as the circuit (rank p = {row['random_p']:.2g}; draws' accuracy 5-95% {row['random_q05']:.2f}-"
        f"{row['random_q95']:.2f})"
    )


def _fresh(study: "Study", name: str) -> str:
    """``fresh held-out`` for a generated set; for a set dealt from fixed rows, what its row list shows."""
    sets = getattr(study, "prompt_sets", None)
    if not sets:
        return "fresh held-out prompts"
    k = _shared(sets, name)
    return "prompts no other set holds" if k == 0 else f"prompts ({k} of them also in another set)"


def _disjoint(study: "Study", name: str, generated: str) -> str:
    """``generated`` (a generated task's sets, seeded apart) or, from the drawn rows, whether ``name`` shares any."""
    sets = getattr(study, "prompt_sets", None)
    if not sets:
        return generated
    k = _shared(sets, name)
    return "sharing no row with any other prompt set" if k == 0 else f"sharing {k} rows with other prompt sets"


def _shared(sets: dict, name: str) -> int:
    """Rows of the set ``name`` that another set also holds."""
    others = {r for other, rows in sets.items() if other != name for r in rows}
    return len(set(sets.get(name, [])) & others)


def _prompt_sets_sentence(study: "Study", manifest: dict) -> str:
    """Where the prompts came from: for a task of fixed rows, the sets as ``run.json`` lists them (sizes, groups,
    rows shared, counted from the lists); for a generated task, each set's seed."""
    sets = manifest.get("prompt_sets")
    if not sets or sets.get("generated"):
        seeds = ", ".join(f"{k} +{v}" for k, v in PROMPT_OFFSETS.items() if not k.startswith("reproduction"))
        held = (
            ". All prompts use only the held-out objects (`eval_objects()`), disjoint from the fine-tuning objects. "
            if _held_out(study)
            else ". "
        )
        return f"Seeds: task seed {study.spec.task.seed}; each prompt set's seed is it plus {seeds}{held}" + (
            _items_sentence(sets) if sets else ""
        )
    each = ", ".join(f"{name} {n} ({sets['groups'][name]} groups)" for name, n in sets["sizes"].items())
    shared = (
        "no row is in two sets"
        if sets["shared_rows"] == 0
        else f"{sets['shared_rows']} rows are shared between sets, so those sets are not disjoint"
    )
    return (
        f"Prompt sets: dealt from the task's {sets['n_rows']} rows ({sets['n_groups']} (template, token length) "
        f"groups) by seed {study.spec.task.seed}, stratified by group, the same rows for every model: {each}; "
        f"{shared} (counted from the row lists in `run.json`, `prompt_sets`). " + _items_sentence(sets)
    )


def _items_sentence(sets: dict) -> str:
    """Each set's rows and items (an item: a clean prompt, or the task's item field) and the items sets share, from
    ``run.json``'s ``prompt_sets`` (a record made before items were counted: nothing)."""
    if "items" not in sets:
        return ""
    each = ", ".join(f"{name} {n} rows / {sets['items'][name]} items" for name, n in sets["sizes"].items())
    nested = sets.get("nested") or []
    shared = "no item is in two sets" if sets["shared_items"] == 0 else f"{sets['shared_items']} items are in two sets"
    aside = f" ({', '.join(nested)} nested: first-N of one draw, a departure)" if nested else ""
    return f"Items: {each}; {shared}{aside}. "


def _held_out(study: "Study") -> bool:
    """Whether the task's prompts draw on the vocabulary held out from fine-tuning (entity tracking)."""
    return "vocabulary" in study.task.options


def write_report(
    study: "Study",
    accuracy: dict,
    positions: dict,
    found: dict,
    pruned: dict,
    matrix: dict,
    dcm: "StageRecord",
    cmap: dict,
    finetune_dcm: Optional[dict] = None,
    without_behaviour: Optional[dict[str, str]] = None,
) -> Path:
    """Write ``report.md`` (and every table and figure it cites) into the study directory; ``without_behaviour``:
    model -> why the stages that explain a behaviour were not run for it (and ``dcm`` None where the base is one)."""
    without_behaviour = without_behaviour or {}
    if dcm is None:
        base = study.spec.models.base
        dcm = StageRecord("dcm", "", {"skipped": f"{base} does not do the task"}, 0.0, True)
    acc_text, acc_rows = accuracy_section(study, accuracy)
    mat_text, mat_rows = matrix_section(study, matrix)
    paired_text, paired = paired_section(study, accuracy, matrix, dcm)
    base = study.spec.models.base
    gain, encoded = cmap_family(cmap, cmap_items_of(study, cmap)), dcm_tests(dcm, base, study)
    dcm_shown, cmap_shown = _dcm_over_items(study, dcm, base), _cmap_over_items(study, cmap)  # intervals over items
    controls = controls_family(mat_rows)
    ov_text, overlaps = overlap_section(study, found)
    manifest = study.manifest()
    spec = study.spec
    stage_rows = stage_table(manifest, keys=False)
    model_rows = [
        {
            "model": n,
            "digest": d,
            "fingerprint": accuracy[n].result["fingerprint"],
            "source": _source(n, accuracy[n].result["provenance"]),
        }
        for n, d in manifest["model_digests"].items()
    ]
    parts = [
        f"# {study.task.name}: {spec.models.base} against {', '.join(spec.models.finetunes)}\n",
        "Generated by `mechdiff run` from "
        f"`{spec.source}`. Intervals are 95%: exact binomial (Clopper-Pearson) for accuracies, bootstrap over "
        "prompts for ratios and probabilities; a difference on the same prompts is a paired test (exact McNemar "
        "for 0/1 outcomes, the sign-flip test otherwise) with the interval that agrees with it. Every ordering, "
        "difference and 'encodes' below is a test in a named family, Holm-adjusted (table: Families of claims; "
        "docs/inference.md); 'same' is written only where an equivalence test against its margin passes (the "
        "task file's [inference] margins: "
        + ", ".join(f"{m} +-{v:g}" for m, v in spec.inference.margins.items())
        + ").\n",
        "## Findings\n",
        circuit_findings(study, positions, mat_rows, controls),
        *[f"- **{name}**: {why}." for name, why in without_behaviour.items()],
        findings(study, acc_rows, mat_rows, overlaps, cmap_shown, paired, gain),
        paired_findings(paired),
        dcm_findings(dcm_shown, encoded),
        "",
        "## Limitations\n",
        limitations(study, positions) + PHRASINGS[_held_out(study)],
        "## Accuracy\n",
        acc_text,
        "## Where the computation sits (position scan)\n",
        positions_section(study, positions),
        "## Circuits\n",
        _method(study),
        circuit_section(study, found, pruned),
        "## Pruning\n",
        pruning_section(study, pruned),
        "## Circuit x model\n",
        mat_text,
        "## Differences between models (paired)\n",
        paired_text,
        "## Overlap\n",
        ov_text,
        "## What the heads encode (DCM)\n",
        dcm_section(study, dcm_shown, finetune_dcm),
        "## Cross-model activation patching (CMAP)\n",
        cmap_section(study, cmap_shown),
        "## Families of claims\n",
        families_section(study, paired, gain, encoded, controls),
        "## What was run\n",
        to_markdown(model_rows),
        "",
        _prompt_sets_sentence(study, manifest)
        + "Versions: "
        + ", ".join(f"{k} {v}" for k, v in manifest["versions"].items())
        + f". Python {manifest['python']} on {manifest['machine']}.\n",
        to_markdown(stage_rows),
        "",
        f"Configuration: `run.json` (the full spec). {_cost(manifest)}\n",
    ]
    return write_text(study.dir / "report.md", "\n".join(parts))
