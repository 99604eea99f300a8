"""The knowledge study's tables, figures and reports, from its stage results (a model's summary, a comparison);
imports no study."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Optional, Sequence

import numpy as np

from ...common.io import write_text
from ...methods.knowledge import figures
from ...methods.knowledge.evaluate import CURVE_RANKING
from ...methods.knowledge.graph import EdgeCircuit
from ...report.tables import to_markdown, write_table
from .settings import KnowledgeSettings


def relation_summary(result: dict, k: int) -> str:
    """The lines ``mechdiff knowledge`` prints for one relation's outcome (``KnowledgeStudy.outcome[relation]``):
    per model, its facts, Hit@``k`` of the full model, the circuit and random circuits, and its head roles; then
    the overlap of the models' circuits, where there are several."""
    hk = f"hit@{k}"
    lines = [
        f"{name}: {r['n_facts']} facts; full {hk} {r['full'][hk]['value']:.3f}, circuit "
        f"{r['circuit'][hk]['value']:.3f} ({r['ratio_to_full']:.2f} of full) with {r['circuit_edges']} edges "
        f"({100 * r['circuit_fraction']:.2f}%), random {r['random']['mean']:.3f}; roles {r['role_counts']}"
        for name, r in result["results"].items()
    ]
    if "comparison" in result["study"]:
        lines.append(json.dumps(result["study"]["comparison"]["overlap"], indent=1))
    return "\n".join(lines)


def write_model_report(
    summary: dict,
    circuit: EdgeCircuit,
    lens: dict,
    roles: dict,
    curve: Optional[dict],
    out: Path,
    settings: KnowledgeSettings,
    full_hit: float,
) -> None:
    k = settings.k
    hk = f"hit@{k}"
    rows = [
        {
            "run": "full model",
            "edges": summary["n_edges_graph"],
            "edges_%": 100.0,
            hk: summary["full"][hk]["value"],
            "low": summary["full"][hk]["low"],
            "high": summary["full"][hk]["high"],
        },
        {
            "run": "circuit",
            "edges": summary["circuit_edges"],
            "edges_%": 100 * summary["circuit_fraction"],
            hk: summary["circuit"][hk]["value"],
            "low": summary["circuit"][hk]["low"],
            "high": summary["circuit"][hk]["high"],
        },
        {
            "run": f"random ({settings.n_random} draws, mean)",
            "edges": summary["circuit_edges"],
            "edges_%": 100 * summary["circuit_fraction"],
            hk: summary["random"]["mean"],
            "low": None,
            "high": None,
        },
        {
            "run": "empty circuit",
            "edges": 0,
            "edges_%": 0.0,
            hk: summary["empty"][hk]["value"],
            "low": summary["empty"][hk]["low"],
            "high": summary["empty"][hk]["high"],
        },
    ]
    write_table(rows, out / "hit", caption=f"Hit@{k} on {summary['n_facts']} facts of {settings.label}")
    if summary["sweep"]:
        write_table(summary["sweep"], out / "sweep", caption="circuit sizes tried (top-|score|, dangling edges pruned)")
    if curve:
        write_table(
            curve["rows"],
            out / "faithfulness_curve",
            caption=f"faithfulness curve (CPR {curve['cpr']:.3f}, CMD {curve['cmd']:.3f})",
        )
        figures.faithfulness_figure(
            curve,
            out / "faithfulness_curve.png",
            full_hit,
            title=f"{summary['model']} {settings.label}: CPR {curve['cpr']:.3f}, CMD {curve['cmd']:.3f}",
        )
    role_rows = [{"head": h, **r} for h, r in sorted(roles.items(), key=lambda t: (t[1]["role"], t[0]))]
    if role_rows:
        write_table(role_rows, out / "head_roles", caption="head roles in the circuit")
        figures.head_roles_figure(
            roles, out / "head_roles.png", title=f"{summary['model']} {settings.label}: head roles"
        )
    figures.logit_lens_figure(
        lens, out / "logit_lens.png", title=f"{summary['model']} {settings.label}: logit lens of the residual stream"
    )
    if lens["nodes"]:
        figures.node_lens_figure(
            lens["nodes"],
            roles,
            out / "node_lens.png",
            title=f"{summary['model']} {settings.label}: logit lens of circuit nodes",
        )
    figures.circuit_graph(circuit, out / "circuit.png", settings.max_graph_edges, roles)
    write_text(out / "report.md", report_text(summary, settings, curve, role_rows))


