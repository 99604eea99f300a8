"""Figures of a knowledge circuit (matplotlib, Agg): the graph, the logit lens, head roles, the curve."""

from __future__ import annotations

from pathlib import Path
from typing import Optional

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
import numpy as np  # noqa: E402

from ...common.io import save_figure  # noqa: E402
from .graph import EdgeCircuit  # noqa: E402

ROLE_COLORS = {"mover": "#d62728", "relation": "#1f77b4", "mixed": "#9467bd", "other": "#999999"}


def _node_xy(node: str, n_layers: int, n_heads: int) -> tuple[float, float]:
    """Layered layout: x = layer (EMB left, LOGITS right), y = head index, MLP above the heads."""
    if node == "EMB":
        return -1.0, n_heads / 2
    if node == "LOGITS":
        return float(n_layers), n_heads / 2
    if node.startswith("MLP"):
        return int(node[3:]) + 0.35, float(n_heads) + 0.5
    layer, head = node[1:].split("H")
    return float(layer), float(head)


def circuit_graph(
    circuit: EdgeCircuit, path: str | Path, max_edges: int = 200, roles: Optional[dict] = None, title: str = ""
) -> Path:
    """The circuit's nodes on a layers x heads grid and its ``max_edges`` strongest edges."""
    g = circuit.graph
    edges = circuit.edges
    if circuit.scores:
        edges = sorted(edges, key=lambda e: -abs(circuit.scores.get(e, 0.0)))
    shown = edges[:max_edges]
    vmax = max((abs(circuit.scores.get(e, 0.0)) for e in shown), default=1.0) or 1.0
    fig, ax = plt.subplots(figsize=(max(8, 0.42 * g.n_layers + 3), 5.5))
    for e in shown:
        s, _, r = e.partition("->")
        node_r = g.receiver_node(r)
        kind = r.rpartition(".")[2] if "." in r else "in"
        color = {"q": "#2ca02c", "k": "#ff7f0e", "v": "#1f77b4", "in": "#555555"}[kind]
        w = abs(circuit.scores.get(e, vmax)) / vmax
        x0, y0 = _node_xy(s, g.n_layers, g.n_heads)
        for n in node_r:
            x1, y1 = _node_xy(n, g.n_layers, g.n_heads)
            ax.plot([x0, x1], [y0, y1], color=color, alpha=0.15 + 0.6 * w, lw=0.4 + 1.6 * w, zorder=1)
    nodes = circuit.nodes()
    for n in nodes:
        x, y = _node_xy(n, g.n_layers, g.n_heads)
        role = (roles or {}).get(n, {}).get("role")
        marker = "s" if n.startswith("MLP") else "o" if n.startswith("L") else "D"
        ax.scatter(
            [x],
            [y],
            s=60,
            marker=marker,
            color=ROLE_COLORS.get(role, "#333333"),
            zorder=3,
            edgecolors="white",
            linewidths=0.5,
        )
        if n.startswith("L") or n in ("EMB", "LOGITS"):
            ax.annotate(n, (x, y), fontsize=5, xytext=(2, 2), textcoords="offset points", zorder=4)
    for kind, c in (("Q", "#2ca02c"), ("K", "#ff7f0e"), ("V", "#1f77b4"), ("MLP/logits input", "#555555")):
        ax.plot([], [], color=c, label=f"edge into {kind}")
    for role, c in ROLE_COLORS.items():
        if roles and any(v.get("role") == role for v in roles.values()):
            ax.scatter([], [], color=c, label=f"{role} head")
    ax.legend(fontsize=6, loc="upper left", ncol=2)
    ax.set_xlabel("layer (EMB left, LOGITS right; squares: MLPs)")
    ax.set_ylabel("head")
    ax.set_xlim(-1.5, g.n_layers + 0.5)
    ax.set_title(
        title or f"{circuit.task}: {len(circuit.edges)} edges, {len(nodes)} nodes (strongest {len(shown)} drawn)",
        fontsize=9,
    )
    return save_figure(fig, path)


def logit_lens_figure(lens: dict, path: str | Path, title: str = "") -> Path:
    """Median answer rank (and interquartile band) per layer at the last subject token and last token."""
    fig, ax = plt.subplots(figsize=(7, 3.6))
    x = np.arange(len(lens["layers"])) - 1
    for key, label, c in (("last_subject", "last subject token", "#d62728"), ("last", "last token", "#1f77b4")):
        r = lens[key] + 1
        ax.plot(x, np.median(r, 1), color=c, label=label)
        ax.fill_between(x, np.percentile(r, 25, 1), np.percentile(r, 75, 1), color=c, alpha=0.2)
    ax.set_yscale("log")
    ax.invert_yaxis()
    ax.set_xlabel("residual stream after layer (-1: embedding)")
    ax.set_ylabel("answer rank (1 = top)")
    ax.axhline(10, color="black", lw=0.5, ls=":")
    ax.legend(fontsize=8)
    ax.set_title(title or "logit lens of the residual stream", fontsize=9)
    return save_figure(fig, path)


