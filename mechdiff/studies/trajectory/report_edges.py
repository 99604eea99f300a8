"""The trajectory report's edges section (where the study ran the edge stages, ``[edges]``): node overlap beside
edge overlap, and where "nodes stable, edges move" is shown."""

from __future__ import annotations

from .report_parts import ReportPart, cols, interval_text, verdict


def edge_rows(record: dict, steps: dict[str, int]) -> list[dict]:
    """The edge stage's comparisons as rows, node overlap beside edge overlap on each: consecutive steps, then each
    step against the final one; each overlap with its interval over prompts, (null - cross) with its `verdict`,
    and the `reading` (``nodes stable, edges move`` only where both intervals carry it)."""
    margin = record["margin"]
    pairs = [(c["from"], c["to"], c) for c in record["consecutive"]]
    pairs += [(c["checkpoint"], None, c) for c in record["against_final"]]
    rows = []
    for s, t, c in pairs:
        row: dict = {"against": "final" if t is None else "next", "from_step": steps[s]}
        row["to_step"] = steps[t if t is not None else list(record["null"])[-1]]
        for kind in ("nodes", "edges"):
            d = c[kind]
            row.update(
                {
                    **cols(f"{kind}_cross", d["cross"]),
                    **cols(f"{kind}_null_minus_cross", d["null_minus_cross"]),
                    f"{kind}_change": verdict(d, margin),
                }
            )
        rows.append({**row, "reading": c["reading"]})
    return rows


def edge_sentence(rows: list[dict]) -> str:
    """Where "nodes stable, edges move" is shown, and that it is not shown elsewhere."""
    from ...methods.edge_structure import STABLE_MOVE

    pairs = {(r["from_step"], r["to_step"]): r for r in rows}  # a step against the final one may be consecutive
    shown = {f"{a}-{b}": r for (a, b), r in pairs.items() if r["reading"] == STABLE_MOVE}
    if not shown:
        return f'"{STABLE_MOVE}" (Wang et al. 2025) is not shown at any of the {len(pairs)} comparisons.'
    where = list(shown)
    moved = [w for w, r in shown.items() if str(r["nodes_change"]).startswith("changed")]
    return (
        f'"{STABLE_MOVE}" (Wang et al. 2025) is shown at {", ".join(where)} (the node difference the same within the '
        "margin, the edge difference above 0, both on intervals over prompts); not shown at the other "
        f"{len(pairs) - len(where)} of {len(pairs)} distinct comparisons."
        + (
            f" At {', '.join(moved)} the node difference is also above 0 (a change of the nodes shown, smaller "
            "than the margin): stable only within the margin."
            if moved
            else ""
        )
    )


class EdgesReport(ReportPart):
    def edges(self) -> None:
        """Edges beside nodes (``[edges]``): each checkpoint's top-n edges of the EAP graph and their nodes, compared
        across the scored steps; nothing where the study did not run the edge stages."""
        rec = self.r.get("edges")
        if rec is None:
            self.drop("edges_null", "edges_nodes")
            return
        st, steps = rec.result, dict(zip(self.names, self.steps))
        null_rows = [
            {
                "step": steps[c],
                "nodes_in_top": len(st["top"][c]["nodes"]),
                **cols("nodes_null", st["null"][c]["nodes"]),
                **cols("edges_null", st["null"][c]["edges"]),
            }
            for c in st["null"]
        ]
        rows = edge_rows(st, steps)
        e, how = self.s.st.edges, interval_text(st)
        g = st["graph"]
        self.edge_readme = edge_sentence(rows)
        self.sections.append(
            "## Edges beside nodes\n\n"
            f"The EAP edge graph ({g['n_edges']} edges among the embeddings, {g['n_layers']} x {g['n_heads']} heads, "
            f"{g['n_layers']} MLPs and the logits; position-free) scored per prompt by {e.method} on the "
            f"{st['prompts']} ranking prompts the node circuits rank on, with their metric and their mean ablation "
            "(each sender's position-wise mean over the reference prompts of the prompt's template and length). On "
            f"any set of prompts a checkpoint's discovery is its top {st['top_n']} edges by |mean attribution| and "
            "their nodes (the heads and MLPs they leave or enter). Edges and nodes are compared exactly as the node "
            f"structure compares pairs: the null from disjoint halves ({st['draws']} splits), the cross overlap on "
            f"opposite halves, (null - cross) paired by split; intervals: {how}; 'changed' and 'same within "
            f"{st['margin']:g}' as above.\n\n"
            + edge_sentence(rows)
            + "\n\n"
            + self.table(
                null_rows,
                "edges_null",
                "Within-checkpoint null of the top-n edges and of their nodes, and how many nodes the top-n edges "
                f"of all the prompts touch ({how})",
            )
            + "\n"
            + self.table(
                rows,
                "edges_nodes",
                "Node overlap beside edge overlap: consecutive steps, then each step against the final one; cross "
                f"overlap and (null - cross) of each ({how}), their verdicts, and the reading",
            )
        )

    def edge_findings(self) -> str:
        """The README's edges section ('' where the study did not run the edge stages)."""
        if self.r.get("edges") is None:
            return ""
        return (
            "## Findings: edges beside nodes\n\n"
            + self.edge_readme
            + " Node overlap beside edge overlap on each comparison: `tables/edges_nodes.md`.\n\n"
        )
