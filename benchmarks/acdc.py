"""Benchmark exact ACDC on a real model: plain vs incremental vs batched vs dead-node skipping, and estimates.

Every figure is measured in this process (CPU time of this process, so that a machine shared with other
work does not inflate it; wall time beside it), on the same facts (``--facts`` facts of one relation that the
model gets right at top-1, of one token length: one batch), at the paper's setting (zero ablation,
match_nll, ``--tau``). It prints:

1. the unit: one plain edge forward of the facts (every edge kept), in seconds;
2. per variant, on one small problem (ACDC trying only the ``--edges`` edges of highest |EAP|, the
   pre-filter; every variant tries the same edges and must keep the same ones, printed): seconds, edges
   tried, forwards, forward-pass equivalents (copies x (blocks computed + 1) / (layers + 1)), seconds per
   tried edge;
3. the fast variant on the full graph (no pre-filter) for its first ``--last-trials`` tried edges
   (``LOGITS``, then the last layer), and from it the estimated full run: every layer's edges tried in the
   share the last layer's were (the rest skipped as dead), each tried edge costing what its layer
   recomputes at the measured seconds per forward-pass equivalent; plain ACDC (one full forward per edge)
   and the pre-filtered runs (every candidate tried: an upper bound) beside it.

    OMP_NUM_THREADS=1 nice -n 19 python benchmarks/acdc.py --model smollm2-135m --relation country_capital
"""

from __future__ import annotations

import argparse
import time

import numpy as np
import torch

from mechdiff.methods.knowledge.acdc import acdc
from mechdiff.methods.knowledge.discovery import attribution_scores
from mechdiff.methods.knowledge.forward import edge_forward
from mechdiff.methods.knowledge.graph import Graph
from mechdiff.models.loading import load_model
from mechdiff.tasks.relation_data import FactBatch, Relation, batches, build_facts


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
        out[off : off + r * s] = (L - first + 1) / (L + 1)
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
    ap.add_argument(
        "--last-trials",
        type=int,
        default=1500,
        help="full graph: measure the fast variant over this many tried edges (LOGITS, then the last layer)",
    )
    args = ap.parse_args()
    torch.set_grad_enabled(False)
    model = load_model(args.model)
    graph = Graph.for_model(model)
    b = top1_facts(model, args.relation, args.facts)
    n_tok = b.ids.shape[1]
    print(
        f"{args.model}: {graph.n_edges} edges; {args.facts} facts of {args.relation} ({n_tok} tokens), "
        f"tau {args.tau}, zero ablation, match_nll; torch threads {torch.get_num_threads()}"
    )

    edge_forward(model, graph, b.ids, None)  # warm-up
    times, cpu = [], []
    for _ in range(5):
        t, c = time.perf_counter(), time.process_time()
        edge_forward(model, graph, b.ids, None)
        times.append(time.perf_counter() - t)
        cpu.append(time.process_time() - c)
    print(
        f"unit: one edge forward of the {args.facts} facts: {1000 * np.median(cpu):.1f} ms CPU "
        f"({1000 * np.median(times):.1f} ms wall)"
    )

    with torch.enable_grad():
        scores = attribution_scores(model, graph, [b], "eap", progress=False)
    fraction = args.edges / graph.n_edges
    variants = [
        ("plain (full forward per edge)", dict(incremental=False, batch=1, skip_dead=False)),
        ("incremental", dict(incremental=True, batch=1, skip_dead=False)),
        (f"incremental + batched ({args.batch})", dict(incremental=True, batch=args.batch, skip_dead=False)),
        ("incremental + batched + dead nodes", dict(incremental=True, batch=args.batch, skip_dead=True)),
    ]
    rows, ref = [], None
    for name, kw in variants:
        r = acdc(model, graph, [b], args.tau, scores=scores, prefilter=fraction, progress=False, **kw)
        ref = r if ref is None else ref
        same = bool((r.mask == ref.mask).all())
        diff = float(np.nanmax(np.abs(r.effect - ref.effect)[~np.isnan(ref.effect) & ~np.isnan(r.effect)]))
        rows.append((name, r))
        print(
            f"{name:36s} {r.cpu_seconds:6.1f} s CPU ({r.seconds:6.1f} wall)  tried {r.trials:4d}  "
            f"skipped {r.skipped:4d}  forwards {r.forwards:4d}  "
            f"fwd-equiv {r.cost:7.1f}  {1000 * r.cpu_seconds / max(r.trials, 1):6.1f} ms CPU/tried edge  "
            f"kept {int(r.mask.sum())}  same as plain: {same} (max |effect diff| {diff:.1e})"
        )
    plain, fast = rows[0][1], rows[2][1]
    s_per_equiv = fast.cpu_seconds / fast.cost  # batched incremental, every candidate tried
    redo = fast.copies / max(fast.trials, 1)  # copies per tried edge (redone speculative tries)
    print(
        f"\nCPU seconds per forward-pass equivalent: plain {plain.cpu_seconds / plain.cost:.3f}, batched incremental "
        f"{s_per_equiv:.3f}; copies per tried edge {redo:.2f}"
    )

    # the full graph, no pre-filter: LOGITS and the last layer, measured; the rest extrapolated
    last = acdc(model, graph, [b], args.tau, batch=args.batch, progress=False, max_trials=args.last_trials)
    print(
        f"\nfull graph, fast variant, first {last.trials} tried edges (LOGITS then layer "
        f"{graph.n_layers - 1}): {last.cpu_seconds:.0f} s CPU, {last.skipped} edges skipped as dead, "
        f"{1000 * last.cpu_seconds / max(last.trials, 1):.0f} ms CPU per tried edge"
    )
    L = graph.n_layers
    tried_last = last.trials - graph.n_senders  # LOGITS is never dead: its n_senders edges are all tried
    tried_share = tried_last / max(tried_last + last.skipped, 1)  # of the last layer's edges met so far
    cost = edge_costs(graph)
    secs_last = last.cpu_seconds / max(last.cost, 1e-9)  # seconds per forward-pass equivalent, full-graph trials
    est = cost.sum() * tried_share * last.copies / max(last.trials, 1) * secs_last
    scale = args.est_facts / args.facts * ((args.est_tokens or n_tok) / n_tok)
    print(
        "estimate, full ACDC over every edge (plain): "
        f"{graph.n_edges * plain.cpu_seconds / plain.trials * scale / 3600:.1f} h "
        f"for {args.est_facts} facts (linear in facts: an upper bound), "
        f"{graph.n_edges * plain.cpu_seconds / plain.trials / 3600:.1f} h for {args.facts}"
    )
    print(
        f"estimate, fast ACDC over every edge, {100 * tried_share:.0f}% of each layer's edges tried (as in layer "
        f"{L - 1}): {est / 3600:.1f} h for {args.facts} facts"
    )
    order = np.argsort(-np.abs(scores), kind="stable")
    for frac in (0.10, 0.05, 0.02, 0.01):
        edges = order[: int(np.ceil(frac * graph.n_edges))]
        secs = cost[edges].sum() * redo * s_per_equiv
        print(
            f"  pre-filter {100 * frac:5.1f}% ({len(edges)} edges), every candidate tried: {secs / 60:.0f} min "
            f"for {args.facts} facts (dead-node skipping only lowers this)"
        )


if __name__ == "__main__":
    main()