def node_lens_figure(node_ranks: dict, roles: dict, path: str | Path, title: str = "", top: int = 30) -> Path:
    """Median logit-lens answer rank of each circuit node's own output at the last token (best ``top``)."""
    items = sorted(((n, float(np.median(r)) + 1) for n, r in node_ranks.items() if len(r)), key=lambda t: t[1])[:top]
    fig, ax = plt.subplots(figsize=(7, max(2.5, 0.22 * len(items) + 1)))
    names = [n for n, _ in items]
    colors = [ROLE_COLORS.get(roles.get(n, {}).get("role"), "#555555") for n in names]
    ax.barh(range(len(items)), [v for _, v in items], color=colors)
    ax.set_yticks(range(len(items)))
    ax.set_yticklabels(names, fontsize=6)
    ax.set_xscale("log")
    ax.invert_yaxis()
    ax.set_xlabel("median answer rank of the node's output (1 = top)")
    ax.set_title(title or "logit lens of circuit nodes (last token)", fontsize=9)
    return save_figure(fig, path)


def head_roles_figure(roles: dict, path: str | Path, title: str = "") -> Path:
    """Attention of the last token to the subject vs the relation tokens, per circuit head, by role."""
    fig, ax = plt.subplots(figsize=(5.5, 5))
    for h, r in roles.items():
        ax.scatter(r["subject_attention"], r["relation_attention"], color=ROLE_COLORS[r["role"]], s=25)
        if r["role"] != "other":
            ax.annotate(
                h,
                (r["subject_attention"], r["relation_attention"]),
                fontsize=6,
                xytext=(2, 2),
                textcoords="offset points",
            )
    for role, c in ROLE_COLORS.items():
        ax.scatter([], [], color=c, label=role)
    ax.set_xlabel("attention to the subject (last token)")
    ax.set_ylabel("attention to the relation tokens (last token)")
    ax.set_xlim(-0.02, 1.02)
    ax.set_ylim(-0.02, 1.02)
    ax.legend(fontsize=8)
    ax.set_title(title or "head roles", fontsize=9)
    return save_figure(fig, path)


def faithfulness_figure(curve: dict, path: str | Path, full_hit: float, title: str = "") -> Path:
    """Faithfulness and Hit@10 against the fraction of edges kept (log axis)."""
    rows = curve["rows"]
    x = [r["fraction"] * 100 for r in rows]
    fig, ax = plt.subplots(figsize=(6, 3.6))
    ax.plot(x, [r["faithfulness"] for r in rows], "o-", label="faithfulness (log-prob)")
    hit_key = next(k for k in rows[0] if k.startswith("hit@"))
    ax.plot(x, [r[hit_key] / full_hit if full_hit else np.nan for r in rows], "s--", label=f"{hit_key} / full model")
    ax.axhline(1, color="black", lw=0.5)
    ax.axhline(0.7, color="grey", lw=0.5, ls=":")
    ax.set_xscale("log")
    ax.set_xlabel("edges kept (%)")
    ax.legend(fontsize=8)
    ax.set_title(title or f"CPR {curve['cpr']:.3f}, CMD {curve['cmd']:.3f}", fontsize=9)
    return save_figure(fig, path)


def edit_lens_figure(rows: list[dict], models: dict[str, str], path: str | Path, title: str = "") -> Path:
    """Per head of either circuit: the median logit-lens rank of the new and the original object in its output,
    before and after the edit (log scale; lower is more carried)."""
    heads = [r["head"] for r in rows]
    fig, ax = plt.subplots(figsize=(max(6, 0.35 * len(heads) + 2), 4))
    x = np.arange(len(heads))
    styles = {
        ("before", "new"): ("#1f77b4", "o"),
        ("after", "new"): ("#d62728", "o"),
        ("before", "original"): ("#1f77b4", "x"),
        ("after", "original"): ("#d62728", "x"),
    }
    for (model, obj), (color, marker) in styles.items():
        ax.scatter(
            x,
            [1 + r[f"{model}: {obj}"] for r in rows],
            color=color,
            marker=marker,
            s=24,
            label=f"{models[model]}: {obj} object",
        )
    ax.set_yscale("log")
    ax.set_xticks(x, heads, rotation=90, fontsize=6)
    ax.set_ylabel("1 + median rank in the head's output")
    ax.legend(fontsize=6)
    ax.set_title(title, fontsize=9)
    return save_figure(fig, path)