def random_line(hits: Sequence[float], circuit_hit: float, k: int) -> str:
    """Random circuits of the circuit's size: their mean and range, and how many reach the circuit's Hit@k (the
    rank p-value ``(1 + that many) / (1 + draws)``)."""
    if not hits:
        return "- Random circuits: none drawn."
    reach = sum(h >= circuit_hit for h in hits)
    return (
        f"- {len(hits)} random circuits of the same edge count: Hit@{k} mean {np.mean(hits):.3f}, range "
        f"[{min(hits):.3f}, {max(hits):.3f}]; {reach} reach the circuit's {circuit_hit:.3f} "
        f"(p = {(1 + reach) / (1 + len(hits)):.3f})."
    )


def report_text(summary: dict, settings: KnowledgeSettings, curve: Optional[dict], role_rows: list[dict]) -> str:
    k = settings.k
    hk = f"hit@{k}"
    f = lambda e: f"{e['value']:.3f} [{e['low']:.3f}, {e['high']:.3f}]"  # noqa: E731
    lines = [
        f"# Knowledge circuit: {settings.label} on {summary['model']}",
        "",
        f"- Facts the model gets right by Hit@{k}: {summary['n_facts']} (template "
        f"{settings.template}); method {settings.method}, {settings.ablation} ablation.",
        f"- Full model Hit@{k}: {f(summary['full'][hk])}; empty circuit: {f(summary['empty'][hk])}.",
        f"- Circuit: {summary['circuit_edges']} of {summary['n_edges_graph']} edges "
        f"({100 * summary['circuit_fraction']:.2f}%), {summary['circuit_nodes']} nodes "
        f"({summary['circuit_heads']} heads); Hit@{k} {f(summary['circuit'][hk])} = "
        f"{summary['ratio_to_full']:.2f} of the full model's.",
        random_line(summary["random"][hk], float(summary["circuit"][hk]["value"]), k),
    ]
    if summary.get("acdc"):
        a = summary["acdc"]
        pre = "every edge" if a["prefilter"] is None else f"the top {100 * a['prefilter']:.2f}% of edges by |EAP|"
        lines.append(
            f"- ACDC: metric {a['metric']}, tau {a['tau']}, trying {pre} ({a['n_candidates']} edges) on "
            f"{a['settings']['n_facts']} facts; {a['trials']} edges tried in {a['forwards']} forwards "
            f"({a['cost']:.0f} forward-pass equivalents), {a['skipped']} removed as edges into dead nodes; "
            f"metric {a['metric_full']:.3f} (full model) -> {a['metric_final']:.3f}; {a['seconds']:.0f} s."
        )
        if summary.get("heldout"):
            h = summary["heldout"]
            lines.append(
                f"- On the {h['n']} facts ACDC did not see: full model Hit@{k} {f(h['full'][hk])}, circuit "
                f"{f(h['circuit'][hk])}."
            )
        lines.append(
            f"- Against Yao et al.'s setting (their code, zjunlp/KnowledgeCircuits: GPT2-Medium; ACDC with zero "
            f"ablation and match_nll on 20 validation facts of a relation; Hit@10 on 20 test facts): here "
            f"{summary['model']}, ACDC on {a['settings']['n_facts']} facts, Hit@{k} on the facts the model "
            f"gets right by Hit@{k}."
        )
    if curve:
        lines.append(
            f"- Faithfulness curve (mean answer log-probability; MIB's CPR and CMD, Mueller et al. 2025; edges "
            f"ranked by {CURVE_RANKING.get(settings.method, '|score|')}): "
            f"CPR {curve['cpr']:.3f}, CMD {curve['cmd']:.3f} "
            f"({curve['area']})."
        )
    ll = summary["logit_lens"]
    first = lambda layer: f"after {layer}" if layer else "never (at no layer)"  # noqa: E731
    lines += [
        f"- Logit lens: the answer first reaches median rank < {k} at the last subject token "
        f"{first(ll['first_layer_top10_subject'])}, at the last token {first(ll['first_layer_top10_last'])}.",
        f"- Head roles: {summary['role_counts']}.",
        "",
        "![circuit](circuit.png)",
        "",
        "![logit lens](logit_lens.png)",
        "",
        "![node lens](node_lens.png)",
        "",
        "![head roles](head_roles.png)",
        "",
    ]
    if curve:
        lines += ["![faithfulness](faithfulness_curve.png)", ""]
    if summary["sweep"]:
        lines += ["## Sizes tried", "", to_markdown(summary["sweep"]), ""]
    if role_rows:
        lines += ["## Head roles", "", to_markdown(role_rows), ""]
    lines += ["## Time (s)", "", to_markdown([{"stage": s, "seconds": v} for s, v in summary["timings_s"].items()]), ""]
    return "\n".join(lines)


