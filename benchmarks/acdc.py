"""Benchmark exact ACDC on a real model: plain vs incremental vs batched vs dead-node skipping vs pre-filter.

Every figure is measured in this process, on the same facts (``--facts`` facts of one relation that the
model gets right at top-1, of one token length: one batch), at the paper's setting (zero ablation,
match_nll, ``--tau``). To keep it short, every variant runs on the same small problem: ACDC over the
``--edges`` edges of highest |EAP| (the rest removed), so each variant tries the same edges and must keep
the same ones (printed). It prints:

1. the unit: one plain edge forward of the facts (every edge kept), in seconds;
2. per variant: seconds, edges tried, forwards, forward-pass equivalents (copies x fraction of blocks
   computed), seconds per tried edge, and whether the kept edges equal the plain run's;
3. the estimated time of a full run on ``--est-facts`` facts: plain ACDC over every edge (one full forward
   each), the fast variant over every edge with each edge tried (an upper bound: dead-node skipping only
   lowers it), and the fast variant on pre-filters of 1%, 2%, 5% and 10% of the edges (upper bounds the
   same way); the per-edge cost of each tried edge is the fast variant's measured seconds per forward-pass
   equivalent times the blocks an edge into its layer recomputes, and cost scales with facts x tokens.

    OMP_NUM_THREADS=1 nice -n 19 python benchmarks/acdc.py --model smollm2-135m --relation country_capital
"""

from __future__ import annotations

import argparse
import time

import numpy as np
import torch

from mechdiff.knowledge.acdc import acdc
from mechdiff.knowledge.data import FactBatch, Relation, batches, build_facts
from mechdiff.knowledge.discovery import attribution_scores
from mechdiff.knowledge.forward import edge_forward
from mechdiff.knowledge.graph import Graph
from mechdiff.models.loading import load_model


def top1_facts(model, relation: str, n: int) -> FactBatch:
    """``n`` facts of ``relation`` whose answer is the model's top-1 token, all of the most common length."""
    facts = build_facts(model.tokenizer, Relation.load(relation))
    right = []
    for b in batches(facts, 64):
        with torch.no_grad():
            top = edge_forward(model, Graph.for_model(model), b.ids, None).logits.argmax(-1)
        right += [f for f, ok in zip(b.facts, (top == b.answers).tolist()) if ok]
    lengths = [len(f.ids) for f in right]
    common = max(set(lengths), key=lengths.count)
    chosen = [f for f in right if len(f.ids) == common][:n]
    if len(chosen) < n:
        raise SystemExit(f"{relation}: only {len(chosen)} top-1 facts of {common} tokens; ask for fewer")
    return batches(chosen, n)[0]


def edge_costs(graph: Graph) -> np.ndarray:
    """Per edge: the fraction of a forward that trying it recomputes ((blocks from its layer + 1) / (L + 1))."""
    L = graph.n_layers
    out = np.empty(graph.n_edges)
    for kind, layer, off, r, s in graph.blocks:
        first = L if kind == "logits" else layer
        out[off:off + r * s] = (L - first + 1) / (L + 1)
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="smollm2-135m")
    ap.add_argument("--relation", default="country_capital")
    ap.add_argument("--facts", type=int, default=2)
    ap.add_argument("--edges", type=int, default=300, help="ACDC on the top this many edges by |EAP|")
    ap.add_argument("--tau", type=float, default=0.02)
    ap.add_argument("--batch", type=int, default=8, help="candidate edges per forward in the batched variants")
    ap.add_argument("--est-facts", type=int, default=20, help="facts in the estimated full run")
    ap.add_argument("--est-tokens", type=int, default=0, help="tokens per fact in the estimate (0: as measured)")
    args = ap.parse_args()
    torch.set_grad_enabled(False)
    model = load_model(args.model)
    graph = Graph.for_model(model)
    b = top1_facts(model, args.relation, args.facts)
    n_tok = b.ids.shape[1]
    print(f"{args.model}: {graph.n_edges} edges; {args.facts} facts of {args.relation} ({n_tok} tokens), "
          f"tau {args.tau}, zero ablation, match_nll; torch threads {torch.get_num_threads()}")

    edge_forward(model, graph, b.ids, None)  # warm-up
    times = []
    for _ in range(5):
        t = time.perf_counter()
        edge_forward(model, graph, b.ids, None)
        times.append(time.perf_counter() - t)
    unit = float(np.median(times))
    print(f"unit: one edge forward of the {args.facts} facts: {unit * 1000:.1f} ms")

    with torch.enable_grad():
        scores = attribution_scores(model, graph, [b], "eap", progress=False)
    fraction = args.edges / graph.n_edges
    variants = [("plain (full forward per edge)", dict(incremental=False, batch=1, skip_dead=False)),
                ("incremental", dict(incremental=True, batch=1, skip_dead=False)),
                (f"incremental + batched ({args.batch})", dict(incremental=True, batch=args.batch, skip_dead=False)),
                (f"incremental + batched + dead nodes", dict(incremental=True, batch=args.batch, skip_dead=True))]
    rows, ref = [], None
    for name, kw in variants:
        r = acdc(model, graph, [b], args.tau, scores=scores, prefilter=fraction, progress=False, **kw)
        ref = r if ref is None else ref
        same = bool((r.mask == ref.mask).all())
        diff = float(np.nanmax(np.abs(r.effect - ref.effect)[~np.isnan(ref.effect) & ~np.isnan(r.effect)]))
        rows.append((name, r))
        print(f"{name:40s} {r.seconds:7.1f} s  tried {r.trials:4d}  skipped {r.skipped:4d}  forwards {r.forwards:4d}  "
              f"fwd-equiv {r.cost:7.1f}  {1000 * r.seconds / max(r.trials, 1):7.1f} ms/tried edge  "
              f"kept {int(r.mask.sum())}  same as plain: {same} (max |effect diff| {diff:.1e})")
    plain, fast = rows[0][1], rows[2][1]
    s_per_equiv = fast.seconds / fast.cost  # batched incremental, every candidate tried
    scale = args.est_facts / args.facts * ((args.est_tokens or n_tok) / n_tok)
    cost = edge_costs(graph)
    order = np.argsort(-np.abs(scores), kind="stable")
    redo = fast.copies / max(fast.trials, 1)  # copies per tried edge (redone speculative tries)
    print(f"\nseconds per forward-pass equivalent: plain {plain.seconds / plain.cost:.3f}, batched incremental "
          f"{s_per_equiv:.3f}; copies per tried edge {redo:.2f}")
    print(f"estimate for {args.est_facts} facts x {args.est_tokens or n_tok} tokens (one core as measured; hours):")
    print(f"  plain ACDC, every edge: {graph.n_edges * plain.seconds / plain.trials * scale / 3600:.1f} h")
    for frac in (1.0, 0.10, 0.05, 0.02, 0.01):
        edges = order[:int(np.ceil(frac * graph.n_edges))]
        secs = cost[edges].sum() * redo * s_per_equiv * scale
        print(f"  incremental + batched, pre-filter {100 * frac:5.1f}% ({len(edges)} edges), every edge tried: "
              f"{secs / 3600:.2f} h (dead-node skipping only lowers this)")


if __name__ == "__main__":
    main()