def compare_report(cmp: dict, results: dict[str, dict], settings: KnowledgeSettings) -> str:
    a, b = cmp["models"]
    hk = f"hit@{settings.k}"
    rows = [
        {
            "model": m,
            "facts": r["n_facts"],
            f"full {hk}": r["full"][hk]["value"],
            f"circuit {hk}": r["circuit"][hk]["value"],
            "edges": r["circuit_edges"],
            "edges_%": 100 * r["circuit_fraction"],
            "random": r["random"]["mean"],
            "CPR": (r["curve"] or {}).get("cpr"),
            "CMD": (r["curve"] or {}).get("cmd"),
            **{f"{k}": v for k, v in r["role_counts"].items()},
        }
        for m, r in results.items()
    ]
    lines = [
        f"# Knowledge circuits of {settings.label} across checkpoints: {a} vs {b}",
        "",
        "Same facts in both models (those both get right by Hit@k).",
        "",
        to_markdown(rows),
        "",
        "## Overlap (hypergeometric p: random sets of the same sizes share at least this many)",
        "",
        to_markdown(cmp["overlap"]),
        "",
        "## Heads whose role persists",
        "",
    ]
    for role, v in cmp["persisting_roles"].items():
        lines.append(f"- {role}: {a} {v['first']}; {b} {v['second']}; both {v['both']}")
    lines += ["", f"Per-model reports: [{a}]({a}/report.md), [{b}]({b}/report.md).", ""]
    return "\n".join(lines)


def edit_report(cmp: dict, edit: str, k: int = 10) -> str:
    """Markdown of `mechdiff.methods.knowledge.editing.compare_edit`'s result."""
    hk = f"hit@{k}"
    f = lambda e: f"{e[hk]['value']:.2f} [{e[hk]['low']:.2f}, {e[hk]['high']:.2f}]"  # noqa: E731
    m, h = cmp["models"], cmp["hit"]
    lines = [
        f"# The circuit of an edit: {edit}, {m['before']} (before) vs {m['after']} (after)",
        "",
        f"Prompts ({len(cmp['prompts'])}): " + "; ".join(cmp["prompts"]) + ".",
        "",
        f"- Before, on its study's facts: the full model's {hk} {f(h['full_before'])}, its circuit's {f(h['before'])}.",
        f"- After, on its study's facts: the full model's {hk} {f(h['full_after'])}, its circuit's {f(h['after'])}.",
        "",
    ]
    if cmp["cross"]:
        lines += [
            "## Each circuit in each model, on the edit's prompts (zero ablation)",
            "",
            "The rank (0 = top) of the model's own object: the original before the edit, the new one after.",
            "",
            to_markdown(cmp["cross"]),
            "",
        ]
    lines += [
        "## Overlap",
        "",
        "null_95: the central 95% of the intersection of random sets of the same sizes (hypergeometric); "
        "p: the chance that random sets share at least as many.",
        "",
        to_markdown(cmp["overlap"]),
        "",
        "## Edges that moved, by what they feed",
        "",
        to_markdown(cmp["moved"]),
        "",
        "## What each head carries (logit lens at the last token, median rank over the prompts; 0 = top)",
        "",
        to_markdown(cmp["heads"], floatfmt=".0f"),
        "",
        "![heads](heads_lens.png)",
        "",
    ]
    return "\n".join(lines)
